"""Blocks: one lane's micro-batch of records, stored as columns.

Between built-in stages the unit of work is a :class:`Block`, not a list of
:class:`~zephon_torch.types.SampleRecord`. A block holds the records of one
lane and one micro-batch as a few arrays, so a stage pays per block, not per
document: identity, accounting and payloads are array operations. The public
types stay the contract: :meth:`Block.records` builds records equal, field
for field, to those the object path builds, and :meth:`Block.from_records`
turns any records back into a block (the round trip is exact).

========================  ==================================================
column                    holds
========================  ==================================================
``lane``                  the lane of every row (one scalar per block)
``ids``                   int64 ``(n, 5)``: dataset, shard, local id (the
                          ``sample_id``), ``chunk_id``, ``chunk_offset``
``lineage``               ``None`` (every row a base sample) or one tuple
                          per row
``component``             int64 ``(n,)``: the row counts as one sample of
                          this component (``{c: 1}``; ``-1``: ``{}``), or
``counts``                one ``component_sample_counts`` dict per row
``token_counts``          ``None`` or one ``component_token_counts`` per row
``tomb``                  ``None`` (no tombstone) or bool ``(n,)``, with
                          ``reason``/``detail`` per row
``contributors``          :class:`Contributors`: the contributor table of
                          packed rows (a row with no entry is its own, sole
                          contributor)
``packing``               ``None`` or one ``_packing_metadata`` dict per row
``extra``                 ``None`` or, per row, tags beyond the reserved ones
``payloads`` / ``fields``  the payloads: one object per row, or, for dict
                          payloads with the same keys, one column per key (a
                          :class:`Ragged` integer column for token fields, a
                          2-D array for fixed-length rows, a list otherwise)
========================  ==================================================

Tombstones are rows (``tomb``); their payload is ``None``. Flush sentinels
are not rows: they travel between blocks as :class:`Sentinel` items.

Example: the records of chunk 3 of lane 1 after ``tokenize``::

    ids     [[0, 2, 17, 3, 0],      fields {"text": ["a b", "", "c"],
             [0, 2, 40, 3, 1],              "input_ids": Ragged(values=[5, 6, 1, 7, 1],
             [0, 2, 9,  3, 2]]                                  offsets=[0, 3, 3, 5])}
    tomb    [F, T, F]   reason [None, "empty", None]

    record(0) == SampleRecord(SampleMeta((0, 2, 17), 1, 3, 0, {0: 1}),
                              {"text": "a b", "input_ids": array([5, 6, 1])})
    record(1) is a tombstone (reason "empty", payload None)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from zephon_torch.types import (
    ContributorRef,
    SampleBatch,
    SampleCursor,
    SampleMeta,
    SampleRecord,
    metas_from_columns,
    records_from_columns,
)
from zephon_torch.vocab import (
    CONTRIBUTORS_TAG,
    FLUSH_SENTINEL_TAG,
    PACKING_METADATA_TAG,
    TOMBSTONE_DETAIL_TAG,
    TOMBSTONE_REASON_TAG,
    TOMBSTONE_TAG,
)

__all__ = [
    "ID_CHUNK",
    "ID_DATASET",
    "ID_LOCAL",
    "ID_OFFSET",
    "ID_SHARD",
    "Block",
    "BlockBatch",
    "Contributors",
    "PlainRows",
    "Ragged",
    "RowView",
    "Sentinel",
    "blocks_from_elements",
    "blocks_from_records",
    "concat_columns",
]

#: Columns of :attr:`Block.ids`.
ID_DATASET, ID_SHARD, ID_LOCAL, ID_CHUNK, ID_OFFSET = range(5)
_EMPTY_IDS = np.zeros((0, 5), dtype=np.int64)
_NO_COUNTS: dict[int, int] = {}
# One shared ``{c: 1}`` per component, as the object path shares one per dataset.
_UNIT_COUNTS: dict[int, dict[int, int]] = {}


def _unit_counts(component: int) -> dict[int, int]:
    counts = _UNIT_COUNTS.get(component)
    if counts is None:
        counts = _UNIT_COUNTS[component] = {} if component < 0 else {component: 1}
    return counts


class Sentinel(NamedTuple):
    """A flush sentinel between blocks: lane ``lane`` reaches the epoch boundary ``boundary``."""

    lane: int
    boundary: int

    def record(self) -> SampleRecord:
        """The sentinel as the object path's record (what a user accumulator would see)."""
        meta = SampleMeta((-1, -1, -1), self.lane, self.boundary, 0, None, None, (),
                          {FLUSH_SENTINEL_TAG: True})
        return SampleRecord(meta, None)


# --------------------------------------------------------------------------- ragged


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
        offsets, gather = _gather_runs(self.offsets, index)
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


def _gather_runs(offsets: np.ndarray, index: Any) -> tuple[np.ndarray, np.ndarray]:
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
        if not _same_kind(parts):
            return None
        out[name] = _column_concat(parts)
    return out


def _column_rows(column: Any) -> list[Any]:
    if isinstance(column, Ragged):
        return column.rows()
    if isinstance(column, np.ndarray):
        return list(column)
    return list(column)


def _column_take(column: Any, index: np.ndarray) -> Any:
    if isinstance(column, (Ragged, np.ndarray)):
        return column.take(index) if isinstance(column, Ragged) else column[index]
    return [column[i] for i in index.tolist()]


def _column_slice(column: Any, start: int, stop: int) -> Any:
    if isinstance(column, Ragged):
        return column.slice(start, stop)
    return column[start:stop]


def _column_concat(parts: Sequence[Any]) -> Any:
    first = parts[0]
    if isinstance(first, Ragged):
        return Ragged.concat(parts)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts)
    out: list[Any] = []
    for p in parts:
        out.extend(p)
    return out


def _same_kind(parts: Sequence[Any]) -> bool:
    first = parts[0]
    if isinstance(first, Ragged):
        return all(isinstance(p, Ragged) and p.values.dtype == first.values.dtype
                   for p in parts)
    if isinstance(first, np.ndarray):
        return all(isinstance(p, np.ndarray) and p.dtype == first.dtype
                   and p.shape[1:] == first.shape[1:] for p in parts)
    return all(isinstance(p, list) for p in parts)


# --------------------------------------------------------------------------- contributors


class Contributors:
    """The contributor table of a block: ``ContributorRef`` lists as arrays.

    Row ``r`` of the block lists the entries ``offsets[r]:offsets[r + 1]``; a
    row with no entry is a plain record (its own sole contributor). Each entry
    is a cursor (``ids``: dataset, shard, local, chunk, offset, and
    ``lineage``) and whether it is the last child closing its base offset
    (``last``).
    """

    __slots__ = ("ids", "last", "lineage", "offsets")

    def __init__(self, offsets: np.ndarray, ids: np.ndarray, lineage: list[tuple] | None,
                 last: np.ndarray) -> None:
        self.offsets = offsets
        self.ids = ids
        self.lineage = lineage
        self.last = last

    @classmethod
    def empty(cls, n: int) -> Contributors:
        """A table of ``n`` rows without entries."""
        return cls(np.zeros(n + 1, dtype=np.int64), _EMPTY_IDS, None, np.zeros(0, dtype=bool))

    def counts(self) -> np.ndarray:
        """Entries per row."""
        return np.diff(self.offsets)

    def refs(self, row: int) -> tuple[ContributorRef, ...]:
        """The ``ContributorRef`` tuple of one row (empty for a plain row)."""
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        if a == b:
            return ()
        ids = self.ids[a:b].tolist()
        lineage = self.lineage[a:b] if self.lineage is not None else itertools.repeat(())
        last = self.last[a:b].tolist()
        return tuple(ContributorRef(SampleCursor(c, o, (d, s, loc), lin), is_last)
                     for (d, s, loc, c, o), lin, is_last in zip(ids, lineage, last))

    def take(self, index: np.ndarray) -> Contributors:
        """The rows ``index``, in that order."""
        offsets, gather = _gather_runs(self.offsets, index)
        lineage = None if self.lineage is None else [self.lineage[g] for g in gather.tolist()]
        return Contributors(offsets, self.ids[gather], lineage, self.last[gather])

    def slice(self, start: int, stop: int) -> Contributors:
        """Rows ``start..stop-1``."""
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        lineage = None if self.lineage is None else self.lineage[a:b]
        return Contributors(self.offsets[start:stop + 1] - a, self.ids[a:b], lineage,
                            self.last[a:b])

    @staticmethod
    def gather(tables: Mapping[int, Contributors],
               picks: Sequence[tuple[int, int]]) -> Contributors:
        """Row ``r`` of table ``b`` for each ``(b, r)`` of ``picks``, in that order."""
        starts = [int(tables[b].offsets[r]) for b, r in picks]
        stops = [int(tables[b].offsets[r + 1]) for b, r in picks]
        lengths = np.array([b - a for a, b in zip(starts, stops)], dtype=np.int64)
        offsets = np.zeros(len(picks) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = [tables[b].ids[a:e] for (b, _), a, e in zip(picks, starts, stops)]
        last = [tables[b].last[a:e] for (b, _), a, e in zip(picks, starts, stops)]
        lineage = None
        if any(t.lineage is not None for t in tables.values()):
            lineage = []
            for (b, _), a, e in zip(picks, starts, stops):
                table = tables[b]
                lineage.extend(table.lineage[a:e] if table.lineage is not None
                               else [()] * (e - a))
        return Contributors(offsets, np.concatenate(ids) if ids else _EMPTY_IDS, lineage,
                            np.concatenate(last) if last else np.zeros(0, dtype=bool))

    @staticmethod
    def concat(parts: Sequence[Contributors]) -> Contributors:
        """The rows of every part, in order."""
        if len(parts) == 1:
            return parts[0]
        sizes = [int(p.offsets[-1]) for p in parts]
        offsets = np.zeros(sum(len(p.offsets) - 1 for p in parts) + 1, dtype=np.int64)
        pos, base = 1, 0
        for p, size in zip(parts, sizes):
            n = len(p.offsets) - 1
            offsets[pos:pos + n] = p.offsets[1:] + base
            base += size
            pos += n
        lineage = None
        if any(p.lineage is not None for p in parts):
            lineage = []
            for p, size in zip(parts, sizes):
                lineage.extend(p.lineage if p.lineage is not None else [()] * size)
        return Contributors(offsets, np.concatenate([p.ids for p in parts]), lineage,
                            np.concatenate([p.last for p in parts]))


def _refs_ok(refs: Any) -> bool:
    """Whether a ``_contributors`` value is the standard tuple of ``ContributorRef``."""
    return (type(refs) is tuple and len(refs) > 0
            and all(type(r) is ContributorRef and type(r.cursor) is SampleCursor
                    and type(r.is_last_child) is bool for r in refs))


# --------------------------------------------------------------------------- the block


class Block:
    """The records of one lane and one micro-batch, as columns (see the module doc).

    Blocks are treated as immutable: every operation returns a new block,
    sharing what it did not change. Build them with :meth:`from_records`, or
    directly from columns (sources and built-in operators).

    Args:
        lane: The lane of every row.
        ids: int64 ``(n, 5)``: dataset, shard, local id, chunk id, chunk offset.
        payloads: One payload per row (``None`` for tombstones); or ``None``
            with ``fields``.
        fields: Dict payloads as columns (every data row's payload is
            ``{key: column[row]}``, in the keys' order).
        lineage: ``None`` or one lineage tuple per row.
        component: int64 ``(n,)`` component per row, meaning ``{c: 1}``
            (``-1``: ``{}``); ignored when ``counts`` is given.
        counts: One ``component_sample_counts`` dict per row.
        token_counts: ``None`` or one ``component_token_counts`` per row.
        tomb: ``None`` or bool ``(n,)``: the tombstone rows.
        reason, detail: Per row, the tombstone reason and detail (``None``
            where absent).
        contributors: The contributor table, or ``None`` (every row plain).
        packing: ``None`` or one ``_packing_metadata`` dict (or ``None``) per row.
        extra: ``None`` or, per row, a dict of further tags (or ``None``).
    """

    __slots__ = ("component", "contributors", "counts", "detail", "extra", "fields", "ids",
                 "lane", "lineage", "packing", "payloads", "reason", "token_counts", "tomb")

    def __init__(
        self,
        lane: int,
        ids: np.ndarray,
        *,
        payloads: list[Any] | None = None,
        fields: dict[str, Any] | None = None,
        lineage: list[tuple[int, ...]] | None = None,
        component: np.ndarray | None = None,
        counts: list[dict[int, int]] | None = None,
        token_counts: list[dict[int, int] | None] | None = None,
        tomb: np.ndarray | None = None,
        reason: list[str | None] | None = None,
        detail: list[str | None] | None = None,
        contributors: Contributors | None = None,
        packing: list[dict[str, Any] | None] | None = None,
        extra: list[dict[str, Any] | None] | None = None,
    ) -> None:
        if (payloads is None) == (fields is None):
            raise ValueError("a block holds its payloads as objects or as fields, not both")
        self.lane = int(lane)
        self.ids = ids
        self.payloads = payloads
        self.fields = fields
        self.lineage = lineage
        self.component = component
        self.counts = counts
        self.token_counts = token_counts
        self.tomb = tomb if tomb is not None and tomb.any() else None
        self.reason = reason if self.tomb is not None else None
        self.detail = detail if self.tomb is not None else None
        self.contributors = contributors
        self.packing = packing
        self.extra = extra

    # ------------------------------------------------------------------ basics

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        kinds = (f"fields {list(self.fields)}" if self.fields is not None else "objects")
        tombs = 0 if self.tomb is None else int(self.tomb.sum())
        return f"Block(lane={self.lane}, rows={len(self)}, tombstones={tombs}, {kinds})"

    @property
    def chunk_ids(self) -> np.ndarray:
        """The ``chunk_id`` of every row."""
        return self.ids[:, ID_CHUNK]

    def data_mask(self) -> np.ndarray:
        """True for the rows that are data (not tombstones)."""
        if self.tomb is None:
            return np.ones(len(self), dtype=bool)
        return ~self.tomb

    def has_tombstones(self) -> bool:
        """Whether any row is a tombstone."""
        return self.tomb is not None

    def num_data(self) -> int:
        """Rows that are data."""
        return len(self) if self.tomb is None else int(len(self) - self.tomb.sum())

    # ------------------------------------------------------------------ payload access

    def payload(self, i: int) -> Any:
        """The payload of row ``i`` (``None`` for a tombstone)."""
        if self.payloads is not None:
            return self.payloads[i]
        if self.tomb is not None and self.tomb[i]:
            return None
        return {key: column[i] for key, column in self.fields.items()}

    def payload_list(self) -> list[Any]:
        """Every row's payload, in order (``None`` for tombstones)."""
        if self.payloads is not None:
            return list(self.payloads)
        keys = list(self.fields)
        columns = [_column_rows(c) for c in self.fields.values()]
        if len(keys) == 1:
            key = keys[0]
            out = [{key: v} for v in columns[0]]
        else:
            out = [dict(zip(keys, values)) for values in zip(*columns)]
        if self.tomb is not None:
            for i in np.flatnonzero(self.tomb).tolist():
                out[i] = None
        return out

    def columnar(self) -> Block:
        """The same rows with their dict payloads as columns, where they allow it.

        Every data row's payload must be a dict with the same keys; a field
        whose values are all 1-D integer arrays becomes a :class:`Ragged`
        column (one copy), any other field a list. Otherwise the block is
        returned as it is.
        """
        if self.fields is not None or self.payloads is None:
            return self
        dead = self.tomb
        keys = None
        for i, p in enumerate(self.payloads):
            if dead is not None and dead[i]:
                continue
            if type(p) is not dict or (keys is not None and list(p) != keys):
                return self
            keys = keys if keys is not None else list(p)
        if keys is None:
            return self
        fields: dict[str, Any] = {}
        for key in keys:
            values = [None if (dead is not None and dead[i]) else p[key]
                      for i, p in enumerate(self.payloads)]
            live = [v for v in values if v is not None]
            if live and all(type(v) is np.ndarray and v.ndim == 1 and v.dtype.kind in "iu"
                            and v.dtype == live[0].dtype for v in live):
                fields[key] = Ragged.from_rows(
                    [np.zeros(0, live[0].dtype) if v is None else v for v in values],
                    dtype=live[0].dtype)
            else:
                fields[key] = values
        return self.with_fields(fields)

    def with_payloads(self, payloads: list[Any]) -> Block:
        """The same rows with new payload objects (one per row)."""
        # Slot by slot, not through the keyword constructor: a map stage calls this
        # once per block, and nothing else changes.
        out = object.__new__(Block)
        for name in _SHARED:
            setattr(out, name, getattr(self, name))
        out.payloads = payloads
        out.fields = None
        return out

    def with_fields(self, fields: dict[str, Any]) -> Block:
        """The same rows with new payload columns."""
        return self._replace(payloads=None, fields=fields)

    # ------------------------------------------------------------------ metas and records

    def _counts_list(self) -> list[dict[int, int]]:
        if self.counts is not None:
            return self.counts
        component = self.component
        n = len(self)
        if component is None:
            return [_NO_COUNTS] * n
        if n and component[0] == component[-1] and bool((component == component[0]).all()):
            return [_unit_counts(int(component[0]))] * n  # the usual block: one component
        return [_unit_counts(c) for c in component.tolist()]

    def tags(self, i: int) -> dict[str, Any]:
        """The ``tags`` dict of row ``i``'s meta (built from the columns)."""
        tags: dict[str, Any] = {}
        contributors = self.contributors
        if contributors is not None and contributors.offsets[i] != contributors.offsets[i + 1]:
            tags[CONTRIBUTORS_TAG] = contributors.refs(i)
        if self.packing is not None and self.packing[i] is not None:
            tags[PACKING_METADATA_TAG] = self.packing[i]
        if self.tomb is not None and self.tomb[i]:
            tags[TOMBSTONE_TAG] = True
            if self.reason is not None and self.reason[i] is not None:
                tags[TOMBSTONE_REASON_TAG] = self.reason[i]
            if self.detail is not None and self.detail[i] is not None:
                tags[TOMBSTONE_DETAIL_TAG] = self.detail[i]
        if self.extra is not None and self.extra[i]:
            tags.update(self.extra[i])
        return tags

    def _plain(self) -> bool:
        return (self.contributors is None and self.packing is None and self.tomb is None
                and self.extra is None)

    def _meta_columns(self) -> tuple[list[list[int]], list[dict[int, int]], Any, Any, Any]:
        """What every row's meta is made of: the id columns, counts, token counts,
        lineage, tags."""
        tags = None
        if not self._plain():
            tags = [self.tags(i) or None for i in range(len(self))]
        return self.ids.T.tolist(), self._counts_list(), self.token_counts, self.lineage, tags

    def metas(self) -> list[SampleMeta]:
        """Every row's :class:`~zephon_torch.types.SampleMeta`, in order."""
        columns, counts, tokens, lineage, tags = self._meta_columns()
        return metas_from_columns(itertools.repeat(self.lane), columns, counts, tokens, lineage,
                                  tags)

    def records(self) -> list[SampleRecord]:
        """Every row as a :class:`~zephon_torch.types.SampleRecord`, in order."""
        columns, counts, tokens, lineage, tags = self._meta_columns()
        payloads = self.payloads if self.payloads is not None else self.payload_list()
        return records_from_columns(itertools.repeat(self.lane), columns, counts, payloads,
                                    tokens, lineage, tags)

    def record(self, i: int) -> SampleRecord:
        """Row ``i`` as a record."""
        return self.slice(i, i + 1).records()[0]

    def cursor_key(self, i: int) -> tuple[int, int, tuple[int, ...], tuple[int, int, int]]:
        """Row ``i``'s cursor key ``(chunk_id, chunk_offset, lineage, sample_id)``."""
        d, s, loc, c, o = self.ids[i].tolist()
        lineage = self.lineage[i] if self.lineage is not None else ()
        return (c, o, lineage, (d, s, loc))

    # ------------------------------------------------------------------ accounting

    def close_counts(self) -> np.ndarray:
        """How many base offsets each row closes (int64, one per row)."""
        contributors = self.contributors
        if contributors is None:
            return np.ones(len(self), dtype=np.int64)
        running = np.zeros(len(contributors.last) + 1, dtype=np.int64)
        np.cumsum(contributors.last, out=running[1:])
        offsets = contributors.offsets
        closes = running[offsets[1:]] - running[offsets[:-1]]
        return np.where(offsets[1:] > offsets[:-1], closes, 1)

    def closed_offsets(self, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(chunk_ids, offsets)`` of the base offsets closed by ``rows`` (all rows by default)."""
        block = self if rows is None else self.slice(rows.start or 0,
                                                     len(self) if rows.stop is None
                                                     else rows.stop)
        ids, contributors = block.ids, block.contributors
        if contributors is None:
            return ids[:, ID_CHUNK], ids[:, ID_OFFSET]
        own = contributors.counts() == 0
        entries = contributors.ids[contributors.last]
        chunks = np.concatenate([ids[own, ID_CHUNK], entries[:, ID_CHUNK]])
        offsets = np.concatenate([ids[own, ID_OFFSET], entries[:, ID_OFFSET]])
        return chunks, offsets

    # ------------------------------------------------------------------ reshaping

    def _replace(self, **changes: Any) -> Block:
        state = {name: getattr(self, name) for name in self.__slots__ if name not in ("lane",
                                                                                      "ids")}
        state.update(changes)
        lane = state.pop("lane", self.lane)
        ids = state.pop("ids", self.ids)
        return Block(lane, ids, **state)

    def slice(self, start: int, stop: int) -> Block:
        """Rows ``start..stop-1`` (sharing arrays where it can)."""
        if start == 0 and stop >= len(self):
            return self
        cut = slice(start, stop)
        # Filled slot by slot: a batch is a slice of its block, and this is cheaper
        # than the keyword constructor (what it checks holds for a slice already).
        out = object.__new__(Block)
        out.lane = self.lane
        out.ids = self.ids[cut]
        out.payloads = None if self.payloads is None else self.payloads[cut]
        out.fields = None if self.fields is None else {
            k: _column_slice(c, start, stop) for k, c in self.fields.items()}
        out.lineage = None if self.lineage is None else self.lineage[cut]
        out.component = None if self.component is None else self.component[cut]
        out.counts = None if self.counts is None else self.counts[cut]
        out.token_counts = None if self.token_counts is None else self.token_counts[cut]
        tomb = None if self.tomb is None else self.tomb[cut]
        if tomb is not None and tomb.any():
            out.tomb = tomb
            out.reason = None if self.reason is None else self.reason[cut]
            out.detail = None if self.detail is None else self.detail[cut]
        else:
            out.tomb = out.reason = out.detail = None
        out.contributors = (None if self.contributors is None
                            else self.contributors.slice(start, stop))
        out.packing = None if self.packing is None else self.packing[cut]
        out.extra = None if self.extra is None else self.extra[cut]
        return out

    def take(self, index: Sequence[int] | np.ndarray) -> Block:
        """The rows ``index``, in that order."""
        index = np.asarray(index, dtype=np.int64)
        listed = index.tolist()

        def pick(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[i] for i in listed]

        return Block(
            self.lane, self.ids[index],
            payloads=pick(self.payloads),
            fields=None if self.fields is None else
            {k: _column_take(c, index) for k, c in self.fields.items()},
            lineage=pick(self.lineage),
            component=None if self.component is None else self.component[index],
            counts=pick(self.counts),
            token_counts=pick(self.token_counts),
            tomb=None if self.tomb is None else self.tomb[index],
            reason=pick(self.reason),
            detail=pick(self.detail),
            contributors=None if self.contributors is None else self.contributors.take(index),
            packing=pick(self.packing),
            extra=pick(self.extra),
        )

    @staticmethod
    def concat(blocks: Sequence[Block]) -> Block:
        """The rows of every block, in order (all of one lane)."""
        blocks = [b for b in blocks if len(b)] or list(blocks[:1])
        if len(blocks) == 1:
            return blocks[0]
        lane = blocks[0].lane
        if any(b.lane != lane for b in blocks):
            raise ValueError(f"cannot concatenate blocks of lanes "
                             f"{sorted({b.lane for b in blocks})}: a block holds one lane")
        sizes = [len(b) for b in blocks]

        def lists(name: str, default: Any) -> list[Any] | None:
            values = [getattr(b, name) for b in blocks]
            if all(v is None for v in values):
                return None
            out: list[Any] = []
            for v, n in zip(values, sizes):
                out.extend(v if v is not None else [default] * n)
            return out

        if all(b.counts is None and b.component is not None for b in blocks):
            component, counts = np.concatenate([b.component for b in blocks]), None
        else:
            component, counts = None, []
            for b in blocks:
                counts.extend(b._counts_list())
        tombs = [b.tomb for b in blocks]
        tomb = None
        if any(t is not None for t in tombs):
            tomb = np.concatenate([t if t is not None else np.zeros(n, dtype=bool)
                                   for t, n in zip(tombs, sizes)])
        contributors = None
        if any(b.contributors is not None for b in blocks):
            contributors = Contributors.concat([
                b.contributors if b.contributors is not None else Contributors.empty(len(b))
                for b in blocks])
        payloads, fields = None, None
        keys = [list(b.fields) if b.fields is not None else None for b in blocks]
        if keys[0] is not None and all(k == keys[0] for k in keys):
            columns = {k: [b.fields[k] for b in blocks] for k in keys[0]}
            if all(_same_kind(parts) for parts in columns.values()):
                fields = {k: _column_concat(parts) for k, parts in columns.items()}
        if fields is None:
            payloads = []
            for b in blocks:
                payloads.extend(b.payload_list() if b.payloads is None else b.payloads)
        return Block(
            lane, np.concatenate([b.ids for b in blocks]),
            payloads=payloads, fields=fields,
            lineage=lists("lineage", ()),
            component=component, counts=counts,
            token_counts=lists("token_counts", None),
            tomb=tomb, reason=lists("reason", None), detail=lists("detail", None),
            contributors=contributors,
            packing=lists("packing", None),
            extra=lists("extra", None),
        )

    @staticmethod
    def gather(pool: Sequence[Block], owners: Sequence[int], rows: Sequence[int]) -> Block:
        """Rows of several blocks of one lane as one block: row ``rows[i]`` of block
        ``pool[owners[i]]``, in that order.

        Array columns are assembled in place (one copy of each row); where the
        blocks differ in layout, one ``take`` per block, then the order.
        """
        owner = np.asarray(owners, dtype=np.int64)
        row = np.asarray(rows, dtype=np.int64)
        groups = np.unique(owner)
        if len(groups) == 1:
            return pool[int(groups[0])].take(row)
        blocks = [pool[b] for b in groups.tolist()]
        direct = _gather_arrays(blocks, groups, owner, row)
        if direct is not None:
            return direct
        order = np.argsort(owner, kind="stable")
        parts = [pool[b].take(row[order[owner[order] == b]]) for b in groups.tolist()]
        joined = Block.concat(parts)
        back = np.empty(len(order), dtype=np.int64)
        back[order] = np.arange(len(order), dtype=np.int64)
        return joined.take(back)

    def split_at(self, cut: int) -> tuple[Block, Block]:
        """``(rows before cut, rows from cut)``."""
        return self.slice(0, cut), self.slice(cut, len(self))

    # ------------------------------------------------------------------ tombstones

    def with_tombstones(self, mask: np.ndarray, reason: str | Sequence[str],
                        detail: Sequence[str | None] | str | None = None) -> Block:
        """Turn the rows of ``mask`` into tombstones (rows already tombstones keep theirs).

        Args:
            mask: bool ``(n,)``.
            reason: One reason for every new tombstone, or one per row.
            detail: ``None``, one detail for all, or one per row.
        """
        mask = np.asarray(mask, dtype=bool)
        if self.tomb is not None:
            mask = mask & ~self.tomb
        if not mask.any():
            return self
        n = len(self)
        tomb = mask if self.tomb is None else (self.tomb | mask)
        reasons = list(self.reason) if self.reason is not None else [None] * n
        details = list(self.detail) if self.detail is not None else [None] * n
        for i in np.flatnonzero(mask).tolist():
            reasons[i] = reason if isinstance(reason, str) else reason[i]
            details[i] = detail if detail is None or isinstance(detail, str) else detail[i]
        payloads = self.payloads
        if payloads is not None:
            payloads = [None if m else p for p, m in zip(payloads, mask.tolist())]
        return self._replace(tomb=tomb, reason=reasons, detail=details, payloads=payloads)

    # ------------------------------------------------------------------ from records

    @classmethod
    def from_records(cls, records: Sequence[SampleRecord], lane: int | None = None) -> Block:
        """A block holding ``records`` (all of one lane, no flush sentinels), in order.

        ``block.records()`` gives records equal to ``records``, field for field.

        Raises:
            ValueError: The records span several lanes, or one is a flush sentinel.
        """
        metas = [r.meta for r in records]
        if lane is None:
            if not metas:
                raise ValueError("an empty block needs its lane")
            lane = metas[0].lane_id
        n = len(metas)
        if n == 0:
            return cls(lane, _EMPTY_IDS, payloads=[])
        lanes = {m.lane_id for m in metas}
        if lanes != {lane}:
            raise ValueError(f"a block holds the records of one lane, got lanes {sorted(lanes)}")
        ids = np.array([(*m.sample_id, m.chunk_id, m.chunk_offset) for m in metas],
                       dtype=np.int64).reshape(n, 5)
        lineage: list[tuple[int, ...]] | None = [m.lineage for m in metas]
        if not any(lineage):
            lineage = None
        counts_list = [m.component_sample_counts for m in metas]
        component, counts = _components_of(counts_list)
        token_counts: list[Any] | None = [m.component_token_counts for m in metas]
        if all(t is None for t in token_counts):
            token_counts = None
        payloads = [r.payload for r in records]
        block = cls(lane, ids, payloads=payloads, lineage=lineage, component=component,
                    counts=counts, token_counts=token_counts)
        tagged = [i for i, m in enumerate(metas) if m.tags]
        if tagged:
            block._take_tags([(i, metas[i].tags) for i in tagged])
        return block

    def _take_tags(self, tagged: list[tuple[int, Mapping[str, Any]]]) -> None:
        """Spread the tags of some rows into the columns (used by :meth:`from_records`)."""
        n = len(self)
        tomb = np.zeros(n, dtype=bool)
        reason: list[str | None] = [None] * n
        detail: list[str | None] = [None] * n
        packing: list[Any] = [None] * n
        extra: list[Any] = [None] * n
        refs_of: dict[int, tuple[ContributorRef, ...]] = {}
        for i, tags in tagged:
            rest: dict[str, Any] = {}
            is_tomb = tags.get(TOMBSTONE_TAG) is True
            for key, value in tags.items():
                if key == CONTRIBUTORS_TAG and _refs_ok(value):
                    refs_of[i] = value
                elif key == PACKING_METADATA_TAG and isinstance(value, dict):
                    packing[i] = value
                elif key == TOMBSTONE_TAG and value is True:
                    tomb[i] = True
                elif key == TOMBSTONE_REASON_TAG and is_tomb and isinstance(value, str):
                    reason[i] = value
                elif key == TOMBSTONE_DETAIL_TAG and is_tomb and isinstance(value, str):
                    detail[i] = value
                elif key == FLUSH_SENTINEL_TAG and value:
                    raise ValueError("a flush sentinel is not a block row: it travels between "
                                     "blocks as a Sentinel")
                else:
                    rest[key] = value
            extra[i] = rest or None
        if tomb.any():
            self.tomb, self.reason, self.detail = tomb, reason, detail
        if any(p is not None for p in packing):
            self.packing = packing
        if any(e is not None for e in extra):
            self.extra = extra
        if refs_of:
            self.contributors = _contributors_from(n, refs_of)

    # ------------------------------------------------------------------ pickling

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_restore, (self.lane, self.ids, tuple(getattr(self, name) for name in _STATE)))


_STATE = ("payloads", "fields", "lineage", "component", "counts", "token_counts", "tomb",
          "reason", "detail", "contributors", "packing", "extra")
#: What :meth:`Block.with_payloads` keeps.
_SHARED = ("lane", "ids", "lineage", "component", "counts", "token_counts", "tomb", "reason",
           "detail", "contributors", "packing", "extra")


def _gather_arrays(blocks: list[Block], groups: np.ndarray, owner: np.ndarray,
                   row: np.ndarray) -> Block | None:
    """:meth:`Block.gather` for blocks whose payload columns are all arrays of one
    layout (packed rows): each column assembled once, in place. None otherwise."""
    first = blocks[0]
    if first.fields is None or any(
            not isinstance(c, np.ndarray) for c in first.fields.values()):
        return None
    keys = list(first.fields)
    for block in blocks[1:]:
        if (block.fields is None or list(block.fields) != keys or block.lane != first.lane
                or any(not isinstance(block.fields[k], np.ndarray)
                       or block.fields[k].dtype != first.fields[k].dtype
                       or block.fields[k].shape[1:] != first.fields[k].shape[1:]
                       for k in keys)):
            return None
    n = len(row)
    where = {b: np.flatnonzero(owner == b) for b in groups.tolist()}
    by_group = dict(zip(groups.tolist(), blocks))

    def assemble(get: Any) -> np.ndarray:
        sample = get(first)
        out = np.empty((n, *sample.shape[1:]), dtype=sample.dtype)
        for b, positions in where.items():
            out[positions] = get(by_group[b])[row[positions]]
        return out

    fields = {k: assemble(lambda block, k=k: block.fields[k]) for k in keys}
    ids = assemble(lambda block: block.ids)
    picks = list(zip(owner.tolist(), row.tolist()))

    def pick(name: str, default: Any) -> list[Any] | None:
        if all(getattr(block, name) is None for block in blocks):
            return None
        return [(getattr(by_group[b], name) or [default] * len(by_group[b]))[r]
                for b, r in picks]

    if all(block.counts is None and block.component is not None for block in blocks):
        component, counts = assemble(lambda block: block.component), None
    else:
        lists = {b: block._counts_list() for b, block in by_group.items()}
        component, counts = None, [lists[b][r] for b, r in picks]
    tomb = None
    if any(block.tomb is not None for block in blocks):
        tomb = np.array([bool(by_group[b].tomb[r]) if by_group[b].tomb is not None else False
                         for b, r in picks], dtype=bool)
    contributors = None
    if any(block.contributors is not None for block in blocks):
        tables = {b: block.contributors if block.contributors is not None
                  else Contributors.empty(len(block)) for b, block in by_group.items()}
        contributors = Contributors.gather(tables, picks)
    return Block(first.lane, ids, fields=fields, lineage=pick("lineage", ()),
                 component=component, counts=counts,
                 token_counts=pick("token_counts", None), tomb=tomb,
                 reason=pick("reason", None), detail=pick("detail", None),
                 contributors=contributors, packing=pick("packing", None),
                 extra=pick("extra", None))


def _restore(lane: int, ids: np.ndarray, state: tuple[Any, ...]) -> Block:
    return Block(lane, ids, **dict(zip(_STATE, state)))


def _components_of(counts_list: list[Mapping[int, int]]) -> tuple[np.ndarray | None,
                                                                  list[dict] | None]:
    """``{c: 1}`` (or ``{}``) for every row as a component column, else the dicts."""
    component = np.empty(len(counts_list), dtype=np.int64)
    for i, counts in enumerate(counts_list):
        if type(counts) is not dict:
            return None, list(counts_list)
        if not counts:
            component[i] = -1
            continue
        if len(counts) != 1:
            return None, list(counts_list)
        (c, k), = counts.items()
        if k != 1 or type(c) is not int or c < 0 or type(k) is not int:
            return None, list(counts_list)
        component[i] = c
    return component, None


def _contributors_from(n: int, refs_of: Mapping[int, tuple[ContributorRef, ...]]
                       ) -> Contributors:
    lengths = np.zeros(n, dtype=np.int64)
    for i, refs in refs_of.items():
        lengths[i] = len(refs)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rows: list[tuple[int, ...]] = []
    lineage: list[tuple[int, ...]] = []
    last: list[bool] = []
    for i in sorted(refs_of):
        for ref in refs_of[i]:
            cur = ref.cursor
            rows.append((*cur.sample_id, cur.chunk_id, cur.chunk_offset))
            lineage.append(cur.lineage)
            last.append(ref.is_last_child)
    ids = np.array(rows, dtype=np.int64).reshape(len(rows), 5)
    return Contributors(offsets, ids, lineage if any(lineage) else None,
                        np.array(last, dtype=bool))


def blocks_from_records(records: Iterable[SampleRecord]) -> list[Block]:
    """Blocks of the records, one per lane (in order of first appearance), order kept."""
    by_lane: dict[int, list[SampleRecord]] = {}
    for record in records:
        by_lane.setdefault(record.meta.lane_id, []).append(record)
    return [Block.from_records(rs, lane) for lane, rs in by_lane.items()]


# --------------------------------------------------------------------------- plain rows

#: :class:`PlainRows`: a column whose rows hold different values.
MIXED: Any = type("Mixed", (), {"__repr__": lambda self: "MIXED", "__slots__": ()})()


class PlainRows:
    """The rows of a block without tags, ready to be handed out a few at a time.

    What the consumer needs of a block of plain data rows: the records of
    any range of rows (built only when asked for) and, for the books, the
    rows' chunk ids, offsets and cursor keys. The ids stay one numpy array;
    the per-row Python objects (counts, payloads, lineage) are the block's
    own lists, so that rows waiting in a queue cost the garbage collector
    nothing.

    Raises:
        ValueError: The block has rows with tags (tombstones, contributors,
            packing metadata, other tags).
    """

    __slots__ = ("consecutive", "counts", "ids", "lane", "lineage", "payloads", "single_chunk",
                 "token_counts", "uniform_counts")

    def __init__(self, block: Block) -> None:
        if not block._plain():
            raise ValueError("PlainRows holds rows without tags; this block has tagged rows")
        self.lane = block.lane
        ids = self.ids = block.ids
        n = len(ids)
        #: The counts object every row shares (the usual one-component block), or MIXED.
        self.uniform_counts: Any = MIXED
        component = block.component
        if block.counts is None and component is None:
            self.uniform_counts = _NO_COUNTS
        elif block.counts is None and n and component[0] == component[-1] \
                and bool((component == component[0]).all()):
            self.uniform_counts = _unit_counts(int(component[0]))
        self.counts = (block._counts_list() if self.uniform_counts is MIXED
                       else [self.uniform_counts] * n)
        self.payloads = block.payloads if block.payloads is not None else block.payload_list()
        self.token_counts = block.token_counts
        self.lineage = block.lineage
        chunks, offsets = ids[:, ID_CHUNK], ids[:, ID_OFFSET]
        #: Every row is of one chunk (the usual block).
        self.single_chunk = n < 2 or (chunks[0] == chunks[-1]
                                      and bool((chunks == chunks[0]).all()))
        #: The rows' offsets go up one at a time (a chunk's rows in order, none left out).
        self.consecutive = n < 2 or (offsets[-1] - offsets[0] == n - 1
                                     and bool((np.diff(offsets) == 1).all()))

    def __len__(self) -> int:
        return len(self.counts)

    def chunk_ids(self, start: int, stop: int) -> list[int]:
        """The ``chunk_id`` of rows ``start..stop-1``."""
        return self.ids[start:stop, ID_CHUNK].tolist()

    def offsets(self, start: int, stop: int) -> list[int]:
        """The ``chunk_offset`` of rows ``start..stop-1``."""
        return self.ids[start:stop, ID_OFFSET].tolist()

    def records(self, start: int, stop: int) -> list[SampleRecord]:
        """Rows ``start..stop-1`` as records (what ``Block.records()`` gives for them)."""
        cut = slice(start, stop)
        tokens, lineage = self.token_counts, self.lineage
        return records_from_columns(
            itertools.repeat(self.lane), self.ids[cut].T.tolist(), self.counts[cut],
            self.payloads[cut], None if tokens is None else tokens[cut],
            None if lineage is None else lineage[cut])

    def cursor_key(self, i: int) -> tuple[int, int, tuple[int, ...], tuple[int, int, int]]:
        """Row ``i``'s cursor key ``(chunk_id, chunk_offset, lineage, sample_id)``."""
        d, s, loc, c, o = self.ids[i].tolist()
        return (c, o, self.lineage[i] if self.lineage is not None else (), (d, s, loc))


# --------------------------------------------------------------------------- batches


class RowView:
    """A row as code that checks payloads reads it, without building its record.

    It answers ``row.payload``, ``row.meta.sample_id`` and ``row.meta.tags``
    (what ``to_training`` and the packers' checks read: for ``to_training``
    the packing metadata, the one tag it reads).
    """

    __slots__ = ("payload", "sample_id", "tags")

    def __init__(self, sample_id: tuple[int, int, int], payload: Any,
                 tags: Mapping[str, Any] | None = None) -> None:
        self.sample_id = sample_id
        self.payload = payload
        self.tags = {} if tags is None else tags

    @property
    def meta(self) -> RowView:
        return self


class _Rows(Sequence):
    """The rows ``to_training`` reads, plus the columns it reads them from when it can.

    As a sequence it gives a :class:`RowView` per row (built on first use: the
    general path); ``columns`` (the block's fields), ``sample_ids`` and
    ``padding_lengths`` let the common batch of packed rows be read as whole
    arrays without them.
    """

    def __init__(self, block: Block) -> None:
        self._block = block
        self._rows: list[RowView] | None = None
        self.columns = block.fields if block.tomb is None else None
        self.sample_ids = [tuple(v) for v in block.ids[:, :3].tolist()]
        packing = block.packing
        pads = None if packing is None else [
            None if info is None else info.get("padding_length") for info in packing]
        self.padding_lengths = (pads if pads is not None and all(type(p) is int for p in pads)
                                else None)

    def _items(self) -> list[RowView]:
        if self._rows is None:
            block = self._block
            packing = block.packing or [None] * len(block)
            self._rows = [
                RowView(sid, payload, {PACKING_METADATA_TAG: info} if info is not None else {})
                for sid, payload, info in zip(self.sample_ids, block.payload_list(), packing)]
        return self._rows

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: Any) -> Any:
        return self._items()[index]

    def __iter__(self) -> Any:
        return iter(self._items())


class BlockBatch(SampleBatch):
    """A :class:`~zephon_torch.types.SampleBatch` that is a view over a block of data rows.

    ``records``, ``lane_ids`` and ``chunk_ids`` are built on first access;
    ``len()``, ``ids`` and ``to_training`` read the block's columns directly.
    It is a ``SampleBatch`` in every way a caller can see.
    """

    __slots__ = ("_block",)

    def __init__(self, block: Block) -> None:
        object.__setattr__(self, "_block", block)

    def __getattr__(self, name: str) -> Any:
        # Only reached for the slots not filled yet: materialise them on demand.
        if name == "records":
            records = tuple(self._block.records())
            object.__setattr__(self, "records", records)
            return records
        if name == "lane_ids":
            value = (self._block.lane,) * len(self._block)
            object.__setattr__(self, "lane_ids", value)
            return value
        if name == "chunk_ids":
            value = tuple(self._block.chunk_ids.tolist())
            object.__setattr__(self, "chunk_ids", value)
            return value
        raise AttributeError(name)

    @property
    def block(self) -> Block:
        """The block this batch views."""
        return self._block

    def __len__(self) -> int:
        return len(self._block)

    @property
    def ids(self) -> tuple[tuple[int, int, int], ...]:
        """The ``sample_id`` of every record (from the ids column)."""
        return tuple(map(tuple, self._block.ids[:, :3].tolist()))

    def _training_rows(self) -> _Rows:
        return _Rows(self._block)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (BlockBatch, (self._block,))


def blocks_from_elements(elems: Sequence[Any], stage: str = "") -> list[Block]:
    """Blocks of a list of records, one per run of records of one lane (order kept).

    Raises:
        TypeError: An element is not a ``SampleRecord`` (a ``SampleBatch``
            before ``batch()`` means an operator is out of place).
        ValueError: A flush sentinel among them (sentinels travel between blocks).
    """
    blocks: list[Block] = []
    run: list[SampleRecord] = []
    lane = None
    for elem in elems:
        if type(elem) is not SampleRecord and not isinstance(elem, SampleRecord):
            where = f" from stage {stage!r}" if stage else ""
            raise TypeError(
                f"a {type(elem).__name__}{where} reached a stage that takes records; place "
                "record operators before batch()"
            )
        if elem.meta.lane_id != lane and run:
            blocks.append(Block.from_records(run, lane))
            run = []
        lane = elem.meta.lane_id
        run.append(elem)
    if run:
        blocks.append(Block.from_records(run, lane))
    return blocks
