"""One lane's progress: the chunks it registered, what closed them, which epochs are done.

Part of an iterator's books (``accounting.py``, whose :class:`~zephon_torch.accounting.Accounting`
keeps one :class:`LaneProgress` per lane and reports the events to it); the
states of ``checkpoint.py`` are written from it.

Per lane, the base offsets closed by what the caller received and by
tombstones. A chunk whose every offset is closed is complete. Chunks are
grouped in *epochs* (the ``flush_every_k_chunks`` chunks between two flush
sentinels of a lane; one chunk each when there are no sentinels), and
complete epochs are forgotten whole. With sentinels, an epoch is done when
its sentinel reaches the consumer, and offsets need not be closed one by one.

This module imports nothing from ``runners/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon_torch.types import SampleRecord

if TYPE_CHECKING:
    from zephon_torch.sources.schedule import Chunk, ScheduleState

__all__ = ["LaneProgress"]


@dataclass(eq=False)
class _ChunkProgress:
    """The closed offsets of a chunk: ``0..prefix-1``, and the others in ``closed``.

    Closing twice is harmless (the two parts never share an offset). Rows
    closed in order, as runs, only move ``prefix``: no set entry per row.
    Two progresses are equal when they close the same offsets, however held.
    """

    size: int
    start: ScheduleState
    closed: set[int] = field(default_factory=set)
    prefix: int = 0

    def count(self) -> int:
        """How many distinct offsets are closed."""
        return self.prefix + len(self.closed)

    def offsets(self) -> set[int]:
        """Every closed offset."""
        return set(range(self.prefix)) | self.closed

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _ChunkProgress):
            return NotImplemented
        return ((self.size, self.start) == (other.size, other.start)
                and self.offsets() == other.offsets())

    __hash__ = None  # type: ignore[assignment]

    def add(self, offset: int) -> bool:
        """Close one offset; False if it was closed already."""
        if 0 <= offset < self.prefix or offset in self.closed:
            return False
        self.closed.add(offset)
        return True

    def add_many(self, offsets: list[int]) -> None:
        """Close several offsets."""
        prefix = self.prefix
        if prefix and offsets and min(offsets) < prefix:
            offsets = [o for o in offsets if not 0 <= o < prefix]
        self.closed.update(offsets)

    def add_run(self, start: int, stop: int) -> None:
        """Close the offsets ``start..stop-1``."""
        prefix = self.prefix
        if 0 <= start <= prefix:
            if stop > prefix:
                if self.closed:
                    self.closed.difference_update(range(prefix, stop))
                self.prefix = stop
            return
        if start < 0:
            self.closed.update(range(start, min(stop, 0)))
        self.closed.update(range(max(start, prefix), stop))


@dataclass
class LaneProgress:
    """What one lane has registered and delivered, and which epochs are done.

    With flush sentinels an epoch is done when the caller has received
    everything that came before the epoch's sentinel (the sentinel follows
    all of the epoch's output through every stage). Counting closed offsets
    would not do: after a shuffle, a split document's last piece may be
    delivered before an earlier piece. Without sentinels (order-preserving
    plans) an epoch is one chunk, done when all its offsets are closed.

    The counters at the end (``read`` to ``tombstoned``) are the lane's part
    of ``stats()``.
    """

    lane: int
    flush_every: int
    chunks: dict[int, _ChunkProgress] = field(default_factory=dict)
    done_epoch: int = 0  # epochs below this one are done
    incomplete: dict[int, int] = field(default_factory=dict)  # no sentinels: chunk -> open
    delivered_in_epoch: dict[int, int] = field(default_factory=dict)
    cursor: tuple | None = None
    cursor_epoch: int | None = None
    outputs: int = 0
    finished: bool = False  # every output of the lane has been delivered
    exhausted: bool = False  # the schedule has no new chunk for this lane
    registered_until: int = 0  # the next chunk id to be registered
    read: int = 0  # samples of the chunks registered
    sample_bytes: int = 0  # the storage they occupy
    samples_delivered: int = 0  # base samples closed by what the caller received
    samples_dropped: int = 0  # replayed samples the caller had received before
    tombstoned: dict[str, int] = field(default_factory=dict)  # reason -> samples
    #: Moves whenever a chunk is registered in or forgotten from ``chunks`` (so that a
    #: reader can tell that the chunks are still those it saw: ``runners/snapshots.py``).
    chunks_version: int = field(default=0, compare=False, repr=False)

    def epoch_of(self, chunk_id: int) -> int:
        """The epoch of chunk ``chunk_id`` (the chunk itself when there are no sentinels)."""
        return chunk_id // self.flush_every if self.flush_every else chunk_id

    def register(self, chunk: Chunk) -> None:
        """A chunk emitted for this lane: read, and open until its epoch is done."""
        size = len(chunk)
        self.read += size
        self.registered_until = max(self.registered_until, chunk.chunk_id + 1)
        self.chunks[chunk.chunk_id] = _ChunkProgress(size, chunk.start)
        self.chunks_version += 1
        if not self.flush_every:
            if size:
                self.incomplete[chunk.chunk_id] = size
            self._advance_by_closures()

    def resume_at(self, first_chunk: int | None, outputs: int, exhausted: bool) -> None:
        """Start where a saved state left the lane: epochs before ``first_chunk`` are done."""
        self.outputs = outputs
        if first_chunk is not None:
            self.done_epoch = self.epoch_of(first_chunk)
            self.registered_until = first_chunk
        if exhausted:
            self.exhausted = True

    def close(self, chunk_id: int, offset: int) -> None:
        """An offset closed by a delivered last piece or a tombstone (no-sentinel plans)."""
        if self.flush_every:
            return
        info = self.chunks.get(chunk_id)
        if info is None or not info.add(offset):  # forgotten, or closed already
            return
        if info.count() == info.size:
            self.incomplete.pop(chunk_id, None)
            self._advance_by_closures()

    def close_many(self, chunk_id: int, offsets: list[int]) -> None:
        """:meth:`close` for several offsets of one chunk."""
        if self.flush_every:
            return
        info = self.chunks.get(chunk_id)
        if info is None:
            return
        info.add_many(offsets)
        if info.count() == info.size:
            self.incomplete.pop(chunk_id, None)
            self._advance_by_closures()

    def close_range(self, chunk_id: int, start: int, stop: int) -> None:
        """:meth:`close_many` for the offsets ``start..stop-1`` of one chunk."""
        if self.flush_every:
            return
        info = self.chunks.get(chunk_id)
        if info is None:
            return
        info.add_run(start, stop)
        if info.count() == info.size:
            self.incomplete.pop(chunk_id, None)
            self._advance_by_closures()

    def close_grouped(self, chunks: np.ndarray, offsets: np.ndarray) -> None:
        """Close base offsets given as arrays, one :meth:`close_many` per chunk."""
        if not len(chunks):
            return
        order = np.argsort(chunks, kind="stable")
        chunks, offsets = chunks[order], offsets[order]
        cut = np.flatnonzero(chunks[1:] != chunks[:-1]) + 1
        for start, stop in zip([0, *cut.tolist()], [*cut.tolist(), len(chunks)]):
            self.close_many(int(chunks[start]), offsets[start:stop].tolist())

    def _advance_by_closures(self) -> None:
        first_open = min(self.incomplete) if self.incomplete else self.registered_until
        self._forget_before(first_open)

    def sentinel_delivered(self, boundary_chunk_id: int) -> None:
        """Everything before the sentinel of ``boundary_chunk_id`` has been delivered."""
        self._forget_before(self.epoch_of(boundary_chunk_id))

    def _forget_before(self, epoch: int) -> None:
        if epoch <= self.done_epoch:
            return
        self.done_epoch = epoch
        self.chunks_version += 1
        for cid in [c for c in self.chunks if self.epoch_of(c) < epoch]:
            del self.chunks[cid]
        for e in [e for e in self.delivered_in_epoch if e < epoch]:
            del self.delivered_in_epoch[e]

    def finish(self) -> None:
        """The lane has ended and the caller has received all of its output."""
        self.finished = True
        self._forget_before(self.epoch_of(self.registered_until))

    def delivered(self, record: SampleRecord, *, count_output: bool) -> None:
        """A record the caller received (or, on replay, had received): move the cursor."""
        meta = record.meta
        epoch = self.epoch_of(meta.chunk_id)
        self.cursor = meta.as_cursor_key()
        self.cursor_epoch = epoch
        self.delivered_in_epoch[epoch] = self.delivered_in_epoch.get(epoch, 0) + 1
        if count_output:
            self.outputs += 1

    def window(self) -> tuple[int, int] | None:
        """First and last epoch to replay (None: nothing is inflight)."""
        if self.finished:
            return None
        first = self.done_epoch
        last = first
        if self.cursor_epoch is not None and self.cursor_epoch > first:
            last = self.cursor_epoch
        return first, last

    def counts(self, replayed: int) -> dict[str, Any]:
        """The lane's entry of ``stats()["lanes"]`` (``replayed``: samples re-read)."""
        return {
            "read": self.read,
            "delivered": self.samples_delivered,
            "tombstoned": dict(self.tombstoned),
            "replayed": int(replayed),
            "replay_dropped": self.samples_dropped,
            "sample_bytes": self.sample_bytes,
        }
