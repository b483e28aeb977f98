"""The replay filter: on resume, each lane's replayed records are dropped up to its cursor.

A state (see :mod:`zephon_torch.checkpoint`) resumes a lane by replaying its
window from the epoch boundary, so every accumulator starts fresh where it
did live. The records the consumer already received come again on the way;
the :class:`ReplayFilter`, which the planner (:mod:`zephon_torch.planner`)
puts right before ``batch`` (or at the end), drops them until it has dropped
the one equal to the lane's replay cursor, and only then lets records
through. Outside a resume it is a passthrough. The checkpoint module doc has
a worked example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.block import Block
from zephon_torch.block_ids import ID_CHUNK
from zephon_torch.ops.accumulators import Accumulator
from zephon_torch.ops.base import OpContext, Operator, OpTraits
from zephon_torch.types import SampleBatch, SampleRecord

__all__ = ["ReplayFilter", "ReplayFilterAccumulator"]


class ReplayFilterAccumulator(Accumulator):
    """Drops each lane's replayed records up to its replay cursor.

    Per lane: ``(cursor key, records expected to be dropped, last chunk id of
    the window)``. Until the cursor is met, every record is dropped (and
    reported through ``on_drop``, so progress counts it as delivered); a
    record from beyond the window, or the end of the stream, while still
    dropping means replay diverged.
    """

    takes_blocks = True

    def __init__(self, targets: Mapping[int, tuple[tuple, int, int]],
                 on_drop: Callable[[Any], None] | None) -> None:
        self._targets = {lane: list(t) for lane, t in targets.items()}
        self._dropped = dict.fromkeys(targets, 0)
        self._on_drop = on_drop

    def push_block(self, block: Block) -> list[Block]:
        """Drop a replaying lane's rows up to and including its cursor; pass the rest."""
        lane = block.lane
        target = self._targets.get(lane)
        if target is None or not len(block):
            return [block] if len(block) else []
        cursor, expected, window_end = target
        hit = _find_key(block, cursor)
        if hit is None:
            late = np.flatnonzero(block.ids[:, ID_CHUNK] > window_end)
            if len(late):
                self._diverged(lane, f"a record of chunk {int(block.ids[late[0], ID_CHUNK])}, "
                                     f"past the replayed window (last chunk {window_end}), "
                                     "arrived first")
            self._drop_rows(block)
            return []
        dropped, rest = block.split_at(hit + 1)
        late = np.flatnonzero(dropped.ids[:hit, ID_CHUNK] > window_end)
        if len(late):
            self._diverged(lane, f"a record of chunk {int(dropped.ids[late[0], ID_CHUNK])}, "
                                 f"past the replayed window (last chunk {window_end}), "
                                 "arrived first")
        self._drop_rows(dropped)
        del self._targets[lane]
        if self._dropped[lane] != expected:
            self._diverged(lane, f"the cursor came after {self._dropped[lane]} "
                                 f"records instead of {expected}")
        return [rest] if len(rest) else []

    def _drop_rows(self, block: Block) -> None:
        self._dropped[block.lane] += len(block)
        if self._on_drop is not None:
            self._on_drop(block)

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        if not self._targets:
            return [list(elems)] if elems else []
        out = []
        for elem in elems:
            records = elem.records if isinstance(elem, SampleBatch) else (elem,)
            lane = records[0].meta.lane_id if records else -1
            target = self._targets.get(lane)
            if target is None:
                out.append(elem)
                continue
            cursor, expected, window_end = target
            last = records[-1].meta
            if last.chunk_id > window_end and last.as_cursor_key() != cursor:
                self._diverged(lane, f"a record of chunk {last.chunk_id}, past the replayed "
                                     f"window (last chunk {window_end}), arrived first")
            for record in records:
                self._dropped[lane] += 1
                if self._on_drop is not None:
                    self._on_drop(record)
            if last.as_cursor_key() == cursor:
                del self._targets[lane]
                if self._dropped[lane] != expected:
                    self._diverged(lane, f"the cursor came after {self._dropped[lane]} "
                                         f"records instead of {expected}")
        return [out] if out else []

    def _diverged(self, lane: int, why: str) -> None:
        raise RuntimeError(
            f"replay diverged on lane {lane}: {why}. The data or the code changed since the "
            "checkpoint in a way the fingerprint does not cover, or the state was edited (its "
            "'epoch', for one, which only the order of the replayed records can show); resume "
            "from an earlier checkpoint or start this lane afresh"
        )

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        # Holds nothing, and its dropping state spans epochs: a flush is a no-op,
        # except that the end of the stream must not come while still dropping.
        if not reset and lane_id is None and self._targets:
            lane = min(self._targets)
            self._diverged(lane, "the stream ended before the replay cursor was met")
        return []

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        return False

    def pending_lanes(self) -> set[int]:
        """The lanes still dropping replayed records (their cursor not met yet)."""
        return set(self._targets)


def _find_key(block: Block, key: tuple) -> int | None:
    """The row of ``block`` whose cursor key is ``key``, or None."""
    chunk_id, offset, lineage, sample_id = key
    ids = block.ids
    match = ((ids[:, 3] == chunk_id) & (ids[:, 4] == offset) & (ids[:, 0] == sample_id[0])
             & (ids[:, 1] == sample_id[1]) & (ids[:, 2] == sample_id[2]))
    for row in np.flatnonzero(match).tolist():
        if (block.lineage[row] if block.lineage is not None else ()) == tuple(lineage):
            return row
    return None


class ReplayFilter(Operator):
    """The planner's filter before ``batch``: a passthrough unless resuming."""

    name = "replay_filter"

    def __init__(self) -> None:
        self.targets: dict[int, tuple[tuple, int, int]] = {}
        self.on_drop: Callable[[SampleRecord], None] | None = None

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> Accumulator:
        return ReplayFilterAccumulator(self.targets, self.on_drop)

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return list(elems)

    def process_block(self, block: Block) -> Block:
        return block

    def traits(self) -> OpTraits:
        return OpTraits(inline=True)

    def config(self) -> dict[str, Any]:
        return {"op": "replay_filter"}

    def __getstate__(self) -> dict[str, Any]:
        return {"targets": {}, "on_drop": None}  # workers never run it
