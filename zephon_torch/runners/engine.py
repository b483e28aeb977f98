"""The engine: accumulators in stream order, workers in any order, results in order.

Each stage of a compiled plan is an operator, its accumulator and a pool::

    inbox ──► accumulator ──► micro-batch #0 #1 #2 ──► pool ──► slots ──► next inbox
              (driver thread)     (sequence order)    (any order)  (released in order)

The driver (whoever calls :meth:`Engine.pump`) feeds every stage's inbox to
its accumulator in stream order, dispatches the micro-batches it returns,
and releases finished results from the head of the stage's *slots* queue
only, so a slow micro-batch is never overtaken (``deterministic=False``
releases data in completion order instead; control items still wait for
everything before them).

**Units.** What moves between stages is a *unit*: a
:class:`~zephon_torch.block.Block` (one lane's records as columns, the
common case before ``batch``), a :class:`~zephon_torch.block.Sentinel` (a
lane's epoch boundary) or a list of elements (records or batches, from a
user operator, or batches after ``batch``). A stage runs in *block mode*
when it comes before ``batch`` and both its operator and its accumulator
have a block path (``process_block``, ``push_block``); it then receives
blocks only (a list from an upstream user operator is turned into blocks).
Any other stage gets lists of records, as the seed contract says; a block
reaching it is viewed as records once.

Control items never enter an accumulator as data:

* **tombstones** (rows of a block, or tombstone records) keep their stream
  position: a stage that is not elementwise forwards them in a slot of their
  own after the micro-batches dispatched before them; elementwise block
  stages let them ride inside the blocks (their operators pass them through);
* a **flush sentinel** of lane ``l`` makes the stage call
  ``flush(reset=True, lane_id=l)``, dispatch what it returns, check that lane
  ``l`` holds nothing more (a loud error otherwise), and forward the
  sentinel after those micro-batches. ``batch(drop_last=True)`` alone may
  *stall* a sentinel while the lane holds a partial batch: the sentinel then
  waits until ``try_epoch_reset(boundary, l)`` says the buffer holds only
  records of the new epoch.

At the end of the input a stage calls ``flush()``; what an accumulator drops
(a ``drop_last`` remainder) becomes tombstones, so nothing is lost silently.
Backpressure: a stage takes new input only while fewer than ``max_in_flight``
of its micro-batches are out.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from zephon_torch.block import Block, Sentinel, blocks_from_elements
from zephon_torch.ops.accumulators import Accumulator, lane_of
from zephon_torch.ops.base import Operator, check_elements, tombstone
from zephon_torch.runners.base import InlinePool, Pool, run_unit
from zephon_torch.types import SampleBatch, SampleRecord
from zephon_torch.vocab import is_control, is_flush_sentinel

__all__ = ["Engine", "Stage", "Unit"]

#: What moves between stages (see the module doc).
Unit = Block | Sentinel | list


class _Slot:
    """One entry of a stage's ordered output: a ready unit, a pending future, or
    the job of a local stage, run when the slot is released (``job``)."""

    __slots__ = ("control", "future", "job", "unit")

    def __init__(self, unit: Any = None, future: cf.Future | None = None,
                 control: bool = False, job: Any = None) -> None:
        self.unit = unit
        self.future = future
        self.control = control  # tombstones and sentinels: forwarded unchecked
        self.job = job

    def done(self) -> bool:
        return self.future is None or self.future.done()


class Stage:
    """One compiled stage: operator, accumulator, pool and ordering state.

    Args:
        index: Position in the plan (the pool's stage index).
        name: Stage name for messages (``"tokenize"``, ``"map_transform_2"``).
        op: The operator.
        accumulator: Its fresh accumulator.
        pool: Where the micro-batches run.
        local: Run micro-batches on the driver thread (cheap operators, or
            the inline runner).
        stalls: This stage may stall flush sentinels (``batch(drop_last=True)``).
        blocks: Block mode (see the module doc).
        max_in_flight: This stage's own bound on micro-batches out at once
            (a remote stage's ``Remote.max_in_flight``); ``None``: the
            engine's.
    """

    def __init__(self, index: int, name: str, op: Operator, accumulator: Accumulator,
                 pool: Pool, *, local: bool, stalls: bool, blocks: bool = False,
                 max_in_flight: int | None = None) -> None:
        self.index = index
        self.name = name
        self.op = op
        self.acc = accumulator
        self.pool = pool
        self.local = local
        self.stalls = stalls
        self.blocks = blocks
        # Tombstone rows ride inside the blocks of an elementwise block stage.
        self.tombs_ride = blocks and op.traits().elementwise
        self.max_in_flight = max_in_flight
        self.inbox: deque[Any] = deque()
        self.slots: deque[_Slot] = deque()
        self.in_flight = 0
        self.stalled: dict[int, deque[Sentinel]] = {}
        self.upstream_done = False
        self.flushed = False
        self.done = False
        #: What happened here, for stats() and for tests that check that
        #: sentinels and stalls were really exercised.
        self.counters = {"microbatches": 0, "sentinels": 0, "stalled_sentinels": 0,
                         "tombstones": 0}


class Engine:
    """Drives the stages over a source of units (see the module doc).

    Args:
        source: Yields lists of units (a chunk's block, then maybe a sentinel).
        stages: The compiled stages, in order.
        deterministic: Release results in sequence order (True) or in
            completion order (False; latency-bound flushes are polled).
        max_in_flight: Micro-batches a stage may have out at once.
    """

    def __init__(self, source: Iterator[list[Any]], stages: list[Stage], *,
                 deterministic: bool = True, max_in_flight: int = 8) -> None:
        self.source = source
        self.stages = stages
        self.deterministic = deterministic
        self.max_in_flight = max(1, max_in_flight)
        #: Output units, in order.
        self.outputs: deque[Any] = deque()
        self.source_done = False
        self.finished = False

    # ------------------------------------------------------------------ driving

    def pump(self) -> bool:
        """Advance until some output is ready; False once everything has ended."""
        stages = self.stages
        while not self.outputs:
            if self.finished:
                return False
            moved = False
            for stage in stages:
                moved |= self._release(stage)
                moved |= self._advance(stage)
                moved |= self._finish(stage)
                # What finished at once (a local stage) moves on in this sweep, so
                # a unit crosses every local stage before the source is read again:
                # the first output comes after one chunk, not one chunk per stage.
                moved |= self._release(stage)
            if self.outputs:
                break
            if stages[-1].done:
                self.finished = True
                return bool(self.outputs)
            if not self.source_done and not stages[0].inbox and self._has_capacity():
                try:
                    stages[0].inbox.extend(next(self.source))
                except StopIteration:
                    self.source_done = True
                    stages[0].upstream_done = True
                moved = True
            if not moved:
                self._wait()
        return True

    def _limit(self, stage: Stage) -> int:
        return stage.max_in_flight or self.max_in_flight

    def _has_capacity(self) -> bool:
        # A local stage with micro-batches still to run (a ramping stage's deferred
        # ones) has none: the source is read once they have run, as when every
        # local micro-batch ran at once, so the run does not read further ahead.
        return all(not stage.in_flight if stage.local else stage.in_flight < self._limit(stage)
                   for stage in self.stages)

    def _wait(self) -> None:
        futures = [slot.future for stage in self.stages for slot in stage.slots
                   if slot.future is not None]
        pending = [f for f in futures if not f.done()]
        if pending:
            cf.wait(pending, return_when=cf.FIRST_COMPLETED)
        elif futures:
            pass  # finished after this round looked at them: the next round releases them
        elif not self.deterministic:
            pass  # latency-bound flushes will fire on the next poll
        else:  # nothing can move: a bug, never a silent hang
            raise RuntimeError("zephon engine stalled: no work in flight and no input ready")

    # ------------------------------------------------------------------ feeding a stage

    def _advance(self, stage: Stage) -> bool:
        moved = False
        limit = self._limit(stage)
        while stage.inbox and stage.in_flight < limit:
            self._feed(stage, stage.inbox.popleft())
            moved = True
        if not self.deterministic:
            ready = stage.acc.poll()
            if ready:
                self._dispatch(stage, ready)
                moved = True
        return moved

    def _feed(self, stage: Stage, unit: Any) -> None:
        kind = type(unit)
        if kind is Sentinel:
            self._sentinel(stage, unit)
        elif kind is Block:
            if stage.blocks:
                self._feed_block(stage, unit)
            else:
                self._feed_records(stage, unit)
        elif stage.blocks:
            for block in blocks_from_elements(unit, stage.name):
                self._feed_block(stage, block)
        else:
            self._feed_list(stage, unit)

    def _feed_block(self, stage: Stage, block: Block) -> None:
        """A block into a block-mode stage, tombstone rows routed around it unless they ride."""
        if stage.tombs_ride or block.tomb is None:
            self._push_block(stage, block)
        else:
            self._around_tombstones(stage, block, self._push_block)

    def _around_tombstones(self, stage: Stage, block: Block, push: Any) -> None:
        """``push(stage, part)`` each run of data rows; tombstone runs keep their place."""
        for start, stop, is_tomb in _runs(block.tomb):  # type: ignore[arg-type]
            part = block.slice(start, stop)
            if is_tomb:
                self._tombstones(stage, part)
            else:
                push(stage, part)

    def _push_block(self, stage: Stage, block: Block) -> None:
        acc = stage.acc
        if not stage.stalled or block.lane not in stage.stalled:
            self._dispatch(stage, acc.push_block(block))
            return
        # The lane holds a stalled sentinel: push a row at a time so that the
        # sentinel is released right after the batch that closes its epoch.
        for i in range(len(block)):
            self._dispatch(stage, acc.push_block(block.slice(i, i + 1)))
            self._release_stalled(stage, block.lane)

    def _feed_records(self, stage: Stage, block: Block) -> None:
        """A block into a stage that takes records: viewed as records once."""
        if block.tomb is None:
            self._push(stage, block.records())
        else:
            self._around_tombstones(stage, block,
                                    lambda stage, part: self._push(stage, part.records()))

    def _feed_list(self, stage: Stage, elems: list[Any]) -> None:
        # Control records are rare: find them in one sweep, then cut around them.
        controls = [i for i, e in enumerate(elems)
                    if type(e) is SampleRecord and e.meta.tags and is_control(e.meta.tags)]
        if not controls:
            self._push(stage, elems)
            return
        start = 0
        for i in controls:
            if i > start:
                self._push(stage, elems[start:i])
            record = elems[i]
            if is_flush_sentinel(record.meta.tags):
                self._sentinel(stage, Sentinel(record.meta.lane_id, record.meta.chunk_id))
            else:
                stage.counters["tombstones"] += 1
                stage.slots.append(_Slot([record], control=True))
            start = i + 1
        if start < len(elems):
            self._push(stage, elems[start:])

    def _push(self, stage: Stage, data: list[Any]) -> None:
        acc = stage.acc
        if not stage.stalled:
            self._dispatch(stage, acc.push_many(data))
            return
        # A lane holds a stalled sentinel: push one element at a time so the
        # sentinel is released right after the batch that closes its epoch.
        for elem in data:
            self._dispatch(stage, acc.push_many([elem]))
            self._release_stalled(stage, lane_of(elem))

    def _tombstones(self, stage: Stage, block: Block) -> None:
        """Tombstone rows bypass a stage, keeping their stream position."""
        stage.counters["tombstones"] += len(block)
        stage.slots.append(_Slot(block, control=True))

    def _sentinel(self, stage: Stage, sentinel: Sentinel) -> None:
        counters = stage.counters
        counters["sentinels"] += 1
        lane = sentinel.lane
        acc = stage.acc
        if stage.stalls and (stage.stalled.get(lane) or acc.has_pending_data(lane)):
            counters["stalled_sentinels"] += 1
            queue = stage.stalled.setdefault(lane, deque())
            queue.append(sentinel)
            self._release_stalled(stage, lane)
            return
        self._dispatch(stage, acc.flush(reset=True, lane_id=lane))
        if acc.has_pending_data(lane):
            raise RuntimeError(
                f"stage {stage.name!r}: flush(reset=True, lane_id={lane}) left pending data on "
                f"lane {lane}; an accumulator must emit and fully reset the lane at a flush "
                "sentinel, or replay would silently break"
            )
        self._take_dropped(stage)
        stage.slots.append(_Slot(sentinel, control=True))

    def _release_stalled(self, stage: Stage, lane: int) -> None:
        queue = stage.stalled.get(lane)
        while queue and stage.acc.try_epoch_reset(queue[0].boundary, lane):
            stage.slots.append(_Slot(queue.popleft(), control=True))
        if queue is not None and not queue:
            del stage.stalled[lane]

    def _dispatch(self, stage: Stage, batches: list[Any]) -> None:
        first = True
        for batch in batches:
            if not len(batch):
                continue
            stage.counters["microbatches"] += 1
            if stage.local and (not stage.acc.ramps or (first and not stage.in_flight)):
                stage.slots.append(_Slot(_run_local(stage, batch)))
                first = False
            elif stage.local:
                # The next ones of one push run when released, one at a time: a
                # lane's small first micro-batch reaches the next stages before its
                # larger next ones are worked (see CountingAccumulator's ramp_from).
                # Jobs run in the order they were cut (reads stay in file order).
                stage.slots.append(_Slot(job=batch))
                stage.in_flight += 1
            else:
                stage.slots.append(_Slot(None, stage.pool.submit(stage.index, batch)))
                stage.in_flight += 1

    def _take_dropped(self, stage: Stage) -> None:
        dropped = stage.acc.take_dropped()
        if not dropped:
            return
        for unit in _dropped_units(dropped):
            stage.slots.append(_Slot(unit, control=True))

    def _finish(self, stage: Stage) -> bool:
        if stage.done:
            return False
        if not stage.flushed:
            if not (stage.upstream_done and not stage.inbox):
                return False
            self._dispatch(stage, stage.acc.flush())
            self._take_dropped(stage)
            for lane in sorted(stage.stalled):
                stage.slots.extend(_Slot(s, control=True) for s in stage.stalled[lane])
            stage.stalled.clear()
            stage.flushed = True
            return True
        if stage.slots:
            return False
        stage.done = True
        index = stage.index + 1
        if index < len(self.stages):
            self.stages[index].upstream_done = True
        return True

    # ------------------------------------------------------------------ releasing results

    def _release(self, stage: Stage) -> bool:
        slots = stage.slots
        if not slots:
            return False
        index = stage.index + 1
        target = self.stages[index].inbox if index < len(self.stages) else self.outputs
        moved = False
        if self.deterministic:
            # A local job runs only as the first thing released here: what came
            # before it goes to the next stages first.
            while slots and slots[0].done() and not (moved and slots[0].job is not None):
                self._forward(stage, slots.popleft(), target)
                moved = True
            return moved
        # Completion order for data; a control slot waits for all before it.
        kept: deque[_Slot] = deque()
        barrier = False
        for slot in slots:
            if not barrier and slot.done() and (not slot.control or not kept):
                self._forward(stage, slot, target)
                moved = True
            else:
                kept.append(slot)
                barrier = barrier or slot.control
        stage.slots = kept
        return moved

    def _forward(self, stage: Stage, slot: _Slot, target: deque[Any]) -> None:
        if slot.future is not None:
            stage.in_flight -= 1
            unit = slot.future.result()  # re-raises the worker's exception, in order
        elif slot.job is not None:
            stage.in_flight -= 1
            unit = _run_local(stage, slot.job)
        else:
            unit = slot.unit
        kind = type(unit)
        if kind is Block or kind is Sentinel:
            if kind is Sentinel or len(unit):
                target.append(unit)
            return
        if not slot.control:
            unit = check_elements(unit, stage.name)
        if unit:
            target.append(unit)

    def close(self) -> None:
        """Cancel what is still queued (the pools are closed by their owner)."""
        for stage in self.stages:
            for slot in stage.slots:
                if slot.future is not None:
                    slot.future.cancel()
            stage.slots.clear()
            stage.inbox.clear()


def _runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """``(start, stop, value)`` of each run of equal values in a bool array."""
    n = len(mask)
    if n == 0:
        return []
    change = np.flatnonzero(mask[1:] != mask[:-1]) + 1
    starts = [0, *change.tolist()]
    stops = [*change.tolist(), n]
    values = mask[starts].tolist()
    return list(zip(starts, stops, values))


def _dropped_units(dropped: list[Any]) -> list[Any]:
    """What an accumulator dropped, as tombstones closing what it would have closed."""
    units: list[Any] = []
    records: list[Any] = []
    for elem in dropped:
        if type(elem) is Block:
            units.append(elem.with_tombstones(np.ones(len(elem), dtype=bool), "drop_last"))
        else:
            batch = elem.records if isinstance(elem, SampleBatch) else (elem,)
            records.extend(tombstone(record, "drop_last") for record in batch)
    if records:
        units.append(records)
    return units


def _run_local(stage: Stage, batch: Any) -> Any:
    pool = stage.pool
    if isinstance(pool, InlinePool):
        return pool.run(stage.index, batch)
    return run_unit(stage.op, batch)
