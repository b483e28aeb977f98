"""The hand-over: per-lane queues, and items handed out in lane order.

``PipelineIterator`` (``iterator.py``) routes what its executor produces
into one queue per lane (:class:`Handover`'s ``_route*`` methods) and hands
the items over round-robin in ascending lane order, ended lanes skipped.

Hand-over. A lane's plain data rows (or block batches) wait in its queue as
one *run*. When the lane at the round-robin position starts with a run, the
runs at the heads of the lanes are laid out in round-robin order, up to the
first lane that would need anything else (a pump, a batch, a sentinel):
exactly the items that ``next()`` one at a time would hand over, in that
order. ``__next__`` then takes them from a list iterator without a lock, and
the books count them in bulk from how many were taken (``_settle_fast``,
before anything reads or moves the position, ``state_dict()`` from another
thread included). Records are made from the rows 128 at a time as they are
reached::

    lanes 0..2 hold runs of 3, 2, 4 rows (a, b, c), round-robin at lane 0
    interleave: a0 b0 c0 a1 b1 c1 a2     (lane 1 has no third row: stop)
    4 taken, then state_dict(): lane 0 got a0 a1, lane 1 b0, lane 2 c0;
                                round-robin position: lane 1

Control records never reach the caller: tombstones and flush sentinels are
accounted there (every input sample is either delivered inside some output
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from itertools import chain, repeat
from typing import Any

import numpy as np

from zephon_torch.accounting import Accounting
from zephon_torch.block import Block, Sentinel
from zephon_torch.block_views import MIXED, BlockBatch, PlainRows
from zephon_torch.runners.lanes import Finished
from zephon_torch.types import SampleRecord, records_from_columns
from zephon_torch.vocab import FLUSH_SENTINEL_TAG, TOMBSTONE_TAG

__all__ = ["Handover"]

#: Items per interleave (the books are brought up to date once per interleave).
_INTERLEAVE_ITEMS = 4096
#: Records made at a time from the rows of an interleave. They live until the slice is
#: spent; a small slice keeps the objects alive at once under the garbage collector's
#: first threshold (700), so that they are freed young and never reach the old
#: generations, whose collections walk the whole heap (in the overhead benchmark they
#: cost more than everything else together).
_RECORD_SLICE = 128


class _Run:
    """Items of one lane that the caller receives one after the other, counted together.

    Either plain data rows of a block (``rows``: their records are built when
    an interleave takes them) or a list of ``items``: plain records or, with
    ``batches``, block batches. ``pos`` items have been received and
    counted. A run heads its lane's queue until it is spent.
    """

    __slots__ = ("batches", "items", "pos", "rows")

    def __init__(self, items: list[Any] | None, rows: PlainRows | None = None, *,
                 batches: bool = False) -> None:
        self.items = items
        self.rows = rows
        self.batches = batches
        self.pos = 0

    def size(self) -> int:
        """Items in the run, received or not."""
        return len(self.rows) if self.rows is not None else len(self.items)  # type: ignore[arg-type]

    def take(self, start: int, stop: int) -> list[Any]:
        """Items ``start..stop-1``."""
        if self.rows is not None:
            return self.rows.records(start, stop)
        return self.items[start:stop]  # type: ignore[index]


class _Interleave:
    """The items of several runs in round-robin order, as the fast path hands them out.

    ``served[j] = (lane index, lane, run)`` holds positions ``j, j + width,
    ...`` of the ``total`` items; ``settled`` of them have been counted.
    ``cursor = (before, iterator, size)``: the list iterator the caller takes
    items from, over ``size`` items that follow the first ``before``.
    """

    __slots__ = ("cursor", "served", "settled", "total")

    def __init__(self, served: list[tuple[int, int, _Run]], total: int) -> None:
        self.served = served
        self.total = total
        self.settled = 0
        self.cursor: tuple[int, Iterator[Any], int] = (0, iter(()), 0)


def _record_slices(plan: _Interleave, takes: list[int]) -> Iterator[Iterator[SampleRecord]]:
    """The records of an interleave of block rows, made a slice at a time.

    The rows are laid out in round-robin order at once: their ids (and
    lanes) in one numpy array, the other fields by list slice assignment (a
    field of one object in every served run, as the counts usually are, is
    repeated instead). Records are made :data:`_RECORD_SLICE` at a time as
    the caller reaches them, so that few are alive at once. Its first step
    runs in :meth:`PipelineIterator._interleave`, under the lock, and reads
    all it needs of the runs then; the later steps run on the iterating
    thread without the lock, touch only the laid-out fields, and publish the
    slice being consumed in ``plan.cursor``.
    """
    served, total = plan.served, plan.total
    width = len(served)
    runs: list[tuple[int, PlainRows, slice, slice]] = [
        (takes[j], run.rows, slice(run.pos, run.pos + takes[j]), slice(j, None, width))  # type: ignore[misc]
        for j, (_, _, run) in enumerate(served) if takes[j]]
    ids = np.empty((total, 6), dtype=np.int64)  # lane, then the five id columns
    for _, rows, cut, at in runs:
        ids[at, 0] = rows.lane
        ids[at, 1:] = rows.ids[cut]

    def laid_out(values: Any, column: Any) -> Any:
        """One field in round-robin order, or an endless repeat of the one object every
        run has (``values(rows)``: that object, or MIXED; ``column(rows)``: the list)."""
        shared = {id(v): v for v in (values(rows) for _, rows, _, _ in runs)}
        if len(shared) == 1:
            (value,) = shared.values()
            if value is not MIXED:
                return repeat(value)
        out: list[Any] = [None] * total
        for take, rows, cut, at in runs:
            value = values(rows)
            out[at] = [value] * take if value is not MIXED else column(rows)[cut]
        return out

    counts = laid_out(lambda rows: rows.uniform_counts, lambda rows: rows.counts)
    payloads = laid_out(lambda rows: MIXED, lambda rows: rows.payloads)
    tokens = lineage = None
    if any(rows.token_counts is not None for _, rows, _, _ in runs):
        tokens = laid_out(lambda rows: None if rows.token_counts is None else MIXED,
                          lambda rows: rows.token_counts)
    if any(rows.lineage is not None for _, rows, _, _ in runs):
        lineage = laid_out(lambda rows: () if rows.lineage is None else MIXED,
                           lambda rows: rows.lineage)

    def part(field: Any, cut: slice) -> Any:
        return field if type(field) is repeat else field[cut]

    for start in range(0, total, _RECORD_SLICE):
        cut = slice(start, start + _RECORD_SLICE)
        lanes, *columns = ids[cut].T.tolist()
        records = records_from_columns(
            lanes, columns, part(counts, cut), payloads[cut],
            None if tokens is None else part(tokens, cut),
            None if lineage is None else part(lineage, cut))
        items = iter(records)
        plan.cursor = (start, items, len(records))
        yield items

class Handover:
    """The per-lane queues of an iterator and the hand-over from them (see the module doc).

    A part of :class:`~zephon_torch.runners.iterator.PipelineIterator`, which
    sets the attributes below and holds the lock these methods expect.

    Attributes:
        lanes: The lanes, in round-robin order.
        accounting: The run's books.
        _queues: Per lane, what waits for the caller: runs and single items.
        _rr: The round-robin position (an index into ``lanes``).
        _ended: The lanes whose output has ended.
        _plan, _fast: The interleave being handed out, and its iterator.
        _at_loaded: Nothing handed out since a state was loaded.
    """

    #: At most this many items per interleave. Tests set 1 to hand items over one at
    #: a time, the reference the interleaves are held to.
    _interleave_max: int = _INTERLEAVE_ITEMS

    lanes: list[int]
    accounting: Accounting
    _queues: dict[int, deque[Any]]
    _rr: int
    _ended: set[int]
    _plan: _Interleave | None
    _fast: Iterator[Any]
    _at_loaded: bool

    def _serve(self, lane: int, queue: deque[Any]) -> Any:
        """Hand over the next item of ``lane`` (whose queue is not empty), lock held."""
        if type(queue[0]) is _Run:
            return self._interleave()
        return self._deliver(lane, queue)

    def _deliver(self, lane: int, queue: deque[Any]) -> Any:
        """One item that is not part of a run: a tagged record, a batch of records, a
        finished batch. It is accounted at once."""
        # Every first item after a pump comes through here or _interleave (the fast
        # path needs an interleave that a pump filled), so the loaded position ends here.
        self._at_loaded = False
        self._rr = (self._rr + 1) % len(self.lanes)
        item = queue.popleft()
        # A batch finished in its lane worker counts as the batch it carries.
        self.accounting.delivered(lane, item.batch if type(item) is Finished else item)
        if queue and type(queue[0]) is SampleRecord and queue[0].meta.tags:
            self._drain_sentinels(lane, queue)
        return item

    def _interleave(self) -> Any:
        """Start handing out the runs at the heads of the lanes' queues, round-robin.

        From the lane at the round-robin position on, the lanes whose queue
        starts with a run take turns, one item each, ended lanes skipped, up to
        the first lane that has nothing left in its run or whose next item is
        not in a run: exactly the items, in exactly the order, that one
        ``next()`` at a time would hand over before anything else happened
        (a pump, a batch, a sentinel). They go into one list, read by the fast
        path of :meth:`__next__`; :meth:`_settle_fast` accounts for them from
        the count taken. Lock held; the lane at the round-robin position starts
        with a run. Returns the first item.
        """
        lanes = self.lanes
        count = len(lanes)
        queues = self._queues
        ended = self._ended
        rr = self._rr
        served: list[tuple[int, int, _Run]] = []
        blocked = False
        for step in range(count):
            index = (rr + step) % count
            lane = lanes[index]
            queue = queues[lane]
            if queue:
                head = queue[0]
                if type(head) is not _Run:
                    blocked = True
                    break
                served.append((index, lane, head))
            elif lane not in ended:
                blocked = True  # this lane needs a pump
                break
        width = len(served)
        left = [run.size() - run.pos for _, _, run in served]
        if blocked:  # one turn, up to the lane that stops it
            total = width
        else:  # whole rounds while every run lasts, then the lanes that have more
            rounds = min(left)
            total = rounds * width + left.index(rounds)
        total = min(total, self._interleave_max)
        # Lane j holds positions j, j + width, ... below total.
        takes = [(total - j + width - 1) // width for j in range(width)]
        plan = _Interleave(served, total)
        if all(run.rows is not None for _, _, run in served):
            fast: Iterator[Any] = chain.from_iterable(_record_slices(plan, takes))
        else:
            out: list[Any] = [None] * total
            for j, (_, _, run) in enumerate(served):
                if takes[j]:
                    out[j::width] = run.take(run.pos, run.pos + takes[j])
            fast = iter(out)
            plan.cursor = (0, fast, total)
        self._plan = plan
        self._at_loaded = False
        self._fast = fast
        return next(fast)

    def _settle_fast(self) -> None:
        """Account for the items the caller took from the interleave since the last call.

        How many were taken is read from the list iterator being consumed
        (its length less what it has left, after the items of the lists
        before it): the ``j``-th served lane got the items at positions ``j,
        j + width, ...`` below that count. Each lane's books then hear
        of its items in order, its run finished being dropped (and the
        sentinels right behind it accounted, as after any item), and the
        round-robin position moves past the last item taken. Lock held; safe
        while the iterating thread goes on taking items (it only moves the
        list iterator).
        """
        plan = self._plan
        if plan is None:
            return
        total = plan.total
        first, items, size = plan.cursor  # one read: the iterating thread replaces it whole
        taken = first + size - items.__length_hint__()  # exact for a list iterator
        done = plan.settled
        if taken > done:
            served = plan.served
            width = len(served)
            queues = self._queues
            for j, (_, lane, run) in enumerate(served):
                now = (taken - j + width - 1) // width if taken > j else 0
                before = (done - j + width - 1) // width if done > j else 0
                if now == before:
                    continue
                start = run.pos
                run.pos = start + now - before
                self._account(lane, run, start, run.pos)
                if run.pos == run.size():
                    queue = queues[lane]
                    queue.popleft()  # the run heads its queue until it is spent
                    if queue and type(queue[0]) is SampleRecord and queue[0].meta.tags:
                        self._drain_sentinels(lane, queue)
            self._rr = (served[(taken - 1) % width][0] + 1) % len(self.lanes)
            plan.settled = taken
        if taken == total:
            self._plan = None

    def _account(self, lane: int, run: _Run, start: int, stop: int) -> None:
        """Items ``start..stop-1`` of a run were received: tell the books, in one call."""
        books = self.accounting
        if run.rows is not None:
            books.delivered_rows(lane, run.rows, start, stop)
        elif run.batches:
            books.delivered_batches(lane, run.items[start:stop])  # type: ignore[index]
        else:
            books.delivered_plain(lane, run.items[start:stop])  # type: ignore[index]

    def _settle_all(self) -> None:
        """Bring the books up to date with what the caller received (lock held)."""
        self._settle_fast()

    def _drain_sentinels(self, lane: int, queue: deque[Any]) -> None:
        """Sentinels at the head of a lane's queue: their epoch is fully delivered."""
        while queue and type(queue[0]) is SampleRecord and queue[0].meta.is_flush_sentinel:
            self.accounting.sentinel(lane, queue.popleft().meta.chunk_id)
    # ------------------------------------------------------------------ routing

    def _route(self, elem: Any) -> None:
        kind = type(elem)
        if kind is BlockBatch:
            self._queue_batch(elem)
            return
        if kind is SampleRecord:
            lane = elem.meta.lane_id
            tags = elem.meta.tags
            if not tags:
                self._queue_records(lane, [elem])
                return
            if tags.get(TOMBSTONE_TAG):
                self.accounting.tombstone(lane, elem)
                return
            if tags.get(FLUSH_SENTINEL_TAG):
                self._route_sentinel(lane, elem.meta.chunk_id)
                return
        else:
            lane = elem.lane_ids[0]
        self._queues[lane].append(elem)

    def _queue_records(self, lane: int, records: Sequence[SampleRecord]) -> None:
        """Plain records of ``lane`` join its queue, in a run with the records before them."""
        queue = self._queues[lane]
        if queue:
            tail = queue[-1]
            if type(tail) is _Run and tail.items is not None and not tail.batches:
                tail.items.extend(records)  # no interleave reads it: pumps come between
                return
        queue.append(_Run(list(records)))

    def _queue_batch(self, batch: BlockBatch) -> None:
        """A block batch joins its lane's queue, in a run with the batches before it."""
        queue = self._queues[batch.block.lane]
        if queue:
            tail = queue[-1]
            if type(tail) is _Run and tail.batches:
                tail.items.append(batch)  # type: ignore[union-attr]
                return
        queue.append(_Run([batch], batches=True))

    def _route_sentinel(self, lane: int, boundary: int) -> None:
        # A marker in the lane's queue: the epoch is done once the caller has
        # received everything queued before it.
        queue = self._queues[lane]
        if queue:
            queue.append(Sentinel(lane, boundary).record())
        else:
            self.accounting.sentinel(lane, boundary)

    def _route_block(self, block: Block) -> None:
        """A block of records: its tombstones are accounted, its data rows queued as records."""
        lane = block.lane
        data = block
        if block.tomb is not None:
            tombs = block.take(np.flatnonzero(block.tomb))
            self.accounting.tombstones(tombs)
            if len(tombs) == len(block):
                return
            data = block.take(np.flatnonzero(~block.tomb))
        if data._plain():  # the usual block: its records are made when handed out
            self._queues[lane].append(_Run(None, PlainRows(data)))
            return
        queue = self._queues[lane]
        for record in data.records():  # rows with tags (packed, with metadata) alone
            if record.meta.tags:
                queue.append(record)
            else:
                self._queue_records(lane, [record])
