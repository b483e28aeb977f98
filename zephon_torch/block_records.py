"""From records to columns: what ``Block.from_records`` stores (:mod:`zephon_torch.block`).

A record's meta is spread over the block's columns: its cursor into the ids
array, its ``component_sample_counts`` into a component column (``{c: 1}``
and ``{}``, the usual counts) or a list of dicts, and its tags into the
columns they belong to (tombstone flag, reason and detail; packing
metadata; contributors as a :class:`~zephon_torch.block_ids.Contributors`
table). Tags of no column of their own stay, per row, in ``extra``, so the
records a block gives back are equal to those it was built from.

Example: a tombstone among two plain records gives ``tomb [F, T, F]``,
``reason [None, "empty", None]`` and no ``extra``; a record tagged
``{"source": "web"}`` gives ``extra [None, {"source": "web"}, ...]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.block_ids import EMPTY_IDS, Contributors
from zephon_torch.types import ContributorRef, SampleCursor, SampleRecord
from zephon_torch.vocab import (
    CONTRIBUTORS_TAG,
    FLUSH_SENTINEL_TAG,
    PACKING_METADATA_TAG,
    TOMBSTONE_DETAIL_TAG,
    TOMBSTONE_REASON_TAG,
    TOMBSTONE_TAG,
)

__all__ = ["components_of", "contributors_of_refs", "record_columns", "tag_columns"]


def record_columns(records: Sequence[SampleRecord], lane: int | None = None
                   ) -> tuple[int, np.ndarray, dict[str, Any]]:
    """The lane, the ids and the other columns of a block holding ``records``, in order.

    Returns:
        ``(lane, ids, columns)``: ``Block(lane, ids, **columns)`` is the block.

    Raises:
        ValueError: The records span several lanes, one is a flush sentinel,
            or there are none and ``lane`` is not given.
    """
    metas = [r.meta for r in records]
    if lane is None:
        if not metas:
            raise ValueError("an empty block needs its lane")
        lane = metas[0].lane_id
    n = len(metas)
    if n == 0:
        return lane, EMPTY_IDS, {"payloads": []}
    lanes = {m.lane_id for m in metas}
    if lanes != {lane}:
        raise ValueError(f"a block holds the records of one lane, got lanes {sorted(lanes)}")
    ids = np.array([(*m.sample_id, m.chunk_id, m.chunk_offset) for m in metas],
                   dtype=np.int64).reshape(n, 5)
    lineage: list[tuple[int, ...]] | None = [m.lineage for m in metas]
    if not any(lineage):
        lineage = None
    counts_list = [m.component_sample_counts for m in metas]
    component, counts = components_of(counts_list)
    token_counts: list[Any] | None = [m.component_token_counts for m in metas]
    if all(t is None for t in token_counts):
        token_counts = None
    payloads = [r.payload for r in records]
    columns: dict[str, Any] = {"payloads": payloads, "lineage": lineage,
                               "component": component, "counts": counts,
                               "token_counts": token_counts}
    tagged = [i for i, m in enumerate(metas) if m.tags]
    if tagged:
        columns.update(tag_columns(n, [(i, metas[i].tags) for i in tagged]))
    return lane, ids, columns


def components_of(counts_list: list[Mapping[int, int]]) -> tuple[np.ndarray | None,
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


def tag_columns(n: int, tagged: list[tuple[int, Mapping[str, Any]]]) -> dict[str, Any]:
    """The columns that the tags of some of ``n`` rows fill (only those any row uses).

    Raises:
        ValueError: A row is a flush sentinel (sentinels travel between blocks).
    """
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
    columns: dict[str, Any] = {}
    if tomb.any():
        columns.update(tomb=tomb, reason=reason, detail=detail)
    if any(p is not None for p in packing):
        columns["packing"] = packing
    if any(e is not None for e in extra):
        columns["extra"] = extra
    if refs_of:
        columns["contributors"] = contributors_of_refs(n, refs_of)
    return columns


def _refs_ok(refs: Any) -> bool:
    """Whether a ``_contributors`` value is the standard tuple of ``ContributorRef``."""
    return (type(refs) is tuple and len(refs) > 0
            and all(type(r) is ContributorRef and type(r.cursor) is SampleCursor
                    and type(r.is_last_child) is bool for r in refs))


def contributors_of_refs(n: int, refs_of: Mapping[int, tuple[ContributorRef, ...]]
                         ) -> Contributors:
    """The contributor table of ``n`` rows, row ``i`` listing ``refs_of[i]`` (others none)."""
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
