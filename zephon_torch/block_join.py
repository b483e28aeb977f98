"""Joining blocks: the columns of :meth:`Block.concat` and :meth:`Block.gather`.

Both build the columns of one block out of the rows of several blocks of one
lane, column by column: a column that no block has stays absent (``None``),
one that some blocks lack is filled with its neutral value for their rows
(``()`` lineage, ``None`` tags, no contributors, not a tombstone). Payload
columns join as columns where every block has the same keys and kinds, and
as payload objects otherwise. The functions return the columns, and
:class:`~zephon_torch.block.Block` makes the block of them.

Example: ``concat`` of a block of 2 plain rows and one of 1 tombstone gives
``tomb [F, F, T]`` and ``reason [None, None, "empty"]``; ``gather`` of rows
``(block 1, row 0), (block 0, row 1)`` of packed rows (``(n, max_length)``
arrays) copies each row once into new arrays, in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon_torch.block_columns import column_concat, same_kind
from zephon_torch.block_ids import Contributors

if TYPE_CHECKING:
    from zephon_torch.block import Block

__all__ = ["concat_blocks", "gather_arrays"]


def concat_blocks(blocks: Sequence[Block]) -> dict[str, Any]:
    """The columns (all but ``lane`` and ``ids``) of the rows of ``blocks``, in order."""
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
        if all(same_kind(parts) for parts in columns.values()):
            fields = {k: column_concat(parts) for k, parts in columns.items()}
    if fields is None:
        payloads = []
        for b in blocks:
            payloads.extend(b.payload_list() if b.payloads is None else b.payloads)
    return {
        "payloads": payloads, "fields": fields,
        "lineage": lists("lineage", ()),
        "component": component, "counts": counts,
        "token_counts": lists("token_counts", None),
        "tomb": tomb, "reason": lists("reason", None), "detail": lists("detail", None),
        "contributors": contributors,
        "packing": lists("packing", None),
        "extra": lists("extra", None),
    }


def gather_arrays(blocks: list[Block], groups: np.ndarray, owner: np.ndarray,
                  row: np.ndarray) -> tuple[np.ndarray, dict[str, Any]] | None:
    """:meth:`Block.gather` for blocks whose payload columns are all arrays of one
    layout (packed rows): each column assembled once, in place.

    Returns:
        ``(ids, columns)`` of the gathered rows (``columns``: all but ``lane``
        and ``ids``), or ``None`` where the blocks differ in layout or lane.
    """
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
    return ids, {"fields": fields, "lineage": pick("lineage", ()),
                 "component": component, "counts": counts,
                 "token_counts": pick("token_counts", None), "tomb": tomb,
                 "reason": pick("reason", None), "detail": pick("detail", None),
                 "contributors": contributors, "packing": pick("packing", None),
                 "extra": pick("extra", None)}
