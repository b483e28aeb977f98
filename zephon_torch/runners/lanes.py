"""Lane workers: ``runner="lanes"``, each worker process runs the whole pipeline of some lanes.

Every accumulator of a pipeline is per lane (packing bins, shuffle buffers,
partial batches), so lanes are independent until the consumer's round-robin.
Worker ``w`` of ``N`` takes the rank's lanes at positions ``w, w + N, ...``
(``topology.deal_lanes``) and runs, for those lanes only, what the inline
runner runs for all of them: the source emitter and every stage, in one
engine on its own thread. The main process keeps everything else exactly as
for the inline runner: the consumer loop and its round-robin, and the one
set of books (``accounting.py``)::

    worker w (lanes w, w+N, ...)                  main process (iterator.py)
    ────────────────────────────                  ──────────────────────────
    emitter ─► stages ─► engine.pump()
      chunks emitted, replays dropped,
      output units (blocks, batches,
      tombstones, sentinels), in order
      one pickle, buffers into a segment ─ data ─► read it, unlink it
                                                   chunks  -> books.register
                                                   drops   -> books.replay_dropped
                                                   units   -> per-lane queues (the
                                                              inline routing)
                                       ◄─ control ─ a credit per message taken
                                                   round-robin over the rank's lanes

What a worker ships is, per lane and in order, the stream the inline
iterator's ``_pump`` takes from its own engine: the same events, in the same
order, grouped by the worker's ``engine.pump()`` calls. So the books, the
state after every delivered item (``state_dict()``) and ``stats()`` are the
inline iterator's code, and the output is the same bytes for any number of
workers. Items a worker produced ahead (in transit, or queued in the main
process) are no more part of a state than the items an inline engine holds
in flight: a state is the position after the last item handed to the caller.

**Transport.** A message is pickled in one call with its array buffers out of
band into one shared-memory segment (``shm.py``; ``wire.py``'s unit format),
and only the small ref crosses the pipe; the main process copies it once and
unlinks it. Flow control is by credits: a worker produces a message only
while it holds one; it gets ``prefetch`` at the start and one back for each
message the main process takes, so at most ``prefetch`` of its messages wait
in transit. The main process reads from the worker that owns the lane the
round-robin needs, so the first item is handed out as soon as that lane has
one, while the other workers run ahead up to their credits.

**Finishing in the worker.** ``finish`` (``zephon_torch.DataLoader`` passes
``to_training``) turns each batch into what the caller receives, in the
worker. The batch then travels without its payloads, as :class:`Finished`,
so that the books count it as the batch it is and the caller takes
``payload``.

**Start-up.** Where the platform's own default is ``fork`` (Linux) and this
process is not a daemon, workers are forked, as torch's ``DataLoader`` does
there: a forked worker has the pipeline, its functions and every module the
parent imported without pickling or importing anything, and a script needs no
``if __name__ == "__main__":``. Elsewhere (macOS, Windows), or with
``ZEPHON_LANES_START_METHOD=spawn`` (or ``forkserver``), workers are spawned:
all are started at once, then each receives the pipeline by cloudpickle and
imports only what unpickling it needs (no torch unless ``finish`` or an
operator needs it); the script is re-imported and needs the guard, which the
error for a worker that dies at start names. A forked worker inherits the
parent's threads' locks but not the threads: like torch, it limits torch's
intra-op threads to one if torch was imported, and the tokenizers library
turns its own parallelism off in a forked child that inherited a used pool.

**Faults and shutdown.** A worker that raises sends the exception back; the
consumer re-raises it with its type and message and the worker's traceback
as ``__cause__``. A worker that dies is named in a ``RuntimeError`` (its
lanes, pid and exit status) once the messages it sent before are used up.
:meth:`LaneRun.close` (idempotent, from any thread; also at garbage
collection and interpreter exit) asks each worker to stop, terminates then
kills the ones that do not, joins them all and unlinks every segment of the
run. Workers ignore ``SIGINT`` (Ctrl-C reaches the whole process group and
the main process decides) and exit when the main process goes away;
``SIGTERM`` to the main process tears the workers down as for the process
runner's pool. Starting, the credit loop and the stop path are ``workers.py``'s,
shared with the pool and the loader's engine process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import signal
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from zephon_torch.accounting import Accounting
from zephon_torch.block import Block
from zephon_torch.block_views import BlockBatch
from zephon_torch.runners import resume, shm, wire
from zephon_torch.runners.assembly import (
    INLINE_POOL,
    make_pools,
    make_run,
    make_schedule,
    stage_contexts,
)
from zephon_torch.runners.workers import (
    CreditChild,
    Ship,
    child_signals,
    describe_exit,
    kill_now,
    receive_job,
    serve_credits,
    start_child,
    start_method,
    stop_children,
    unwatch_sigterm,
    watch_sigterm,
)
from zephon_torch.sources.base import thread_bytes_read
from zephon_torch.types import SampleBatch

__all__ = ["Finished", "LaneJob", "LaneRun", "start_method"]

#: Messages a worker may have in transit by default (see the module doc).
DEFAULT_PREFETCH = 4
# Messages up to this size travel inside the ref, through the pipe. Credits bound what
# waits in a pipe, and this keeps it under a pipe's buffer (64 KiB on Linux).
_INLINE_LIMIT = 8 * 1024
_POLL = 0.2  # seconds between checks while waiting for a worker or a credit
_STOP_TIMEOUT = 2.0  # seconds a worker gets to stop by itself, then after SIGTERM


class Finished(NamedTuple):
    """A batch finished in its lane worker (``finish``), as the consumer receives it.

    Attributes:
        batch: The batch without its payloads (what the books count).
        payload: What ``finish`` made of it (``to_training``'s dict).
    """

    batch: SampleBatch
    payload: Any

    @property
    def lane_ids(self) -> tuple[int, ...]:
        """The batch's lanes (how the consumer routes it)."""
        return self.batch.lane_ids


@dataclass(frozen=True, kw_only=True)
class LaneJob:
    """What one lane worker runs.

    Attributes:
        pipeline: The pipeline.
        lanes: The worker's lanes.
        rank, world_size: The topology (operators see it in their context).
        microbatch_sizes: Performance overrides, as for ``Pipeline.iter``.
        deterministic: As for ``Pipeline.iter``.
        state: A checked state to resume from (the worker takes its lanes), or None.
        finish: Called in the worker on each batch; None: batches travel whole.
    """

    pipeline: Any
    lanes: tuple[int, ...]
    rank: int
    world_size: int
    microbatch_sizes: Mapping[str, int] | None
    deterministic: bool
    state: Mapping[str, Any] | None
    finish: Callable[[SampleBatch], Any] | None


# --------------------------------------------------------------------------- worker side


class _WorkerRun:
    """The engine of a worker's lanes, and what happened in it since the last message."""

    def __init__(self, job: LaneJob) -> None:
        pipeline = job.pipeline
        source = pipeline.source
        lanes = list(job.lanes)
        schedule = make_schedule(source)
        compiled = pipeline.compile(job.microbatch_sizes)
        ctxs = stage_contexts(source, schedule, compiled, lanes=lanes, rank=job.rank,
                              world_size=job.world_size, pool_spec=INLINE_POOL)
        self.pool, _ = make_pools(compiled, ctxs, [], pool_spec=INLINE_POOL, num_workers=1,
                                  task_timeout=None)
        flush_every = pipeline.flush_every()
        targets: dict[int, tuple[tuple, int, int]] = {}
        plan = None
        if job.state is not None:
            # These books only place the replay; the main process keeps the real ones.
            plan = resume.plan_resume(job.state, lanes=lanes, plan=schedule.lanes,
                                      accounting=Accounting(lanes, flush_every),
                                      replay_targets=targets)
        self.events: list[tuple[str, Any]] = []
        run = make_run(source, schedule, compiled, ctxs, lanes=lanes, flush_every=flush_every,
                       plan=plan, replay_targets=targets,
                       on_chunk=lambda chunk: self.events.append(("chunk", chunk)),
                       on_drop=self._dropped,
                       remote=[], pool=self.pool, ray_pool=None, pool_spec=INLINE_POOL,
                       deterministic=job.deterministic, num_workers=1)
        self.engine = run.engine
        self.stages = run.stages
        self.replay = run.replay_filter
        self.finish = job.finish

    def _dropped(self, unit: Any) -> None:
        """Replayed rows the replay filter dropped: the books need their metadata only."""
        if type(unit) is Block:
            unit = unit.with_payloads([None] * len(unit))
        self.events.append(("drop", unit))

    def step(self) -> tuple[bool, tuple | None]:
        """One ``engine.pump()``: whether more may come, and the message (None: nothing)."""
        before = thread_bytes_read()
        alive = self.engine.pump()
        read = thread_bytes_read() - before
        outputs = list(self.engine.outputs)
        self.engine.outputs.clear()
        if self.finish is not None:
            outputs = [_finished(unit, self.finish) for unit in outputs]
        events, self.events = self.events, []
        if not outputs and not events and not read:
            return alive, None
        counters = {stage.name: dict(stage.counters) for stage in self.stages}
        pending = sorted(self.replay.acc.pending_lanes())
        return alive, (events, outputs, pending, counters, read)

    def ship(self) -> tuple[Ship | None, tuple | None]:
        """One :meth:`step` for the credit loop: its message, and the end once it came."""
        alive, message = self.step()
        return (None if message is None else Ship("units", message)), (None if alive
                                                                        else ("end",))

    def close(self) -> None:
        self.engine.close()
        self.pool.close()


def _finished(unit: Any, finish: Callable[[SampleBatch], Any]) -> Any:
    """A list's batches finished (``finish``), each travelling without its payloads."""
    if type(unit) is not list:
        return unit  # blocks of records, tombstones, sentinels
    out = []
    for elem in unit:
        if isinstance(elem, SampleBatch):
            payload = finish(elem)
            if type(elem) is BlockBatch:  # the books need its metadata only
                block = elem.block
                elem = BlockBatch(block.with_payloads([None] * len(block)))
            elem = Finished(elem, payload)
        out.append(elem)
    return out


def _worker_main(slot: int, job: LaneJob | None, control: Any, data: Any, directory: str,
                 prefix: str, credits: int, inherited: Sequence[Any]) -> None:
    """A lane worker: build the lanes' engine, then send a message per pump while credits last."""
    # A forked worker inherits the parent's handlers (a pool's SIGTERM clean-up, a
    # trainer's): a SIGTERM to a worker just ends it; the main process reports that.
    child_signals(signal.SIG_DFL)
    for conn in inherited:  # a forked child holds the parent's ends of every pipe so far
        with contextlib.suppress(OSError):
            conn.close()
    torch = sys.modules.get("torch")
    if torch is not None:  # forked from a process that imported it (as torch's workers do)
        with contextlib.suppress(Exception):
            torch.set_num_threads(1)
    parent = os.getppid()
    pid = os.getpid()
    own = f"{prefix}-{pid}"
    writer = shm.Writer(directory, own, _INLINE_LIMIT)
    run: _WorkerRun | None = None
    orphaned = False
    try:
        if job is None:  # spawned: the job comes first, by cloudpickle
            job = receive_job(control, parent)
            if job is None:
                return
        run = _WorkerRun(job)
        serve_credits(run.ship, control, data, writer, parent, credits)
    except wire.Orphaned:
        orphaned = True
    except BaseException as exc:
        header = (f"Traceback of zephon lane worker {slot} (pid {pid}, lanes "
                  f"{list(job.lanes) if job is not None else '?'}):")
        with contextlib.suppress(OSError):
            data.send_bytes(wire.error_message("error", -1, exc, header))
    finally:
        if run is not None:
            with contextlib.suppress(Exception):
                run.close()
        if orphaned:  # nobody will read what we sent
            shm.sweep_prefix(directory, f"{own}-")


# --------------------------------------------------------------------------- main side


class _Worker(CreditChild):
    """A lane worker process, its pipes and the main process's view of its progress."""

    def __init__(self, slot: int, lanes: list[int], process: Any, control: Any,
                 data: Any, pending: set[int]) -> None:
        super().__init__(process, control, data)
        self.slot = slot
        self.lanes = lanes
        self.done = False  # its "end" has been received
        self.pending = pending  # its lanes still replaying, as of its last message
        self.counters: dict[str, dict[str, int]] = {}

    def describe(self) -> str:
        return f"lane worker {self.slot} (pid {self.process.pid}, lanes {self.lanes})"


class LaneRun:
    """The lane workers of one run, driven from the main process (see the module doc).

    It takes the place of the inline runner's engine in ``PipelineIterator``:
    :meth:`pump` fills :attr:`outputs` with output units and reports chunks
    and replay drops through the callbacks, in the order the worker owning
    ``lane`` produced them.

    Args:
        jobs: One job per worker (each with its lanes).
        on_chunk: The books' chunk registration.
        on_drop: The books' replay drop.
        replaying: The lanes that start out replaying (the replay targets).
        stage_names: The compiled stages' names (for :meth:`counters`).
        prefetch: Messages a worker may have in transit.
    """

    def __init__(self, jobs: Sequence[LaneJob], *, on_chunk: Callable[[Any], None],
                 on_drop: Callable[[Any], None], replaying: set[int],
                 stage_names: Sequence[str], prefetch: int = DEFAULT_PREFETCH) -> None:
        self.jobs = list(jobs)
        self.on_chunk = on_chunk
        self.on_drop = on_drop
        self.prefetch = max(1, int(prefetch))
        self.stage_names = list(stage_names)
        self._replaying = set(replaying)
        self.outputs: deque[Any] = deque()
        self.bytes_read = 0
        self.workers: list[_Worker] = []
        self._owner: dict[int, int] = {lane: w for w, job in enumerate(self.jobs)
                                       for lane in job.lanes}
        self._directory = shm.segment_dir()
        self._prefix = shm.new_prefix()
        self._lock = threading.Lock()
        self._started = False
        self._closing = False
        self.waiting_on: _Worker | None = None  # the worker a pump waits for (timeouts)
        # What tears the workers down: kept apart from this object (which refers to
        # the iterator's books) so that the SIGTERM registry holds it without keeping
        # the run alive, and a run dropped unclosed is reaped at garbage collection.
        self._teardown = _Teardown(self.workers, self._directory, self._prefix)
        self._finalizer = weakref.finalize(self, self._teardown.shutdown)

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Start every worker (concurrently: all processes first, then their jobs)."""
        with self._lock:
            if self._started or self._closing:
                return
            self._started = True
            method = start_method()
            forked = method == "fork"
            shm.sweep_stale(self._directory)
            ours: list[Any] = []  # our ends so far: a forked child must close them
            try:
                for slot, job in enumerate(self.jobs):
                    process, control_w, data_r = start_child(
                        method, _worker_main, name=f"zephon-lanes-{slot}", daemon=True,
                        args=functools.partial(self._worker_args, slot,
                                               job if forked else None, ours if forked else None),
                    )
                    ours += [control_w, data_r]
                    self.workers.append(_Worker(
                        slot, list(job.lanes), process, control_w, data_r,
                        {lane for lane in job.lanes if lane in self._replaying}))
                if not forked:
                    self._send_jobs()
            except BaseException:
                self._closing = True
                self._finalizer()
                raise
            watch_sigterm(self._teardown)

    def _worker_args(self, slot: int, job: LaneJob | None, ours: list[Any] | None,
                     control_r: Any, data_w: Any, control_w: Any, data_r: Any) -> tuple:
        """``_worker_main``'s arguments; a forked worker gets its job, and every end of
        ours so far to close (``ours``)."""
        inherited = [] if ours is None else [*ours, control_w, data_r]
        return (slot, job, control_r, data_w, self._directory, self._prefix, self.prefetch,
                inherited)

    def _send_jobs(self) -> None:
        import cloudpickle  # user functions in the pipeline travel by value

        for worker, job in zip(self.workers, self.jobs):
            try:
                blob = cloudpickle.dumps(job, protocol=wire.PROTOCOL)
            except Exception as exc:
                raise TypeError(
                    f"runner='lanes' sends the pipeline to spawned worker processes with "
                    f"cloudpickle, and pickling it failed: {exc}. Keep open files, locks and "
                    "clients out of operators' attributes (create them in setup())"
                ) from exc
            worker.send(blob)  # a worker that died is reported by pump()

    # ------------------------------------------------------------------ driving

    def lanes_of(self, lane: int) -> list[int]:
        """The lanes of the worker that owns ``lane`` (they end together)."""
        return list(self.jobs[self._owner[lane]].lanes)

    def pump(self, lane: int) -> bool:
        """Take the next message of ``lane``'s worker; False once that worker has ended.

        Raises:
            Exception: What the pipeline raised in the worker (its type and
                message, the worker's traceback as ``__cause__``).
            RuntimeError: The worker died, or the run was closed meanwhile.
        """
        self.start()
        worker = self.workers[self._owner[lane]]
        if worker.done:
            return False
        message = self._receive(worker)
        kind = message[0]
        if kind == "end":
            worker.done = True
            return False
        if kind != "units":
            raise wire.remote_error(*message[2:])
        ref = message[1]
        try:
            events, outputs, pending, counters, read = worker.take(ref, self._directory)
        except FileNotFoundError:
            raise self._closed_error() if self._closing else RuntimeError(
                f"the shared-memory segment {ref.name} of {worker.describe()} was removed "
                f"before it was read, while the worker runs: something deletes files in "
                f"{self._directory}; stop that, or set ZEPHON_SHM_DIR to a directory of "
                "your own") from None
        on_chunk, on_drop = self.on_chunk, self.on_drop
        for kind, value in events:
            if kind == "chunk":
                on_chunk(value)
            else:
                on_drop(value)
        worker.pending = set(pending)
        worker.counters = counters
        self.bytes_read += read
        self.outputs.extend(outputs)
        return True

    def _receive(self, worker: _Worker) -> tuple:
        """The worker's next message, waiting as long as it lives."""
        conn = worker.data
        process = worker.process
        self.waiting_on = worker
        try:
            while True:
                if self._closing:
                    raise self._closed_error()
                try:
                    if conn.poll(_POLL):
                        return pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    raise self._died(worker) from None
                if not process.is_alive() and not conn.poll(0):
                    raise self._died(worker)
        finally:
            self.waiting_on = None

    def _closed_error(self) -> RuntimeError:
        return RuntimeError("the lane workers were closed while the iterator waited for them")

    def _died(self, worker: _Worker) -> RuntimeError:
        if self._closing:
            return self._closed_error()
        process = worker.process
        process.join(timeout=_STOP_TIMEOUT)
        guard = ""
        if start_method() != "fork":
            guard = (" A training script that starts work at import time needs `if __name__ == "
                     "\"__main__\":` (the workers are spawned and re-import it).")
        return RuntimeError(
            f"zephon {worker.describe()} {describe_exit(process.exitcode)} before the end of "
            f"its lanes' data; see its stderr. A signal may mean the out-of-memory killer."
            f"{guard}"
        )

    # ------------------------------------------------------------------ reporting

    def pending_lanes(self) -> set[int]:
        """The lanes still replaying, as of the last message of each worker."""
        if not self.workers:
            return set(self._replaying)
        return set().union(*(worker.pending for worker in self.workers))

    def counters(self) -> dict[str, dict[str, int]]:
        """Each stage's counters, summed over the workers (as of their last messages)."""
        total: dict[str, dict[str, int]] = {
            name: {"microbatches": 0, "sentinels": 0, "stalled_sentinels": 0, "tombstones": 0}
            for name in self.stage_names}
        for worker in self.workers:
            for name, counts in worker.counters.items():
                into = total.setdefault(name, {})
                for key, value in counts.items():
                    into[key] = into.get(key, 0) + value
        return total

    def pids(self) -> list[int]:
        """The workers' pids (tests and diagnostics)."""
        return [worker.process.pid for worker in self.workers]

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop and join every worker, unlink every segment; idempotent, from any thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._finalizer()


class _Teardown:
    """Stops the workers of a run and sweeps its segments (at close, collection or SIGTERM).

    Registered with the SIGTERM handling of worker processes (``workers.py``) for
    as long as the workers run.
    """

    def __init__(self, workers: list[_Worker], directory: str, prefix: str) -> None:
        self.workers = workers  # the run's list, filled as the workers start
        self.directory = directory
        self.prefix = prefix
        self.pid = os.getpid()

    def shutdown(self) -> None:
        """Stop the workers (politely, then SIGTERM, then SIGKILL), join them, sweep."""
        if os.getpid() != self.pid:  # a forked child collecting its copy: its parent's
            return
        unwatch_sigterm(self)
        workers = self.workers
        stop_children(workers, _STOP_TIMEOUT, _STOP_TIMEOUT)
        for worker in workers:
            with contextlib.suppress(OSError):
                worker.data.close()
        shm.sweep_prefix(self.directory, self.prefix)

    def terminate_now(self) -> None:
        """Kill the workers and unlink the segments, from a SIGTERM handler (``process.py``)."""
        if os.getpid() != self.pid:  # a forked child: these are its parent's
            return
        kill_now([worker.process for worker in self.workers])
        shm.sweep_prefix(self.directory, self.prefix)
