"""The consumer side: the iterator ``Pipeline.iter()`` returns.

It builds everything a run needs (the lanes this rank owns, from
``topology.py``; the compiled stages with their accumulators, the worker
pools and the engine, from ``assembly.py``; the source emitter) and hands out
data in a fixed order: the rank's lanes round-robin in ascending lane order,
a lane that has ended being skipped. Each lane's output depends only on the
lane's input, so that order, and every byte, is the same whatever the runner,
the worker count or the micro-batch sizes.

This module is the consumer loop: it asks its executor (``executor.py``,
the one the runner's description in ``registry.py`` names) for output,
routes what comes out to per-lane queues and hands items over
(``handover.py``), and reports each event once to the run's books
(``accounting.py``). Saving and loading a position
(``state_dict``/``load_state_dict``) go through ``resume.py``; ``stats()``
and the end-of-pass reports live in ``report.py``.

With ``runner="lanes"`` the executor is lane worker processes
(:class:`~zephon_torch.runners.lanes.LaneRun`): each runs the whole pipeline
of its share of the lanes and ships, per lane and in order, what this loop
would have taken from its own engine; everything here stays the same.
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
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from zephon_torch import logs
from zephon_torch.accounting import Accounting
from zephon_torch.block import Block, Sentinel
from zephon_torch.checkpoint import fingerprint_parts, refuse_nondeterministic
from zephon_torch.epochs import check_state_epoch, epoch_pipeline
from zephon_torch.logs import log_end, log_resume, log_start, log_throughput
from zephon_torch.runners import resume
from zephon_torch.runners.assembly import make_schedule, remote_stages
from zephon_torch.runners.base import Pool
from zephon_torch.runners.engine import Stage
from zephon_torch.runners.executor import Executor, make_executor
from zephon_torch.runners.handover import Handover
from zephon_torch.runners.options import ITER_KWARGS, RUNNERS, RunOptions
from zephon_torch.runners.registry import runner_spec
from zephon_torch.runners.report import Report
from zephon_torch.runners.snapshots import SnapshotBook, StateSnapshot
from zephon_torch.sources.base import thread_bytes_read
from zephon_torch.sources.lane_plan import lane_count
from zephon_torch.sources.schedule import Chunk
from zephon_torch.throughput import Throughput
from zephon_torch.topology import owned_lanes, resolve_topology
from zephon_torch.types import SampleBatch, SampleRecord

if TYPE_CHECKING:
    from zephon_torch.pipeline import Pipeline

# ITER_KWARGS and RUNNERS live in options.py, resolve_topology (and owned_lanes) in
# topology.py; they stay importable from here.
__all__ = ["ITER_KWARGS", "RUNNERS", "PipelineIterator", "resolve_topology"]


class PipelineIterator(Handover, Report):
    """Iterates a pipeline's output for one rank (see the module doc).

    Args:
        pipeline: The pipeline.
        options: The run's :class:`~zephon_torch.runners.options.RunOptions`,
            or none and its fields as keywords, checked there:

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

    def __init__(self, pipeline: Pipeline, options: RunOptions | None = None,
                 **kwargs: Any) -> None:
        if options is None:
            options = RunOptions(**kwargs)
        elif kwargs:
            raise TypeError(f"PipelineIterator takes options or keywords, not both: {kwargs}")
        spec = runner_spec(options.runner)
        if spec.starts_processes and multiprocessing.current_process().daemon:
            warnings.warn(
                f"runner={spec.name!r} inside a daemonic process (a torch DataLoader worker) "
                f"cannot start worker processes; falling back to runner={spec.fallback!r}",
                RuntimeWarning, stacklevel=3,
            )
            spec = runner_spec(spec.fallback)
        self.options = options
        self.pipeline = pipeline
        self.runner = spec.name
        self.deterministic = options.deterministic
        self.verify = bool(options.verify)
        self.task_timeout = options.task_timeout
        self._microbatch_sizes = options.microbatch_sizes
        src = pipeline.source
        self.rank, self.world_size = resolve_topology(options.rank, options.world_size)
        self.lanes = owned_lanes(lane_count(src), self.rank, self.world_size, options.lanes)
        self._closed = False
        # Where the work runs: the executor the runner's description names (registry.py).
        self.executor: Executor = make_executor(
            options, spec, lanes=self.lanes, rank=self.rank, world_size=self.world_size,
            default_workers=max(1, min(4, os.cpu_count() or 1)), stacklevel=3)
        self.num_workers = self.executor.num_workers

        # The epoch asked for (None: 0 until a loaded state says otherwise).
        self._epoch_asked = options.epoch
        self._prepare(self._epoch_asked or 0)
        self.flush_every = pipeline.flush_every()
        self._fingerprint = pipeline.fingerprint()
        self._stage_names = pipeline.stage_names()
        self._fingerprint_parts: dict[str, str] | None = None  # made at the first state
        self._snapshots: SnapshotBook | None = None  # made at the first state_snapshot()
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
        """The epoch's schedule, compiled stages and the executor's setup (closing older
        pools)."""
        self.executor.release()
        self.epoch = epoch
        run = epoch_pipeline(self.pipeline, epoch)  # the seeds of this epoch
        self.schedule = make_schedule(run.source)
        if self.schedule.length_warning:  # a "repeat" mixture far longer than its data
            warnings.warn(self.schedule.length_warning, RuntimeWarning, stacklevel=4)
        compiled = run.compile(self._microbatch_sizes)
        self.stage_names = [c.name for c in compiled]
        # Stages placed on Ray: their own pool; the local pool gets a stand-in for each.
        self.executor.prepare(run, self.schedule, compiled, remote_stages(compiled))

    def _build(self, state: Mapping[str, Any] | None = None) -> None:
        """(Re)create the run: the books, accumulators, source and engine (``state``: a
        checked state to resume)."""
        self.accounting = Accounting(self.lanes, self.flush_every, self._datasets,
                                     verify=self.verify)
        self._pace = Throughput(self.accounting, logs.THROUGHPUT_INTERVAL)
        # Bytes read from storage on this thread since the run started (the source and
        # local stages, counted around each pump); the executor adds its workers'.
        self._driver_bytes = 0
        self._reported = False
        # Per lane, what waits for the caller: runs (plain records or block batches,
        # handed out through an interleave) and single items (see handover.py).
        self._queues: dict[int, deque[Any]] = {lane: deque() for lane in self.lanes}
        # The interleave being handed out (see _interleave) and its iterator.
        self._plan = None
        self._fast: Iterator[Any] = iter(())
        self._rr = 0
        self._ended: set[int] = set()
        targets: dict[int, tuple[tuple, int, int]] = {}
        plan = None
        if state is not None:
            plan = resume.plan_resume(
                state, lanes=self.lanes, plan=self.schedule.lanes,
                accounting=self.accounting, replay_targets=targets)
            self._pace = Throughput(self.accounting, logs.THROUGHPUT_INTERVAL)  # from here
            self._rr = plan.round_robin
        self.executor.build(self.pipeline.source, state, plan, targets,
                            flush_every=self.flush_every, on_chunk=self._on_chunk,
                            on_drop=self._on_replay_drop)
        self._replaying = self.executor.pending_lanes

    # What the executor runs, as the iterator's attributes (tools and tests read them).

    @property
    def stages(self) -> list[Stage]:
        """The engine's stages (none where the stages run in lane workers)."""
        return self.executor.stages

    @property
    def emitter(self) -> Any:
        """The source emitter (under ``runner="lanes"``, a view of the schedule)."""
        return self.executor.emitter

    @property
    def engine(self) -> Any:
        """What the executor pumps: the stage engine or the lane workers' run."""
        return self.executor.engine

    @property
    def _pool(self) -> Pool | None:
        return getattr(self.executor, "pool", None)

    @property
    def _ray_pool(self) -> Pool | None:
        return getattr(self.executor, "ray_pool", None)

    def start(self) -> None:
        """Start the run's worker processes now rather than at the first ``next()``.

        Only ``runner="lanes"`` has processes of its own per run; for the others
        this does nothing. ``zephon_torch.DataLoader`` calls it on the thread that
        iterates, so that the workers are forked from there.
        """
        if not self._closed:
            self.executor.start()

    def worker_pids(self) -> list[int]:
        """The pids of this run's lane workers (``runner="lanes"``; tests and diagnostics)."""
        return self.executor.pids()

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
                    # The executor has ended these lanes: every lane, or under
                    # runner="lanes" the lanes of the worker that owns this one.
                    for other in self.executor.lanes_of(lane):
                        if not queues[other] and other not in self._ended:
                            self._ended.add(other)
                            self.accounting.lane_ended(other)


    def _pump(self, lane: int | None = None) -> bool:
        """Advance the engine until some output is ready (under ``runner="lanes"``: the
        next message of ``lane``'s worker); False once it has ended."""
        before = thread_bytes_read()
        began = time.monotonic()
        try:
            alive = self.executor.pump(lane)
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
        outputs = self.executor.outputs
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
                self.schedule.lanes)
            round_robin = {"lanes": list(self.lanes), "index": self._rr}
        return resume.make_state(deterministic=True, parts=self._parts(),
                                 num_lanes=lane_count(self.pipeline.source), lanes=lanes,
                                 round_robin=round_robin, epoch=self.epoch)

    def state_snapshot(self) -> StateSnapshot:
        """:meth:`state_dict` of this moment, taken for the price of the lanes that changed;
        its ``state()`` builds the dict (see ``snapshots.py``; the loader takes one per batch).

        Raises:
            NotCheckpointableError: As :meth:`state_dict`.
        """
        if not self.checkpointable:
            raise refuse_nondeterministic("state_dict()")
        with self._exclusive():
            if self._at_loaded:
                return StateSnapshot.ready(resume.narrow_state(self._loaded, self.lanes))
            self._settle_all()
            if self._snapshots is None:
                self._snapshots = SnapshotBook(self.lanes, lane_count(self.pipeline.source))
            return self._snapshots.take(
                self.accounting, self._loaded, self._replaying(), self.emitter,
                parts=self._parts(), round_robin={"lanes": list(self.lanes), "index": self._rr},
                epoch=self.epoch, plan=self.schedule.lanes)

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
                                 num_lanes=lane_count(self.pipeline.source), lanes={},
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
                state, pipeline=self.pipeline, fingerprint=self._fingerprint,
                stage_names=self._stage_names, deterministic=self.deterministic,
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

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Stop the engine and release every worker; idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # a report must never block the release
            self._report_skips()
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.close()

    def __enter__(self) -> PipelineIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown, nothing to do
            self.close()

