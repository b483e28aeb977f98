"""Payload columns of a block: :class:`Ragged` integer columns and the operations on columns.

A block (:mod:`zephon_torch.block`) keeps dict payloads whose rows share
their keys as one column per key: a :class:`Ragged` column (flat values
plus int64 offsets, like Arrow's ``ListArray``) for token ids, a 2-D array
for rows of one length (packed rows), a list otherwise. The functions here
slice, gather and concatenate any of the three the same way, so the block
and the sources that build columns never branch on the kind themselves.

Example: three rows of token ids::

    >>> col = Ragged.from_rows([np.array([5, 6, 1]), np.array([], int), np.array([7, 1])])
    >>> col.offsets.tolist(), col.lengths().tolist()
    ([0, 3, 3, 5], [3, 0, 2])
    >>> [r.tolist() for r in col.take(np.array([2, 0])).rows()]
    [[7, 1], [5, 6, 1]]
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "Ragged",
    "column_concat",
    "column_rows",
    "column_slice",
    "column_take",
    "concat_columns",
    "fields_of_payloads",
    "gather_runs",
    "payloads_of_fields",
    "same_kind",
]


class Ragged:
    """Rows of different lengths: one flat ``values`` array and ``offsets`` into it.

    Row ``i`` is ``values[offsets[i]:offsets[i + 1]]`` (a view). ``offsets``
    (int64, ``n + 1`` entries) need not start at 0: a slice of a ragged
    column shares its parent's values.
    """

    __slots__ = ("offsets", "values")

    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        self.values = values
        self.offsets = offsets

    @classmethod
    def from_rows(cls, rows: Sequence[Any], dtype: Any = None) -> Ragged:
        """Concatenate 1-D rows into one ragged column."""
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if rows:
            values = np.concatenate([np.asarray(r) for r in rows])
            if dtype is not None:
                values = values.astype(dtype, copy=False)
        else:
            values = np.zeros(0, dtype=dtype or np.int32)
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        off = self.offsets
        return self.values[off[i]:off[i + 1]]

    def lengths(self) -> np.ndarray:
        """The length of every row (int64)."""
        return np.diff(self.offsets)

    def rows(self) -> list[np.ndarray]:
        """Every row, as views."""
        values = self.values
        bounds = self.offsets.tolist()
        return [values[a:b] for a, b in itertools.pairwise(bounds)]

    def slice(self, start: int, stop: int) -> Ragged:
        """Rows ``start..stop-1``, sharing the values."""
        return Ragged(self.values, self.offsets[start:stop + 1])

    def take(self, index: np.ndarray) -> Ragged:
        """The rows ``index`` (in that order), gathered into a new column."""
        offsets, gather = gather_runs(self.offsets, index)
        return Ragged(self.values[gather], offsets)

    def compact(self) -> Ragged:
        """The same rows in a column of its own (offsets from 0, no foreign values)."""
        off = self.offsets
        if off[0] == 0 and off[-1] == len(self.values):
            return self
        return Ragged(self.values[off[0]:off[-1]].copy(), off - off[0])

    @staticmethod
    def concat(parts: Sequence[Ragged]) -> Ragged:
        """The rows of every part, in order."""
        if len(parts) == 1:
            return parts[0]
        values = np.concatenate([p.values[p.offsets[0]:p.offsets[-1]] for p in parts])
        offsets = np.zeros(sum(len(p) for p in parts) + 1, dtype=np.int64)
        pos, base = 1, 0
        for p in parts:
            n = len(p)
            offsets[pos:pos + n] = p.offsets[1:] - p.offsets[0] + base
            base += int(p.offsets[-1] - p.offsets[0])
            pos += n
        return Ragged(values, offsets)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ragged):
            return NotImplemented
        return (np.array_equal(self.lengths(), other.lengths())
                and self.values.dtype == other.values.dtype
                and np.array_equal(self.compact().values, other.compact().values))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        count = int(self.offsets[-1] - self.offsets[0])
        return f"Ragged({len(self)} rows, {self.values.dtype}, {count} values)"


def gather_runs(offsets: np.ndarray, index: Any) -> tuple[np.ndarray, np.ndarray]:
    """For rows ``index`` of a table with row ``offsets``: the new offsets, and the
    positions of the rows' entries, in order (a gather index)."""
    index = np.asarray(index, dtype=np.int64)
    starts = offsets[index]
    lengths = offsets[index + 1] - starts
    new = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new[1:])
    gather = np.arange(int(new[-1]), dtype=np.int64) + np.repeat(starts - new[:-1], lengths)
    return new, gather


def concat_columns(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Column dicts of consecutive runs of rows as one (None if their layouts differ)."""
    if len(runs) == 1:
        return dict(runs[0])
    out: dict[str, Any] = {}
    for name in runs[0]:
        if any(list(run) != list(runs[0]) for run in runs):
            return None
        parts = [run[name] for run in runs]
        if not same_kind(parts):
            return None
        out[name] = column_concat(parts)
    return out


def column_rows(column: Any) -> list[Any]:
    """Every row of a column, in order (views of a ragged or array column)."""
    if isinstance(column, Ragged):
        return column.rows()
    if isinstance(column, np.ndarray):
        return list(column)
    return list(column)


def column_take(column: Any, index: np.ndarray) -> Any:
    """The rows ``index`` of a column, in that order."""
    if isinstance(column, (Ragged, np.ndarray)):
        return column.take(index) if isinstance(column, Ragged) else column[index]
    return [column[i] for i in index.tolist()]


def column_slice(column: Any, start: int, stop: int) -> Any:
    """Rows ``start..stop-1`` of a column (sharing its values)."""
    if isinstance(column, Ragged):
        return column.slice(start, stop)
    return column[start:stop]


def column_concat(parts: Sequence[Any]) -> Any:
    """The rows of columns of one kind (see :func:`same_kind`), in order."""
    first = parts[0]
    if isinstance(first, Ragged):
        return Ragged.concat(parts)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts)
    out: list[Any] = []
    for p in parts:
        out.extend(p)
    return out


def same_kind(parts: Sequence[Any]) -> bool:
    """Whether columns can be concatenated as one: all ragged of one dtype, all arrays
    of one dtype and row shape, or all lists."""
    first = parts[0]
    if isinstance(first, Ragged):
        return all(isinstance(p, Ragged) and p.values.dtype == first.values.dtype
                   for p in parts)
    if isinstance(first, np.ndarray):
        return all(isinstance(p, np.ndarray) and p.dtype == first.dtype
                   and p.shape[1:] == first.shape[1:] for p in parts)
    return all(isinstance(p, list) for p in parts)


def payloads_of_fields(fields: Mapping[str, Any], tomb: np.ndarray | None) -> list[Any]:
    """Every row's dict payload, built from the columns ``fields`` (``None`` where ``tomb``)."""
    keys = list(fields)
    columns = [column_rows(c) for c in fields.values()]
    if len(keys) == 1:
        key = keys[0]
        out = [{key: v} for v in columns[0]]
    else:
        out = [dict(zip(keys, values)) for values in zip(*columns)]
    if tomb is not None:
        for i in np.flatnonzero(tomb).tolist():
            out[i] = None
    return out


def fields_of_payloads(payloads: Sequence[Any], dead: np.ndarray | None
                       ) -> dict[str, Any] | None:
    """The payloads as columns, or ``None`` where they do not allow it.

    Every data row's payload (the rows not ``dead``) must be a dict with the
    same keys; a field whose values are all 1-D integer arrays of one dtype
    becomes a :class:`Ragged` column (one copy), any other field a list
    (``None`` on dead rows).
    """
    keys = None
    for i, p in enumerate(payloads):
        if dead is not None and dead[i]:
            continue
        if type(p) is not dict or (keys is not None and list(p) != keys):
            return None
        keys = keys if keys is not None else list(p)
    if keys is None:
        return None
    fields: dict[str, Any] = {}
    for key in keys:
        values = [None if (dead is not None and dead[i]) else p[key]
                  for i, p in enumerate(payloads)]
        live = [v for v in values if v is not None]
        if live and all(type(v) is np.ndarray and v.ndim == 1 and v.dtype.kind in "iu"
                        and v.dtype == live[0].dtype for v in live):
            fields[key] = Ragged.from_rows(
                [np.zeros(0, live[0].dtype) if v is None else v for v in values],
                dtype=live[0].dtype)
        else:
            fields[key] = values
    return fields
