"""Turning the schedule's chunks into blocks for the lanes a consumer owns.

The emitter walks the global chunk sequence, skips the chunks of lanes it does
not own (their pointers are never computed), and turns each owned chunk into
one :class:`~zephon_torch.block.Block` whose row ``i`` is the record::

    SampleMeta(sample_id=(dataset_id, shard_id, local_id), lane_id, chunk_id,
               chunk_offset=i, component_sample_counts={component: 1})

built from the chunk's arrays with no per-sample Python for file sources.
Payloads depend on the shard's access kind: the :data:`POINTER` marker for
random-access files (``fetch`` reads them later, on the workers), the raw
bytes for sequential (compressed) files, read here in order, and the item
itself for in-memory data (an empty text becomes a tombstone at once).

After every ``flush_every`` chunks of a lane, a flush sentinel for that lane
follows the block (a :class:`~zephon_torch.block.Sentinel`), tagged with the
boundary's ``chunk_id`` (the first chunk of the next epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from zephon_torch.block import Block, Sentinel
from zephon_torch.sources.base import POINTER, Dataset
from zephon_torch.sources.datasets import ItemsDataset
from zephon_torch.sources.schedule import Chunk, ScheduleState, WorkSchedule
from zephon_torch.types import SampleRecord
from zephon_torch.vocab import empty_text_rows

__all__ = ["SourceEmitter", "flush_sentinel"]

def flush_sentinel(lane_id: int, boundary_chunk_id: int) -> SampleRecord:
    """A flush sentinel for ``lane_id`` at the epoch boundary ``boundary_chunk_id``, as a record."""
    return Sentinel(lane_id, boundary_chunk_id).record()


class _StreamReader:
    """Sequential reads of one shard, reopened when asked to go backwards."""

    def __init__(self, dataset: Dataset, shard_id: int) -> None:
        self.dataset = dataset
        self.shard_id = shard_id
        self._iter: Iterator[Any] | None = None
        self._next = 0

    def get(self, local_id: int) -> Any:
        if self._iter is None or local_id < self._next:
            self._iter = iter(self.dataset.stream(self.shard_id))
            self._next = 0
        while self._next < local_id:  # skip what this consumer does not need
            next(self._iter)
            self._next += 1
        self._next += 1
        return next(self._iter)


class SourceEmitter:
    """Yields, chunk by chunk, the blocks of the owned lanes in global order.

    Each item is a list of units: the chunk's block, then its lane's flush
    sentinel when the chunk ends an epoch.

    Args:
        schedule: The work schedule.
        datasets: The datasets (index = dataset_id).
        lanes: Lanes to emit; chunks of other lanes are skipped.
        flush_every: Emit a flush sentinel after every this many chunks of a
            lane (0: never).
        on_chunk: Called with every emitted :class:`Chunk` before its records
            are yielded (progress accounting registers chunks here).
        start: Schedule state to start from (default: the beginning).
        lane_next: After a resume, the first global chunk each lane still
            needs; earlier chunks of that lane are skipped.
        replay: After a resume, the start states of the chunks to replay
            first (every lane's inflight window), in any order.
    """

    def __init__(
        self,
        schedule: WorkSchedule,
        datasets: Sequence[Dataset],
        *,
        lanes: Sequence[int],
        flush_every: int = 0,
        on_chunk: Callable[[Chunk], None] | None = None,
        start: ScheduleState | None = None,
        lane_next: dict[int, int] | None = None,
        replay: Sequence[ScheduleState] = (),
    ) -> None:
        self.schedule = schedule
        self.datasets = list(datasets)
        self.lanes = frozenset(lanes)
        self.flush_every = flush_every
        self.on_chunk = on_chunk
        self.state = start if start is not None else schedule.initial_state()
        self._components = np.array([d.component_id for d in self.datasets], dtype=np.int64)
        self._shards = [d.shards() for d in self.datasets]
        self._all_pointers = all(
            s.access == "pointer" for shards in self._shards for s in shards
        )
        self._streams: dict[tuple[int, int], _StreamReader] = {}
        self.lane_next = dict(lane_next or {})
        self._replay = sorted(replay, key=lambda s: s.global_chunk)
        self.replayed = 0  # pointers re-read from replayed chunks
        self.replayed_by_lane: dict[int, int] = {}
        self.finished = False
        self._steps = np.arange(0, dtype=np.int64)
        # A consumer with few of many lanes (a rank of a large world) jumps over the
        # chunks of the others rather than stepping through each.
        self._few = 4 * len(self.lanes) <= schedule.total_lanes and len(self.lanes) <= 64

    def _next_owned(self, global_chunk: int) -> int:
        """The first global chunk at or after ``global_chunk`` that an owned lane still needs
        (-1: none)."""
        plan = self.schedule.lanes
        found = [plan.next_chunk(lane, max(global_chunk, self.lane_next.get(lane, 0)))
                 for lane in self.lanes]
        found = [g for g in found if g >= 0]
        return min(found) if found else -1

    def __iter__(self) -> Iterator[list[Any]]:
        return self

    def __next__(self) -> list[Any]:
        while self._replay:
            chunk, _ = self.schedule.chunk(self._replay.pop(0))
            if chunk is not None:
                self.replayed += len(chunk)
                lane = chunk.lane_id
                self.replayed_by_lane[lane] = self.replayed_by_lane.get(lane, 0) + len(chunk)
                return self._emit(chunk)
        if self.finished:
            raise StopIteration
        schedule = self.schedule
        lanes = self.lanes
        while True:
            lane_id, _ = schedule.lane_of(self.state.global_chunk)
            if lane_id in lanes and self.state.global_chunk >= self.lane_next.get(lane_id, 0):
                chunk, nxt = schedule.chunk(self.state)
            elif self._few:  # far between: straight to the next chunk of an owned lane
                target = self._next_owned(self.state.global_chunk)
                jumped = schedule.jump(self.state, target) if target >= 0 else None
                if jumped is None:
                    self.finished = True
                    raise StopIteration
                self.state = jumped
                continue
            else:
                chunk, (components, nxt) = None, schedule.advance(self.state)
                if components is not None:
                    self.state = nxt
                    continue
            if chunk is None:
                self.finished = True
                raise StopIteration
            self.state = nxt
            return self._emit(chunk)

    def _emit(self, chunk: Chunk) -> list[Any]:
        if self.on_chunk is not None:
            self.on_chunk(chunk)
        units: list[Any] = [self.block(chunk)] if len(chunk) else []
        if self.flush_every and (chunk.chunk_id + 1) % self.flush_every == 0:
            units.append(Sentinel(chunk.lane_id, chunk.chunk_id + 1))
        return units

    def _arange(self, n: int) -> np.ndarray:
        """``0, 1, ..., n-1`` (read-only, kept for the chunk size at hand)."""
        steps = self._steps
        if len(steps) != n:
            steps = self._steps = np.arange(n, dtype=np.int64)
            steps.setflags(write=False)
        return steps

    def pending_replay(self, global_chunk: int) -> ScheduleState | None:
        """The start state of a chunk still waiting to be replayed, if it is one."""
        for pending in self._replay:
            if pending.global_chunk == global_chunk:
                return pending
        return None

    def state_of(self, global_chunk: int) -> ScheduleState | None:
        """The schedule state at a global chunk not yet emitted (None: past the end)."""
        pending = self.pending_replay(global_chunk)
        if pending is not None:
            return pending
        state = self.state
        while state.global_chunk < global_chunk:
            components, state = self.schedule.advance(state)
            if components is None:
                return None
        if state.global_chunk != global_chunk:
            raise ValueError(f"global chunk {global_chunk} is behind the emitter")
        components, _ = self.schedule.advance(state)
        return None if components is None else state

    def block(self, chunk: Chunk) -> Block:
        """The block of one chunk, its rows in chunk order."""
        n = len(chunk)
        ids = np.empty((n, 5), dtype=np.int64)
        ids[:, 0] = chunk.dataset_ids
        ids[:, 1] = chunk.shard_ids
        ids[:, 2] = chunk.local_ids
        ids[:, 3] = chunk.chunk_id
        ids[:, 4] = self._arange(n)
        component = self._components[chunk.dataset_ids]
        if self._all_pointers:
            return Block(chunk.lane_id, ids, payloads=[POINTER] * n, component=component)
        dataset_id, shard_id = ids[0, :2].tolist() if n else (0, 0)
        if n and bool((ids[:, :2] == ids[0, :2]).all()) and \
                self._shards[dataset_id][shard_id].access == "inline":  # one shard's items
            dataset = self.datasets[dataset_id]
            local_ids = _as_run(chunk.local_ids, self._arange(n))
            if type(dataset) is ItemsDataset:  # in-memory items, checked as they are read
                payloads, clean = dataset.read_checked(shard_id, local_ids)
            else:
                payloads, clean = dataset.read(shard_id, local_ids), False
        else:
            payloads = self._payloads(chunk.dataset_ids.tolist(), chunk.shard_ids.tolist(),
                                      chunk.local_ids.tolist())
            clean = False
        block = Block(chunk.lane_id, ids, payloads=payloads, component=component)
        # An empty in-memory or streamed document is closed by a tombstone now.
        empty = [] if clean else empty_text_rows(payloads)
        if empty:
            mask = np.zeros(n, dtype=bool)
            mask[empty] = True
            block = block.with_tombstones(mask, "empty")
        return block

    def records(self, chunk: Chunk) -> list[SampleRecord]:
        """The records of one chunk, in chunk order (the block's views)."""
        return self.block(chunk).records()

    def _payloads(self, dataset_ids: list[int], shard_ids: list[int],
                  local_ids: list[int]) -> list[Any]:
        payloads: list[Any] = [POINTER] * len(local_ids)
        inline: dict[tuple[int, int], list[int]] = {}
        for pos, (d, s, i) in enumerate(zip(dataset_ids, shard_ids, local_ids)):
            access = self._shards[d][s].access
            if access == "inline":
                inline.setdefault((d, s), []).append(pos)
            elif access == "stream":
                reader = self._streams.get((d, s))
                if reader is None:
                    reader = self._streams[(d, s)] = _StreamReader(self.datasets[d], s)
                payloads[pos] = reader.get(i)
        for (d, s), positions in inline.items():
            values = self.datasets[d].read(s, [local_ids[p] for p in positions])
            for pos, value in zip(positions, values):
                payloads[pos] = value
        return payloads


def _as_run(local_ids: np.ndarray, steps: np.ndarray) -> Sequence[int]:
    """The ids as a ``range`` when they are consecutive (a reader may then slice), else a list
    (``steps``: ``0, 1, ...`` as long as the ids)."""
    n = len(local_ids)
    first = int(local_ids[0]) if n else 0
    if n > 1 and int(local_ids[-1]) - first == n - 1 \
            and bool((local_ids - first == steps).all()):
        return range(first, first + n)
    return local_ids.tolist()
