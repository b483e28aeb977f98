"""The consumer side: the iterator ``Pipeline.iter()`` returns.

It builds everything a run needs (the lanes this rank owns, from
``topology.py``; the compiled stages with their accumulators, the worker
pools and the engine, from ``assembly.py``; the source emitter) and hands out
data in a fixed order: the rank's lanes round-robin in ascending lane order,
a lane that has ended being skipped. Each lane's output depends only on the
lane's input, so that order, and every byte, is the same whatever the runner,
the worker count or the micro-batch sizes.

This module is the consumer loop: it pumps the engine, routes what comes out
to per-lane queues, hands items over and reports each event once to the
run's books (``accounting.py``).

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
or closed by a tombstone) and dropped. Saving and loading a position
(``state_dict``/``load_state_dict``) go through ``resume.py``.

With ``runner="lanes"`` the engine is a :class:`~zephon_torch.runners.lanes.LaneRun`:
worker processes run the whole pipeline of their share of the lanes and
ship, per lane and in order, what this loop would have taken from its own
engine; everything here stays the same (see ``lanes.py``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon_torch import logs
from zephon_torch.accounting import Accounting
from zephon_torch.block import MIXED, Block, BlockBatch, PlainRows, Sentinel
from zephon_torch.checkpoint import fingerprint_parts, refuse_nondeterministic
from zephon_torch.epochs import check_epoch, check_state_epoch, epoch_pipeline
from zephon_torch.logs import log_end, log_resume, log_skips, log_start, log_throughput
from zephon_torch.runners import resume
from zephon_torch.runners.assembly import (
    make_pools,
    make_run,
    make_schedule,
    remote_stages,
    stage_contexts,
)
from zephon_torch.runners.base import Pool
from zephon_torch.runners.lanes import Finished, LaneJob, LaneRun
from zephon_torch.sources.base import thread_bytes_read
from zephon_torch.sources.schedule import Chunk
from zephon_torch.throughput import Throughput
from zephon_torch.topology import lane_shares, owned_lanes, resolve_topology
from zephon_torch.types import SampleBatch, SampleRecord, records_from_columns
from zephon_torch.vocab import FLUSH_SENTINEL_TAG, TOMBSTONE_TAG

if TYPE_CHECKING:
    from zephon_torch.pipeline import Pipeline

# resolve_topology (and owned_lanes) live in topology.py; they stay importable from here.
__all__ = ["ITER_KWARGS", "RUNNERS", "PipelineIterator", "resolve_topology"]

#: The runners ``Pipeline.iter`` takes.
RUNNERS = ("inline", "threads", "process", "lanes")
#: The keyword arguments of ``Pipeline.iter`` (the torch wrappers check theirs against it).
ITER_KWARGS = ("runner", "num_workers", "deterministic", "rank", "world_size",
               "microbatch_sizes", "lanes", "verify", "task_timeout", "epoch")
#: Items per interleave (the books are brought up to date once per interleave).
_INTERLEAVE_ITEMS = 4096
#: Records made at a time from the rows of an interleave. They live until the slice is
#: spent; a small slice keeps the objects alive at once under the garbage collector's
#: first threshold (700), so that they are freed young and never reach the old
#: generations, whose collections walk the whole heap (in the overhead benchmark they
#: cost more than everything else together).
_RECORD_SLICE = 128
#: Bad samples named in the skip warning.
_WARN_EXAMPLES = 5


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


class PipelineIterator:
    """Iterates a pipeline's output for one rank (see the module doc).

    Args:
        pipeline: The pipeline.
        runner: ``"inline"``, ``"threads"`` (default), ``"process"`` or
            ``"lanes"``. Stages placed with ``placement="remote"`` run on
            Ray actors whatever the runner (``runners/ray.py``), except under
            ``"lanes"``, which refuses them.
        num_workers: Workers per pool (default: up to 4, the CPU count); with
            ``runner="lanes"`` the lane worker processes (default: as many,
            at most one per lane of the rank).
        deterministic: Release results in sequence order (the default);
            False allows completion order and latency-bound flushes, and
            then the iterator cannot checkpoint (:meth:`state_dict` and
            :meth:`load_state_dict` raise ``NotCheckpointableError``).
        rank, world_size: The topology (default: ``torch.distributed``, then
            ``RANK``/``WORLD_SIZE``, then 0 and 1).
        microbatch_sizes: ``{stage_name: size}`` performance overrides.
        lanes: An explicit subset of lanes (tools and tests).
        verify: Check conservation at the end of the pass: every sample read
            was delivered, tombstoned or (after a resume) dropped as already
            delivered, exactly once; a
            :class:`~zephon_torch.checks.ConservationError` says otherwise.
            It costs a little Python work per item, so it is off by default.
        task_timeout: With ``runner="process"``: seconds one micro-batch may
            run in a worker before the worker is killed and the micro-batch
            sent again (None: no limit); see ``ProcessPool``.
        epoch: The epoch to run (``zephon_torch.epochs``): a new, reproducible
            order per epoch, derived from the seeds and the epoch; 0 is the
            pipeline's order as ever. ``None`` (default): 0, or the epoch of
            the state :meth:`load_state_dict` loads; an explicit epoch refuses
            a state of another epoch.
        finish: With ``runner="lanes"``: called in the lane worker on each
            batch; the caller then receives a
            :class:`~zephon_torch.runners.lanes.Finished` (``zephon_torch.DataLoader``
            runs ``to_training`` there). Not a ``Pipeline.iter`` argument.
        prefetch: With ``runner="lanes"``: messages each worker may produce
            ahead of the consumer (default ``lanes.DEFAULT_PREFETCH``).
    """

    #: At most this many items per interleave. Tests set 1 to hand items over one at
    #: a time, the reference the interleaves are held to.
    _interleave_max: int = _INTERLEAVE_ITEMS

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        runner: str = "threads",
        num_workers: int | None = None,
        deterministic: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        microbatch_sizes: Mapping[str, int] | None = None,
        lanes: Sequence[int] | None = None,
        verify: bool = False,
        task_timeout: float | None = None,
        finish: Callable[[SampleBatch], Any] | None = None,
        prefetch: int | None = None,
        epoch: int | None = None,
    ) -> None:
        if runner not in RUNNERS:
            raise ValueError(f"unknown runner {runner!r}; use one of {list(RUNNERS)}")
        if task_timeout is not None and runner != "process":
            raise ValueError(
                f"task_timeout={task_timeout!r} needs runner='process' (only a worker process "
                f"can be stopped; a thread cannot), got runner={runner!r}"
            )
        self.task_timeout = task_timeout
        if (finish is not None or prefetch is not None) and runner != "lanes":
            raise ValueError(f"finish= and prefetch= apply to runner='lanes', got runner="
                             f"{runner!r}")
        if num_workers is not None and (not isinstance(num_workers, int)
                                        or isinstance(num_workers, bool) or num_workers < 1):
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        if runner in ("process", "lanes") and multiprocessing.current_process().daemon:
            warnings.warn(
                f"runner={runner!r} inside a daemonic process (a torch DataLoader worker) "
                "cannot start worker processes; falling back to runner='inline'",
                RuntimeWarning, stacklevel=3,
            )
            runner = "inline"
        self.pipeline = pipeline
        self.runner = runner
        self.deterministic = deterministic
        self.verify = bool(verify)
        self._microbatch_sizes = microbatch_sizes
        self._finish = finish
        self._prefetch = prefetch
        src = pipeline.source
        self.rank, self.world_size = resolve_topology(rank, world_size)
        self.lanes = owned_lanes(src.num_lanes, self.rank, self.world_size, lanes)
        default_workers = max(1, min(4, os.cpu_count() or 1))
        if runner == "lanes":
            if num_workers is None:
                num_workers = min(default_workers, len(self.lanes))
            # Workers beyond the rank's lanes would own none: they are not started.
            self._shares = lane_shares(self.lanes, num_workers, stacklevel=4)
        self.num_workers = default_workers if num_workers is None else num_workers
        self._closed = False
        self._pool: Pool | None = None
        self._ray_pool: Pool | None = None

        # The epoch asked for (None: 0 until a loaded state says otherwise).
        self._epoch_asked = None if epoch is None else check_epoch(epoch)
        self._prepare(self._epoch_asked or 0)
        self.flush_every = pipeline.flush_every()
        self._fingerprint = pipeline.fingerprint()
        self._stage_names = pipeline.stage_names()
        self._fingerprint_parts: dict[str, str] | None = None  # made at the first state
        # Held by __next__ while it hands an item over and updates the accounting, and by
        # state_dict()/stats() while they read it: a checkpoint thread then sees the
        # position after some item the caller received, never one half-way through an
        # update. Reentrant: the end of the pass checks conservation through stats().
        self._lock = threading.RLock()
        # Fairness: a thread that wants a state sets _waiting while it holds the
        # turnstile, and __next__ passes the turnstile before it takes the lock, so
        # the snapshot waits for at most the item in progress (a lock released and
        # taken again at once by the iterating thread would otherwise starve it).
        self._turnstile = threading.Lock()
        self._waiting = False
        self._warned_unresumable = False
        self._datasets = list(src.datasets)
        self._started = False
        self._loaded: Mapping[str, Any] = {"lanes": {}}
        # A state was loaded and nothing has been handed out since: the loaded state,
        # narrowed to our lanes, is the position (see state_dict).
        self._at_loaded = False
        self._build()
        log_start(self)

    def _prepare(self, epoch: int) -> None:
        """The epoch's schedule, compiled stages, contexts and pools (closing older pools)."""
        for pool in (self._ray_pool, self._pool):
            if pool is not None:
                pool.close()
        self._pool = self._ray_pool = None
        self.epoch = epoch
        run = epoch_pipeline(self.pipeline, epoch)  # the seeds of this epoch
        self._epoch_run = run  # what lane workers run
        src = run.source
        self.schedule = make_schedule(src)
        if self.schedule.length_warning:  # a "repeat" mixture far longer than its data
            warnings.warn(self.schedule.length_warning, RuntimeWarning, stacklevel=4)
        self._compiled = run.compile(self._microbatch_sizes)
        self.stage_names = [c.name for c in self._compiled]
        # Stages placed on Ray: their own pool; the local pool gets a stand-in for each.
        self._remote = remote_stages(self._compiled)
        if self.runner == "lanes":
            if self._remote:
                raise ValueError(
                    f"runner='lanes' runs every stage in the lane workers, but stage(s) "
                    f"{[self.stage_names[i] for i in self._remote]} are placed on Ray "
                    "(placement='remote'); use runner='threads' or 'process' for them"
                )
            self._ctxs: list[Any] = []  # the workers make their own
            return
        self._ctxs = stage_contexts(src, self.schedule, self._compiled, lanes=self.lanes,
                                    rank=self.rank, world_size=self.world_size,
                                    runner=self.runner)
        self._pool, self._ray_pool = make_pools(
            self._compiled, self._ctxs, self._remote, runner=self.runner,
            num_workers=self.num_workers, task_timeout=self.task_timeout)

    def _build(self, state: Mapping[str, Any] | None = None) -> None:
        """(Re)create the run: the books, accumulators, source and engine (``state``: a
        checked state to resume)."""
        self.accounting = Accounting(self.lanes, self.flush_every, self._datasets,
                                     verify=self.verify)
        self._pace = Throughput(self.accounting, logs.THROUGHPUT_INTERVAL)
        # Bytes read from storage since this run started: on this thread (source and
        # local stages, counted around each pump) and by the pools' own workers.
        self._driver_bytes = 0
        self._pool_bytes_base = self._pool_bytes_now()
        self._reported = False
        # Per lane, what waits for the caller: _Run entries (plain records or block
        # batches, handed out through an interleave) and single items.
        self._queues: dict[int, deque[Any]] = {lane: deque() for lane in self.lanes}
        # The interleave being handed out (see _interleave) and its iterator.
        self._plan: _Interleave | None = None
        self._fast: Iterator[Any] = iter(())
        self._rr = 0
        self._ended: set[int] = set()
        src = self.pipeline.source
        targets: dict[int, tuple[tuple, int, int]] = {}
        plan = None
        if state is not None:
            plan = resume.plan_resume(
                state, lanes=self.lanes, num_lanes=src.num_lanes,
                accounting=self.accounting, replay_targets=targets)
            self._pace = Throughput(self.accounting, logs.THROUGHPUT_INTERVAL)  # from here
            self._rr = plan.round_robin
        if self.runner == "lanes":
            self._build_lanes(state, plan, targets)
            return
        run = make_run(
            src, self.schedule, self._compiled, self._ctxs, lanes=self.lanes,
            flush_every=self.flush_every, plan=plan, replay_targets=targets,
            on_chunk=self._on_chunk, on_drop=self._on_replay_drop, remote=self._remote,
            pool=self._pool, ray_pool=self._ray_pool, runner=self.runner,
            deterministic=self.deterministic, num_workers=self.num_workers)
        self.stages = run.stages
        self.emitter: Any = run.emitter
        self.engine: Any = run.engine
        replay_acc = run.replay_filter.acc
        self._replaying = replay_acc.pending_lanes  # type: ignore[attr-defined]

    def _build_lanes(self, state: Mapping[str, Any] | None, plan: resume.ResumePlan | None,
                     targets: dict[int, tuple[tuple, int, int]]) -> None:
        """The run of ``runner="lanes"``: lane workers instead of stages and an emitter."""
        previous = getattr(self, "engine", None)
        if previous is not None:  # a load after start(): those workers ran the old position
            previous.close()
        view = resume.ScheduleView(self.schedule, None if plan is None else plan.start,
                                   () if plan is None else plan.replay,
                                   ended=plan is not None and plan.start is None)

        def on_chunk(chunk: Chunk) -> None:
            view.registered(chunk)
            self._on_chunk(chunk)

        jobs = [LaneJob(pipeline=self._epoch_run, lanes=tuple(share), rank=self.rank,
                        world_size=self.world_size, microbatch_sizes=self._microbatch_sizes,
                        deterministic=self.deterministic, state=state, finish=self._finish)
                for share in self._shares]
        run = LaneRun(jobs, on_chunk=on_chunk, on_drop=self._on_replay_drop,
                      replaying=set(targets), stage_names=self.stage_names,
                      **({} if self._prefetch is None else {"prefetch": self._prefetch}))
        self.stages = []
        self.emitter = view
        self.engine = run
        self._replaying = run.pending_lanes

    def start(self) -> None:
        """Start the run's worker processes now rather than at the first ``next()``.

        Only ``runner="lanes"`` has processes of its own per run; for the others
        this does nothing. ``zephon_torch.DataLoader`` calls it on the thread that
        iterates, so that the workers are forked from there.
        """
        if self.runner == "lanes" and not self._closed:
            self.engine.start()

    def worker_pids(self) -> list[int]:
        """The pids of this run's lane workers (``runner="lanes"``; tests and diagnostics)."""
        return self.engine.pids() if self.runner == "lanes" else []

    @property
    def progress(self) -> Accounting:
        """The run's books (per-lane progress under ``lanes``); see ``accounting.py``."""
        return self.accounting

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the iteration still: wait for the item in progress, keep the next one out."""
        with self._turnstile:
            self._waiting = True
            try:
                with self._lock:
                    yield
            finally:
                self._waiting = False

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> PipelineIterator:
        return self

    def __next__(self) -> SampleRecord | SampleBatch:
        # The fast path: the next item of the interleave prepared by _interleave,
        # taken without a lock (one step of a list iterator, atomic under the GIL);
        # the books count what was taken from how many items the iterator has left.
        for item in self._fast:
            return item
        return self._next_slow()

    def _next_slow(self) -> SampleRecord | SampleBatch:
        if self._waiting:  # another thread waits for a state: let it in first
            with self._turnstile:
                pass
        with self._lock:  # uncontended unless another thread takes a state
            self._settle_fast()  # the interleave is spent: count the rest of it
            lanes = self.lanes
            lane = lanes[self._rr]
            queue = self._queues[lane]
            if queue:
                return self._serve(lane, queue)
            if self._closed:
                raise StopIteration
            self._started = True
            queues = self._queues
            while True:
                if len(self._ended) == len(lanes):
                    self._at_loaded = False  # the position is the end now
                    self.close()  # release the workers now, not at garbage collection
                    if self.verify:
                        from zephon_torch.checks import assert_conserved

                        assert_conserved(self)
                    if logs.logger.isEnabledFor(logging.INFO):
                        log_end(self, self.stats())
                    raise StopIteration
                lane = lanes[self._rr]
                queue = queues[lane]
                if queue:
                    return self._serve(lane, queue)
                if lane in self._ended:
                    self._rr = (self._rr + 1) % len(lanes)
                    continue
                if not self._pump(lane):
                    # The engine has ended: every lane, or under runner="lanes" the
                    # lanes of the worker that owns this one.
                    ending = self.engine.lanes_of(lane) if self.runner == "lanes" else lanes
                    for other in ending:
                        if not queues[other] and other not in self._ended:
                            self._ended.add(other)
                            self.accounting.lane_ended(other)

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

    def _pump(self, lane: int | None = None) -> bool:
        """Advance the engine until some output is ready (under ``runner="lanes"``: the
        next message of ``lane``'s worker); False once it has ended."""
        before = thread_bytes_read()
        began = time.monotonic()
        try:
            alive = self.engine.pump(lane) if self.runner == "lanes" else self.engine.pump()
        except BaseException:
            self.close()
            raise
        finally:
            self._driver_bytes += thread_bytes_read() - before
        ended = time.monotonic()
        pace = self._pace
        pace.pumped(began, ended)
        if pace.due(ended) and logs.logger.isEnabledFor(logging.INFO):
            self._settle_all()
            log_throughput(self, pace.recent(ended))
        outputs = self.engine.outputs
        while outputs:
            items = outputs.popleft()
            kind = type(items)
            if kind is Block:
                self._route_block(items)
                continue
            if kind is Sentinel:
                self._route_sentinel(items.lane, items.boundary)
                continue
            first = items[0]
            if type(first) is SampleRecord:
                lane = first.meta.lane_id
                if all(type(e) is SampleRecord and not e.meta.tags and e.meta.lane_id == lane
                       for e in items):  # plain records of one lane: move them at once
                    self._queue_records(lane, items)
                    continue
            for elem in items:
                self._route(elem)
        return alive

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

    def _on_chunk(self, chunk: Chunk) -> None:
        self.accounting.register(chunk)

    def _on_replay_drop(self, dropped: SampleRecord | Block) -> None:
        self.accounting.replay_dropped(dropped)

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpointable(self) -> bool:
        """Whether :meth:`state_dict` can describe an exact position (``deterministic=True``)."""
        return bool(self.deterministic)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last item handed to the caller, as JSON-able builtins.

        Per lane: the replay cursor, the inflight window (schedule states of its
        chunks), the epoch boundaries among them, the next chunk's schedule
        state; plus the round-robin position, the format version, the mode
        (``deterministic``), the configuration fingerprint and a checksum. See
        ``checkpoint.py``.

        It may be called from another thread while one iterates (a checkpoint
        callback): a ``next()`` in progress finishes first, and the state is
        the position after the item it returned.

        Raises:
            NotCheckpointableError: The iterator was made with
                ``deterministic=False``, whose positions cannot be replayed.
        """
        if not self.checkpointable:
            raise refuse_nondeterministic("state_dict()")
        with self._exclusive():
            if self._at_loaded:  # nothing handed out since the load: that is the position
                return resume.narrow_state(self._loaded, self.lanes)
            self._settle_all()
            lanes = resume.lane_entries(
                self.accounting, self.lanes, self._loaded, self._replaying(), self.emitter,
                self.pipeline.source.num_lanes)
            round_robin = {"lanes": list(self.lanes), "index": self._rr}
        return resume.make_state(deterministic=True, parts=self._parts(),
                                 num_lanes=self.pipeline.source.num_lanes, lanes=lanes,
                                 round_robin=round_robin, epoch=self.epoch)

    def state_for_snapshot(self) -> dict[str, Any]:
        """:meth:`state_dict`, or under ``deterministic=False`` a state that refuses to load.

        For callers that must record a state with every item whatever the
        mode (torchdata's ``Prefetcher`` and ``StatefulDataLoader`` workers
        snapshot their source after each one), so that iterating goes on.
        Under ``deterministic=False`` the state records the mode and no
        position; loading or merging it raises a ``ValueError`` saying that
        such a run cannot be resumed, and the first call warns, so that a run
        saving such states learns it at once.
        """
        if self.checkpointable:
            return self.state_dict()
        if not self._warned_unresumable:
            self._warned_unresumable = True
            warnings.warn(
                "zephon_torch: this pipeline iterates with deterministic=False, whose positions "
                "cannot be replayed exactly; the states saved from it record only the mode, "
                "and loading one raises an error. Use deterministic=True to save checkpoints "
                "that resume",
                RuntimeWarning, stacklevel=2,
            )
        return resume.make_state(deterministic=False, parts=self._parts(),
                                 num_lanes=self.pipeline.source.num_lanes, lanes={},
                                 round_robin=None, epoch=self.epoch)

    def _parts(self) -> dict[str, str]:
        """The fingerprint's parts, as states carry them (a fresh copy each time)."""
        if self._fingerprint_parts is None:
            self._fingerprint_parts = fingerprint_parts(self._fingerprint, self._stage_names)
        return dict(self._fingerprint_parts)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where the state's iterator(s) stopped (before iterating).

        ``state`` may be one rank's state or a :func:`merge_states` global one;
        this iterator takes its own lanes from it, whatever the world size.
        The state's epoch becomes this iterator's (an iterator made with an
        explicit ``epoch=`` of another epoch refuses it).
        """
        with self._lock:  # not while another thread takes a state
            if self._started:
                raise RuntimeError(
                    "load_state_dict() must be called before iterating; create a new iterator "
                    "with pipe.iter(...) and load the state into it"
                )
            state = resume.checked_state(
                state, fingerprint=self._fingerprint, stage_names=self._stage_names,
                deterministic=self.deterministic, num_lanes=self.pipeline.source.num_lanes,
                lanes=self.lanes)
            epoch, previous = check_state_epoch(state, self._epoch_asked), self.epoch
            resume.check_resumable(state, self.pipeline, epoch=epoch, lanes=self.lanes,
                                   schedule=self.schedule if epoch == previous else None)
            if epoch != previous:  # the state's epoch: its seeds, its pools
                self._prepare(epoch)
            try:
                self._build(state)
            except Exception as exc:
                # Never half-loaded: whatever went wrong, the iterator starts afresh.
                if self.epoch != previous:
                    self._prepare(previous)
                self._build()
                raise ValueError(
                    f"corrupted state: it passed its checks but cannot be resumed "
                    f"({type(exc).__name__}: {exc}); nothing was loaded, this iterator starts "
                    "from the beginning; resume from another checkpoint"
                ) from exc
            self._loaded = state
            self._at_loaded = True
            log_resume(self, sum(len(state["lanes"][str(lane)]["window"])
                                 for lane in self.lanes))

    @property
    def started(self) -> bool:
        """Whether iteration has begun (a state can no longer be loaded)."""
        return self._started

    # ------------------------------------------------------------------ reporting

    def stats(self) -> dict[str, Any]:
        """What this iterator has read and what became of it.

        ``lanes`` maps each lane to ``read`` (samples of the chunks emitted),
        ``delivered`` (samples closed by what the caller received),
        ``tombstoned`` (``{reason: count}``), ``replayed`` (samples re-read
        from the replayed window after a resume), ``replay_dropped`` (of
        those, the ones the caller had received before the checkpoint,
        dropped again) and ``sample_bytes`` (the storage the samples read
        occupy, see ``Dataset.sample_bytes``: a whole pass adds up to about
        the files' sizes, however often they were read). At the end of a pass,
        per lane, ``read == delivered + sum(tombstoned) + replay_dropped``
        (:func:`zephon_torch.checks.assert_conserved` checks it). The top
        level holds the totals, ``bytes_read`` (what the readers really read
        from storage for this iterator, in all its processes: each decoded
        Parquet row group's compressed columns, per decode; the byte ranges
        read from JSONL files; text files' sizes; so ``bytes_read /
        sample_bytes`` is the read amplification; ``None`` when a stage runs
        on Ray, whose workers are not counted; with ``runner="process"``, a
        worker that dies takes the count of the micro-batch it was running
        with it), ``bad_samples`` (the first few samples skipped by
        ``on_error="skip"``: reason, location, detail), and per stage the
        micro-batches dispatched and sentinels seen or stalled. Counts start
        again at :meth:`load_state_dict`.
        """
        with self._exclusive():  # a consistent report while another thread iterates
            self._settle_all()
            replayed = self.emitter.replayed_by_lane
            report = self.accounting.report(replayed)
            report["bytes_read"] = self._bytes_read()
            report["bad_samples"] = self.accounting.bad_samples()
            report["stages"] = (self.engine.counters() if self.runner == "lanes" else
                                {stage.name: dict(stage.counters) for stage in self.stages})
            report["replayed_samples"] = self.emitter.replayed
            report["replayed_by_lane"] = dict(replayed)
            report["throughput"] = self._pace.report()
            report.update(self._describe())
        return report

    def _describe(self) -> dict[str, Any]:
        """What this iterator runs, for ``stats()``: epoch, runner, topology."""
        return {
            "epoch": self.epoch,
            "runner": self.runner,
            "num_workers": self.num_workers,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_lanes": self.pipeline.source.num_lanes,
            "owned_lanes": list(self.lanes),
            "outputs": sum(book.outputs for book in self.accounting.lanes.values()),
            "finished": len(self._ended) == len(self.lanes),
        }

    def _pool_bytes_now(self) -> list[int | None]:
        return [pool.bytes_read() if pool is not None else 0
                for pool in (self._pool, self._ray_pool)]

    def _bytes_read(self) -> int | None:
        """Bytes read from storage since the run started (None: not knowable here)."""
        if self._remote:  # Ray workers read where nothing counts them
            return None
        if self.runner == "lanes":  # every read happens in the workers; they count it
            return self.engine.bytes_read
        total = self._driver_bytes
        for now, then in zip(self._pool_bytes_now(), self._pool_bytes_base):
            if now is None or then is None:
                return None
            total += now - then
        return total

    def _report_skips(self) -> None:
        """One warning for the samples ``on_error="skip"`` turned into tombstones."""
        books = self.accounting
        if self._reported or not books.bad_total:
            return
        self._reported = True
        counts = ", ".join(f"{reason}: {n}" for reason, n in sorted(books.bad_counts.items()))
        first = "; ".join(
            f"{d['where']} ({d['reason']}{': ' + d['detail'] if d['detail'] else ''})"
            for d in books.bad_samples(_WARN_EXAMPLES)
        )
        message = (
            f"zephon_torch: on_error='skip' turned {books.bad_total} bad sample(s) of "
            f"lanes {self.lanes} into tombstones ({counts}); first: {first}. They are counted "
            "in stats()['lanes'][lane]['tombstoned']; fix the data or use on_error='raise' to "
            "stop at the first one"
        )
        log_skips(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Stop the engine and release every worker; idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # a report must never block the release
            self._report_skips()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        try:
            if self._ray_pool is not None:
                self._ray_pool.close()
        finally:
            if self._pool is not None:
                self._pool.close()

    def __enter__(self) -> PipelineIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown, nothing to do
            self.close()

