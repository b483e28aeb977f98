"""The engine: accumulators in stream order, workers in any order, results in order.

Each stage of a compiled plan is an operator, its accumulator and a pool::

    inbox ──► accumulator.push_many ──► micro-batch #0 #1 #2 ──► pool ──► slots ──► next inbox
                 (driver thread)            (sequence order)     (any order)  (released in order)

The driver (whoever calls :meth:`Engine.pump`) feeds every stage's inbox to
its accumulator in stream order, dispatches the micro-batches it returns,
and releases finished results from the head of the stage's *slots* queue
only, so a slow micro-batch is never overtaken (``deterministic=False``
releases data in completion order instead; control records still wait for
everything before them).

Control records never enter an accumulator:

* a **tombstone** takes a slot of its own at its stream position and is
  forwarded untouched;
* a **flush sentinel** of lane ``l`` makes the stage call
  ``flush(reset=True, lane_id=l)``, dispatch what it returns, check that lane
  ``l`` holds nothing more (a loud error otherwise), and forward the
  sentinel after those micro-batches. ``batch(drop_last=True)`` alone may
  *stall* a sentinel while the lane holds a partial batch: the sentinel then
  waits until ``try_epoch_reset(boundary, l)`` says the buffer holds only
  records of the new epoch.

At the end of the input a stage calls ``flush()``; records an accumulator
drops (a ``drop_last`` remainder) become tombstones, so nothing is lost
silently. Backpressure: a stage takes new input only while fewer than
``max_in_flight`` of its micro-batches are out.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Iterator
from typing import Any

from zephon_torch.ops.accumulators import Accumulator, lane_of
from zephon_torch.ops.base import Operator, check_elements, tombstone
from zephon_torch.runners.base import InlinePool, Pool
from zephon_torch.types import (
    FLUSH_SENTINEL_TAG,
    TOMBSTONE_TAG,
    SampleBatch,
    SampleRecord,
)

__all__ = ["Engine", "Stage"]


class _Slot:
    """One entry of a stage's ordered output: ready items or a pending future."""

    __slots__ = ("control", "future", "items")

    def __init__(self, items: list[Any] | None = None, future: cf.Future | None = None,
                 control: bool = False) -> None:
        self.items = items
        self.future = future
        self.control = control  # tombstones and sentinels: forwarded unchecked

    def done(self) -> bool:
        return self.future is None or self.future.done()


class Stage:
    """One compiled stage: operator, accumulator, pool and ordering state.

    Args:
        index: Position in the plan (the pool's stage index).
        name: Stage name for messages (``"tokenize"``, ``"map_transform_2"``).
        op: The operator.
        accumulator: Its fresh accumulator.
        pool: Where ``process_many`` runs.
        local: Run ``process_many`` on the driver thread (cheap operators,
            or the inline runner).
        stalls: This stage may stall flush sentinels (``batch(drop_last=True)``).
        resolve_input: Payloads arriving here may be lazy handles that must be
            resolved first (a local, remote or payload-reading stage after a
            process stage).
        max_in_flight: This stage's own bound on micro-batches out at once
            (a remote stage's ``Remote.max_in_flight``); ``None``: the
            engine's.
    """

    def __init__(self, index: int, name: str, op: Operator, accumulator: Accumulator,
                 pool: Pool, *, local: bool, stalls: bool, resolve_input: bool,
                 max_in_flight: int | None = None) -> None:
        self.index = index
        self.name = name
        self.op = op
        self.acc = accumulator
        self.pool = pool
        self.local = local
        self.stalls = stalls
        self.resolve_input = resolve_input
        self.max_in_flight = max_in_flight
        self.inbox: deque[list[Any]] = deque()
        self.slots: deque[_Slot] = deque()
        self.in_flight = 0
        self.stalled: dict[int, deque[SampleRecord]] = {}
        self.upstream_done = False
        self.flushed = False
        self.done = False
        #: What happened here, for stats() and for tests that check that
        #: sentinels and stalls were really exercised.
        self.counters = {"microbatches": 0, "sentinels": 0, "stalled_sentinels": 0,
                         "tombstones": 0}


class Engine:
    """Drives the stages over a source of chunks (see the module doc).

    Args:
        source: Yields lists of records (one chunk, plus sentinels).
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
        #: Lists of output elements, in order (a list per released slot).
        self.outputs: deque[list[Any]] = deque()
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
            if self.outputs:
                break
            if stages[-1].done:
                self.finished = True
                return bool(self.outputs)
            if not self.source_done and not stages[0].inbox and self._has_capacity():
                try:
                    stages[0].inbox.append(next(self.source))
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
        return all(stage.in_flight < self._limit(stage) for stage in self.stages)

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

    # ------------------------------------------------------------------ stages

    def _advance(self, stage: Stage) -> bool:
        moved = False
        limit = self._limit(stage)
        while stage.inbox and stage.in_flight < limit:
            elems = stage.inbox.popleft()
            if stage.resolve_input:
                elems = stage.pool.resolve(elems)
            self._feed(stage, elems)
            moved = True
        if not self.deterministic:
            ready = stage.acc.poll()
            if ready:
                self._dispatch(stage, ready)
                moved = True
        return moved

    def _feed(self, stage: Stage, elems: list[Any]) -> None:
        # Control records are rare: find them in one sweep, then cut around them.
        controls = [i for i, e in enumerate(elems)
                    if type(e) is SampleRecord and e.meta.tags and _is_control(e)]
        if not controls:
            self._push(stage, elems)
            return
        start = 0
        for i in controls:
            if i > start:
                self._push(stage, elems[start:i])
            self._control(stage, elems[i])
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

    def _control(self, stage: Stage, elem: SampleRecord) -> None:
        meta = elem.meta
        counters = stage.counters
        if not meta.tags.get(FLUSH_SENTINEL_TAG):
            counters["tombstones"] += 1
            stage.slots.append(_Slot([elem], control=True))  # keeps its stream position
            return
        counters["sentinels"] += 1
        lane = meta.lane_id
        acc = stage.acc
        if stage.stalls and (stage.stalled.get(lane) or acc.has_pending_data(lane)):
            counters["stalled_sentinels"] += 1
            queue = stage.stalled.setdefault(lane, deque())
            queue.append(elem)
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
        stage.slots.append(_Slot([elem], control=True))

    def _release_stalled(self, stage: Stage, lane: int) -> None:
        queue = stage.stalled.get(lane)
        while queue and stage.acc.try_epoch_reset(queue[0].meta.chunk_id, lane):
            stage.slots.append(_Slot([queue.popleft()], control=True))
        if queue is not None and not queue:
            del stage.stalled[lane]

    def _dispatch(self, stage: Stage, batches: list[list[Any]]) -> None:
        for batch in batches:
            if not batch:
                continue
            stage.counters["microbatches"] += 1
            if stage.local:
                stage.slots.append(_Slot(_run_local(stage, batch)))
            else:
                stage.slots.append(_Slot(None, stage.pool.submit(stage.index, batch)))
                stage.in_flight += 1

    def _take_dropped(self, stage: Stage) -> None:
        dropped = stage.acc.take_dropped()
        if dropped:
            stage.slots.append(_Slot([t for elem in dropped for t in _drop(elem)],
                                     control=True))

    def _finish(self, stage: Stage) -> bool:
        if stage.done:
            return False
        if not stage.flushed:
            if not (stage.upstream_done and not stage.inbox):
                return False
            self._dispatch(stage, stage.acc.flush())
            self._take_dropped(stage)
            for lane in sorted(stage.stalled):
                stage.slots.extend(_Slot([s], control=True) for s in stage.stalled[lane])
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

    def _release(self, stage: Stage) -> bool:
        slots = stage.slots
        if not slots:
            return False
        index = stage.index + 1
        target = self.stages[index].inbox if index < len(self.stages) else None
        moved = False
        if self.deterministic:
            while slots and slots[0].done():
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

    def _forward(self, stage: Stage, slot: _Slot, target: deque[list[Any]] | None) -> None:
        if slot.future is not None:
            stage.in_flight -= 1
            items = slot.future.result()  # re-raises the worker's exception, in order
        else:
            items = slot.items
        if not slot.control:
            items = check_elements(items, stage.name)
        if not items:
            return
        if target is not None:
            target.append(items)
        else:
            if stage.pool.remote_payloads and not stage.local:
                items = stage.pool.resolve(items)
            self.outputs.append(items)

    def close(self) -> None:
        """Cancel what is still queued (the pools are closed by their owner)."""
        for stage in self.stages:
            for slot in stage.slots:
                if slot.future is not None:
                    slot.future.cancel()
            stage.slots.clear()
            stage.inbox.clear()


def _is_control(elem: SampleRecord) -> bool:
    tags = elem.meta.tags
    return bool(tags.get(TOMBSTONE_TAG) or tags.get(FLUSH_SENTINEL_TAG))


def _drop(elem: Any) -> list[Any]:
    """A dropped element becomes tombstones closing what it would have closed."""
    records = elem.records if isinstance(elem, SampleBatch) else (elem,)
    return [tombstone(record, "drop_last") for record in records]


def _run_local(stage: Stage, batch: list[Any]) -> list[Any]:
    pool = stage.pool
    if isinstance(pool, InlinePool):
        return pool.run(stage.index, batch)
    return stage.op.process_many(batch)
