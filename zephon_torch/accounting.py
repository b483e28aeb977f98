"""One iterator's books: what each lane read, and what became of every sample.

The consumer side (``runners/iterator.py``) reports each event here once,
and one :class:`Accounting` per iterator keeps two things from it:

* **progress**, for states (``checkpoint.py`` writes them from it): per lane,
  the registered chunks, which epochs are done, the replay cursor and the
  items handed out;
* **counters**, for ``stats()``: per lane the samples read (and the storage
  they occupy), delivered, tombstoned (by reason) and dropped again after a
  resume, and the first few bad samples ``on_error="skip"`` turned into
  tombstones; with ``verify=True`` also every closed sample, one by one
  (:class:`SampleBook`).

The events::

    register(chunk)                a chunk emitted for a lane
    delivered_plain(lane, recs)    plain records the caller received, in order
    delivered_rows(lane, rows, a, b)  the same, as rows a..b-1 of a block without tags
    delivered_batches(lane, items) batches the caller received, in order
    delivered(lane, item)          a tagged record, a batch or a block batch received
    tombstone(lane, record)        a tombstone reached the consumer
    tombstones(block)              a block of tombstones reached the consumer
    replay_dropped(record | block) replayed rows the replay filter dropped
    sentinel(lane, boundary)       everything before a flush sentinel was received
    lane_ended(lane)               a lane ended and all of its output was received

**What is counted.** A base sample counts once, when something closes it
(``vocab.py``: a record closes its own offset, a packed row the offsets of
its last-child contributors, a tombstone what its record would have
closed), so at the end of a pass, per lane, ``read == delivered +
sum(tombstoned) + replay_dropped``.

**Progress.** Each lane's is a :class:`~zephon_torch.lane_progress.LaneProgress`
(``lane_progress.py``: closed offsets, chunks, epochs). The pace of the run,
read from these books, is ``throughput.py``'s.

This module imports nothing from ``runners/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon_torch.block import Block
from zephon_torch.block_ids import ID_CHUNK, ID_OFFSET
from zephon_torch.block_views import BlockBatch, PlainRows
from zephon_torch.lane_progress import LaneProgress
from zephon_torch.sources.base import Dataset
from zephon_torch.types import SampleBatch, SampleRecord
from zephon_torch.vocab import (
    TOMBSTONE_DETAIL_TAG,
    TOMBSTONE_REASON_TAG,
    close_count,
    closed_offsets,
    is_error_reason,
)

if TYPE_CHECKING:
    from zephon_torch.sources.schedule import Chunk

__all__ = ["Accounting", "LaneProgress", "ProgressTracker", "SampleBook"]

#: Bad samples kept for ``stats()["bad_samples"]``.
_KEEP_BAD = 20


class SampleBook:
    """Every base sample closed in a pass, one by one (``verify=True``).

    Keys are ``(lane, chunk_id, offset)``; a key closed twice is kept in
    ``duplicates`` and one that belongs to no chunk read here in ``strays``.
    ``chunks`` maps each ``(lane, chunk_id)`` read to its size.
    """

    def __init__(self) -> None:
        self.chunks: dict[tuple[int, int], int] = {}
        self.closed: set[tuple[int, int, int]] = set()
        self.duplicates: list[tuple[int, int, int]] = []
        self.strays: list[tuple[int, int, int]] = []

    def add(self, key: tuple[int, int, int]) -> None:
        """One closed sample ``(lane, chunk_id, offset)``."""
        closed = self.closed
        before = len(closed)
        closed.add(key)
        if len(closed) == before:
            self.duplicates.append(key)
        elif not 0 <= key[2] < self.chunks.get((key[0], key[1]), 0):
            self.strays.append(key)

    def add_arrays(self, lane: int, chunks: np.ndarray, offsets: np.ndarray) -> None:
        """Closed samples of ``lane`` given as arrays of chunk ids and offsets."""
        for chunk, offset in zip(chunks.tolist(), offsets.tolist()):
            self.add((lane, chunk, offset))


class Accounting:
    """The books of one iterator: progress per lane and the counters (see the module doc).

    Args:
        lanes: The lanes of the iterator, in order.
        flush_every: The pipeline's flush-sentinel period (0: no sentinels).
        datasets: The source's datasets, by id (for the storage samples occupy).
        verify: Also keep every closed sample (:attr:`samples`).
    """

    def __init__(self, lanes: Sequence[int], flush_every: int, datasets: Sequence[Any] = (),
                 *, verify: bool = False) -> None:
        self.flush_every = flush_every
        self.lanes = {lane: LaneProgress(lane, flush_every) for lane in lanes}
        self.datasets = list(datasets)
        # Whether any dataset says what its samples occupy (Dataset.sample_bytes is 0).
        self._stored = any(getattr(type(d), "sample_bytes", None) is not Dataset.sample_bytes
                           for d in self.datasets)
        #: With ``verify=True``, every closed sample; else None.
        self.samples: SampleBook | None = SampleBook() if verify else None
        #: The first bad samples (``_KEEP_BAD``): ``(reason, sample_id, detail)``.
        self.bad: list[tuple[str, tuple[int, int, int], str | None]] = []
        self.bad_counts: dict[str, int] = {}
        self.bad_total = 0
        #: Lanes whose progress an event has touched since a reader last cleared this
        #: (``runners/snapshots.py``: a lane not in it still has the entry it had).
        self.changed: set[int] = set(self.lanes)

    # ------------------------------------------------------------------ events

    def register(self, chunk: Chunk) -> None:
        """A chunk emitted: its samples are read, and the lane's progress knows it."""
        lane = self.lanes[chunk.lane_id]
        self.changed.add(chunk.lane_id)
        lane.register(chunk)
        lane.sample_bytes += self.sample_bytes(chunk)
        if self.samples is not None:
            self.samples.chunks[(chunk.lane_id, chunk.chunk_id)] = len(chunk)

    def sample_bytes(self, chunk: Chunk) -> int:
        """The storage a chunk's samples occupy (one ``Dataset.sample_bytes`` call per shard
        run)."""
        dataset_ids, shard_ids, local_ids = chunk.dataset_ids, chunk.shard_ids, chunk.local_ids
        n = len(local_ids)
        if not n or not self._stored:  # in-memory data occupies no storage
            return 0
        # Runs of one (dataset, shard): a chunk usually holds one or a few.
        change = np.flatnonzero((dataset_ids[1:] != dataset_ids[:-1])
                                | (shard_ids[1:] != shard_ids[:-1])) + 1
        starts = [0, *change.tolist()]
        ends = [*change.tolist(), n]
        total = 0
        for a, b in zip(starts, ends):
            dataset = self.datasets[int(dataset_ids[a])]
            total += dataset.sample_bytes(int(shard_ids[a]), local_ids[a:b])
        return total

    def delivered_plain(self, lane_id: int, items: Sequence[SampleRecord],
                        outputs: int | None = None) -> None:
        """Plain records (no tags) of one lane the caller received, in order.

        Each closes itself. One pass, no call per record. ``outputs`` is the
        number of items handed over (default: one per record; one for a batch).
        """
        lane = self.lanes[lane_id]
        self.changed.add(lane_id)
        lane.samples_delivered += len(items)
        k = self.flush_every
        counts = lane.delivered_in_epoch
        if k:
            for item in items:
                epoch = item.meta.chunk_id // k
                counts[epoch] = counts.get(epoch, 0) + 1
        else:  # no sentinels: each record closes its own offset
            offsets: dict[int, list[int]] = {}
            for item in items:
                meta = item.meta
                group = offsets.get(meta.chunk_id)
                if group is None:
                    group = offsets[meta.chunk_id] = []
                group.append(meta.chunk_offset)
            for chunk_id, group in offsets.items():
                counts[chunk_id] = counts.get(chunk_id, 0) + len(group)
                lane.close_many(chunk_id, group)
        last = items[-1].meta
        lane.cursor = last.as_cursor_key()
        lane.cursor_epoch = lane.epoch_of(last.chunk_id)
        lane.outputs += len(items) if outputs is None else outputs
        if self.samples is not None:
            add = self.samples.add
            for item in items:
                meta = item.meta
                add((lane_id, meta.chunk_id, meta.chunk_offset))

    def delivered_rows(self, lane_id: int, rows: PlainRows, start: int, stop: int) -> None:
        """Rows ``start..stop-1`` of a block without tags, received as records.

        What :meth:`delivered_plain` does with their records, read from the
        rows' columns: for the usual rows of one chunk, a few calls and no
        work per row.
        """
        n = stop - start
        if n <= 0:
            return
        lane = self.lanes[lane_id]
        self.changed.add(lane_id)
        lane.samples_delivered += n
        k = self.flush_every
        counts = lane.delivered_in_epoch
        if rows.single_chunk:
            first, offset = rows.ids[start, ID_CHUNK:].tolist()
            key = first // k if k else first
            counts[key] = counts.get(key, 0) + n
            if not k:
                if rows.consecutive:  # offset, offset + 1, offset + 2, ...
                    lane.close_range(first, offset, offset + n)
                else:
                    lane.close_many(first, rows.offsets(start, stop))
            if self.samples is not None:
                self.samples.add_arrays(lane_id, rows.ids[start:stop, ID_CHUNK],
                                        rows.ids[start:stop, ID_OFFSET])
            lane.cursor = rows.cursor_key(stop - 1)
            lane.cursor_epoch = lane.epoch_of(lane.cursor[0])
            lane.outputs += n
            return
        chunks, offsets = rows.chunk_ids(start, stop), rows.offsets(start, stop)
        if k:
            for chunk_id in chunks:
                epoch = chunk_id // k
                counts[epoch] = counts.get(epoch, 0) + 1
        else:  # each row closes its own offset, grouped by chunk in order of appearance
            groups: dict[int, list[int]] = {}
            for chunk_id, offset in zip(chunks, offsets):
                group = groups.get(chunk_id)
                if group is None:
                    group = groups[chunk_id] = []
                group.append(offset)
            for chunk_id, group in groups.items():
                counts[chunk_id] = counts.get(chunk_id, 0) + len(group)
                lane.close_many(chunk_id, group)
        lane.cursor = rows.cursor_key(stop - 1)
        lane.cursor_epoch = lane.epoch_of(lane.cursor[0])
        lane.outputs += n
        if self.samples is not None:
            add = self.samples.add
            for chunk_id, offset in zip(chunks, offsets):
                add((lane_id, chunk_id, offset))

    def delivered_batches(self, lane_id: int, batches: Sequence[Any]) -> None:
        """Batches of ``lane_id`` the caller received, in order: :meth:`delivered` each.

        Block batches whose rows close only themselves (no contributors) are
        counted together, as the rows of one block received as that many
        items: the books end exactly where one call per batch leaves them.
        """
        if len(batches) > 1 and all(type(b) is BlockBatch and b.block.contributors is None
                                    and b.block.lane == lane_id for b in batches):
            blocks = [b.block for b in batches]
            ids = np.concatenate([block.ids for block in blocks])
            last = blocks[-1]
            lineage = None
            if last.lineage is not None:  # only the last row's lineage is read (the cursor)
                lineage = [()] * (len(ids) - len(last)) + list(last.lineage)
            rows = Block(lane_id, ids, payloads=[None] * len(ids), lineage=lineage)
            self.lanes[lane_id].samples_delivered += self._rows_received(
                rows, outputs=len(batches))
            return
        for batch in batches:
            self.delivered(lane_id, batch)

    def delivered(self, lane_id: int, item: Any) -> None:
        """An item of ``lane_id`` the caller received (a tagged record, a batch, a block
        batch): count what it closes, move the replay cursor."""
        if type(item) is BlockBatch:
            block = item.block
            self.lanes[block.lane].samples_delivered += self._rows_received(block, outputs=1)
            return
        records = item.records if isinstance(item, SampleBatch) else (item,)
        if not records:
            return
        if all(not record.meta.tags for record in records):  # plain records close themselves
            self.delivered_plain(lane_id, records, outputs=1)
            return
        lane = self.lanes[lane_id]
        self.changed.add(lane_id)
        for record in records:
            lane.samples_delivered += self._close_record(record)
            lane.delivered(record, count_output=False)
        lane.outputs += 1

    def tombstone(self, lane_id: int, record: SampleRecord) -> None:
        """A tombstone reached the consumer: it closes what its record would have."""
        self.changed.add(lane_id)
        closes = self._close_record(record)
        tags = record.meta.tags
        reason = tags.get(TOMBSTONE_REASON_TAG, "unknown")
        if self._count_tombstones(lane_id, reason, closes):
            self.bad.append((reason, tuple(record.meta.sample_id),
                             tags.get(TOMBSTONE_DETAIL_TAG)))

    def tombstones(self, block: Block) -> None:
        """A block of tombstones reached the consumer."""
        self.changed.add(block.lane)
        self._close_rows(block)
        closes = block.close_counts().tolist()
        reasons = block.reason or [None] * len(block)
        details = block.detail or [None] * len(block)
        for i, (reason, count) in enumerate(zip(reasons, closes)):
            reason = reason or "unknown"
            if self._count_tombstones(block.lane, reason, count):
                self.bad.append((reason, tuple(block.ids[i, :3].tolist()), details[i]))

    def replay_dropped(self, dropped: SampleRecord | Block) -> None:
        """Replayed rows the replay filter dropped: the caller had received them before."""
        if type(dropped) is Block:
            self.lanes[dropped.lane].samples_dropped += self._rows_received(dropped, outputs=0)
            return
        lane = self.lanes[dropped.meta.lane_id]
        self.changed.add(dropped.meta.lane_id)
        lane.samples_dropped += self._close_record(dropped)
        lane.delivered(dropped, count_output=False)

    def sentinel(self, lane_id: int, boundary: int) -> None:
        """Everything of ``lane_id`` before the sentinel of chunk ``boundary`` was received."""
        self.changed.add(lane_id)
        self.lanes[lane_id].sentinel_delivered(boundary)

    def lane_ended(self, lane_id: int) -> None:
        """The lane has ended and the caller has received all of its output."""
        self.changed.add(lane_id)
        self.lanes[lane_id].finish()

    # ------------------------------------------------------------------ reports

    def report(self, replayed: dict[int, int]) -> dict[str, Any]:
        """The counters of ``stats()``: per lane and in total (``replayed``: per lane)."""
        lanes = {lane: book.counts(replayed.get(lane, 0)) for lane, book in self.lanes.items()}
        return {
            "lanes": lanes,
            "read": sum(v["read"] for v in lanes.values()),
            "delivered": sum(v["delivered"] for v in lanes.values()),
            "tombstoned": sum(sum(v["tombstoned"].values()) for v in lanes.values()),
            "replayed": sum(v["replayed"] for v in lanes.values()),
            "replay_dropped": sum(v["replay_dropped"] for v in lanes.values()),
            "sample_bytes": sum(v["sample_bytes"] for v in lanes.values()),
        }

    def bad_samples(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The bad samples kept (the first ``limit``), each with where it is."""
        return [self._describe_bad(entry) for entry in self.bad[:limit]]

    def _describe_bad(self, entry: tuple[str, tuple[int, int, int], str | None]
                      ) -> dict[str, Any]:
        reason, sample_id, detail = entry
        dataset_id, shard_id, local_id = sample_id
        try:
            where = self.datasets[dataset_id].locate(shard_id, local_id)
        except Exception:  # a location is a courtesy; never fail the report
            where = f"sample {sample_id}"
        return {"reason": reason, "sample_id": sample_id, "where": where, "detail": detail}

    # ------------------------------------------------------------------ closing

    def _close_record(self, record: SampleRecord) -> int:
        """Close what ``record`` closes (progress, and the sample book); how many it closes."""
        meta = record.meta
        if self.flush_every and self.samples is None:
            return close_count(meta)  # epochs end at sentinels: closures are not needed
        closes = list(closed_offsets(meta))
        if not self.flush_every:
            lane = self.lanes[meta.lane_id]
            self.changed.add(meta.lane_id)
            for chunk_id, offset in closes:
                lane.close(chunk_id, offset)
        if self.samples is not None:
            for chunk_id, offset in closes:
                self.samples.add((meta.lane_id, chunk_id, offset))
        return len(closes)

    def _close_rows(self, block: Block) -> None:
        """Close what a block's rows close (progress, and the sample book)."""
        if self.flush_every and self.samples is None:
            return  # epochs end at sentinels: closures are not needed
        chunks, offsets = block.closed_offsets()
        if not self.flush_every:
            self.changed.add(block.lane)
            self.lanes[block.lane].close_grouped(chunks, offsets)
        if self.samples is not None:
            self.samples.add_arrays(block.lane, chunks, offsets)

    def _rows_received(self, block: Block, *, outputs: int) -> int:
        """A block's rows were received (as ``outputs`` items; 0: before a resume): close,
        count per epoch, move the cursor, with array operations and no record built.
        Returns how many base samples they close."""
        n = len(block)
        if not n:
            return 0
        lane = self.lanes[block.lane]
        self.changed.add(block.lane)
        ids = block.ids
        chunk_ids = ids[:, ID_CHUNK]
        k = self.flush_every
        per_epoch = lane.delivered_in_epoch
        first = int(chunk_ids[0])
        if block.contributors is None and first == int(chunk_ids[-1]) \
                and bool((chunk_ids == first).all()):
            # The usual batch: rows of one chunk, each closing its own offset.
            epoch = first // k if k else first
            per_epoch[epoch] = per_epoch.get(epoch, 0) + n
            if not k:
                offsets = ids[:, ID_OFFSET]
                low = int(offsets[0])
                if int(offsets[-1]) - low == n - 1 and bool((np.diff(offsets) == 1).all()):
                    lane.close_range(first, low, low + n)  # rows in order, none left out
                else:
                    lane.close_many(first, offsets.tolist())
            if self.samples is not None:
                self.samples.add_arrays(block.lane, chunk_ids, ids[:, ID_OFFSET])
            closes = n
        else:
            _count_epochs(per_epoch, chunk_ids, k)
            self._close_rows(block)
            closes = _closes(block)
        lane.cursor = block.cursor_key(n - 1)
        lane.cursor_epoch = lane.epoch_of(lane.cursor[0])
        lane.outputs += outputs
        return closes

    def _count_tombstones(self, lane_id: int, reason: str, closes: int) -> bool:
        """Count ``closes`` samples tombstoned for ``reason``; True when the tombstone is a
        bad sample to keep as an example."""
        per_lane = self.lanes[lane_id].tombstoned
        per_lane[reason] = per_lane.get(reason, 0) + closes
        if not is_error_reason(reason):
            return False
        self.bad_total += closes
        self.bad_counts[reason] = self.bad_counts.get(reason, 0) + closes
        return len(self.bad) < _KEEP_BAD


def _count_epochs(per_epoch: dict[int, int], chunk_ids: np.ndarray, k: int) -> None:
    """Add rows of these chunk ids to ``per_epoch`` (epoch -> rows; ``k``: chunks an
    epoch, 0 for one chunk each). A batch's rows are usually of one epoch: counted
    from the smallest and largest id, with no sort."""
    if len(chunk_ids) <= _FEW:  # a batch: a few rows, cheaper as Python ints
        values = chunk_ids.tolist()
        low, high = min(values), max(values)
    else:
        low, high = int(chunk_ids.min()), int(chunk_ids.max())
    if k:
        low, high = low // k, high // k
    if low == high:
        per_epoch[low] = per_epoch.get(low, 0) + len(chunk_ids)
        return
    epochs, counts = np.unique(chunk_ids // k if k else chunk_ids, return_counts=True)
    for epoch, count in zip(epochs.tolist(), counts.tolist()):
        per_epoch[epoch] = per_epoch.get(epoch, 0) + count


def _closes(block: Block) -> int:
    """How many base offsets a block's rows close: ``block.close_counts().sum()``,
    without the per-row array (a row with pieces closes its pieces marked last; a row
    without any, itself)."""
    contributors = block.contributors
    if contributors is None:
        return len(block)
    offsets = contributors.offsets
    rows = len(offsets) - 1
    if rows <= 0:
        return 0
    marked = int(contributors.last[int(offsets[0]):int(offsets[-1])].sum())
    bare = rows - int(np.count_nonzero(offsets[1:] != offsets[:-1]))
    return marked + bare


#: Rows up to which :func:`_count_epochs` reads the ids as Python ints.
_FEW = 64


#: The name ``checkpoint.py`` gave the progress half of these books before they merged.
ProgressTracker = Accounting
