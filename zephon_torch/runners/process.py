"""The process runner's pool: micro-batches in worker processes.

Every worker can run every stage. A micro-batch travels as one *unit*
(a block, or a list of records), its buffers in a shared-memory segment and
only a small ref on the pipes (``wire.py`` has the format, ``shm.py`` the
segments); the worker loop is ``worker.py``. This module is the main side:
the supervisor that owns the workers, and the pool the engine submits to::

    driver thread (engine)        supervisor thread            worker k (spawned)
    ──────────────────────        ─────────────────            ──────────────────
    submit(stage, unit)
      one pickle, buffers -> segment
      task -> least-loaded worker
         outbox ─► feeder thread ── task pipe ───────────────► map the segment (zero-copy)
                                                               run the stage's operator
                                  ◄──────────── result pipe ── ref of a new segment
                                  map it, unlink it
                                  future.set_result(unit)

The main process reads each result segment once into memory of its own and
unlinks it at once (``shm.py`` says why it copies). Segments and ``pwrite``
make this runner POSIX-only (Linux, macOS).

**Start-up.** Workers are started with the ``spawn`` method (``forkserver``
on request), never a bare ``fork`` of a process whose threads (tokenizers,
pyarrow, torch) may hold a lock. Operators and contexts reach them through
cloudpickle (lambdas inside operators work); each worker calls
``op.setup(ctx)`` once for every operator that is not ``inline``. (``spawn``
does re-import the parent's ``__main__`` module, as ``multiprocessing``
always does: keep heavy imports of a training script under
``if __name__ == "__main__":``.)

**Faults.** The supervisor watches every worker's result pipe and process
sentinel. A worker that dies is replaced, and its unfinished micro-batches
go to the live workers again (``process_many`` is stateless). Only the
micro-batch the dead worker was running (the oldest it had been sent: a
worker runs its tasks in order) is charged with the death: it is sent
again at most ``max_restarts`` times, and when it kills a worker once more
its future fails with a ``RuntimeError`` naming the stage, the worker and
its exit code or signal. Workers that keep
dying before they are ready (a crash in ``setup``) break the pool with the
same kind of error. With ``task_timeout``, a worker stuck on one
micro-batch for longer is killed and counts as a death the same way, so a
hang (a deadlock, an endless loop) also ends in a clear error. An
exception raised by an operator reaches the consumer with its own type and
message, the worker's traceback attached as
``__cause__`` (a :class:`WorkerTraceback`); one that cannot be pickled
becomes a ``RuntimeError`` carrying the type name, message and traceback.

**Shutdown.** :meth:`ProcessPool.close` (idempotent; also run by a finalizer
when the pool is garbage-collected and at interpreter exit) fails pending
futures, drops tasks not yet sent, asks workers to stop after the task they
are running, terminates then kills those still running
after ``shutdown_timeout``, joins them all, and unlinks every segment of the
pool, including orphans of workers that died mid-write. Ctrl-C raises
``KeyboardInterrupt`` (workers ignore ``SIGINT``), so the pool closes as the
stack unwinds; ``SIGTERM``, whose default action skips all of that, gets a
handler of its own while a pool is alive (see ``workers.py``, where every
kind of worker process is started and stopped).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import os
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing import connection as mp_connection
from typing import Any

from zephon_torch._main_guard import unguarded_start
from zephon_torch.logs import logger
from zephon_torch.ops.base import OpContext, Operator
from zephon_torch.runners import shm, wire
from zephon_torch.runners.base import Pool
from zephon_torch.runners.wire import WorkerTraceback
from zephon_torch.runners.worker import worker_main
from zephon_torch.runners.workers import (
    SigtermGuard,
    describe_exit,
    kill_now,
    reap,
    start_child,
    unwatch_sigterm,
    watch_sigterm,
)

# WorkerTraceback lives in wire.py, the process lifetime helpers in workers.py; they
# stay importable from here.
__all__ = ["ProcessPool", "SigtermGuard", "WorkerTraceback", "describe_exit", "reap",
           "unwatch_sigterm", "watch_sigterm"]

_START_METHODS = ("spawn", "forkserver")


# --------------------------------------------------------------------------- errors


def _fail(future: cf.Future, exc: BaseException) -> None:
    with contextlib.suppress(cf.InvalidStateError):  # cancelled or already done
        future.set_exception(exc)


# --------------------------------------------------------------------------- main side


class _Task:
    """One submitted micro-batch: its message, its future, the segment it reads."""

    __slots__ = ("deaths", "future", "id", "input", "message", "stage")

    def __init__(self, task_id: int, stage: int, message: bytes, future: cf.Future,
                 input_ref: shm.BlockRef) -> None:
        self.id = task_id
        self.stage = stage
        self.message = message
        self.future = future
        self.input = input_ref  # its segment stays until the task is over (a retry reads it)
        self.deaths = 0


class _Worker:
    """A worker process, its pipes, its feeder thread and the tasks sent to it."""

    __slots__ = ("alive", "busy_since", "feeder", "in_flight", "outbox", "process", "ready",
                 "results", "slot", "tasks", "timed_out")

    def __init__(self, slot: int, process: Any, tasks: Any, results: Any) -> None:
        self.slot = slot
        self.process = process
        self.tasks = tasks  # our sending end of its task pipe
        self.results = results  # our receiving end of its result pipe
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.in_flight: dict[int, _Task] = {}  # in sending order = the order it runs them
        self.ready = False
        self.alive = True
        # When the task it is running (the oldest in flight) started, roughly: when it
        # was sent to an idle ready worker, or when the previous result came back.
        self.busy_since: float | None = None
        self.timed_out = False
        self.feeder = threading.Thread(target=_feed, args=(self.outbox, tasks),
                                       name=f"zephon-feeder-{slot}", daemon=True)


def _feed(outbox: queue.SimpleQueue, conn: Any) -> None:
    # Sends happen here, never on the driver or supervisor thread: a worker busy
    # with a long task stops reading, and a blocked send there could deadlock.
    while True:
        message = outbox.get()
        if message is None:
            return
        try:
            conn.send_bytes(message)
        except OSError:
            return  # the worker is gone; the supervisor re-dispatches its tasks


class _Supervisor:
    """Owns the workers; its thread collects results and replaces dead workers.

    Kept apart from :class:`ProcessPool` so that the pool object itself can be
    garbage-collected (its finalizer then shuts this down) while the threads
    still reference the supervisor.
    """

    def __init__(self, init: bytes, names: list[str], num_workers: int, *, max_restarts: int,
                 directory: str, prefix: str, inline_limit: int, shutdown_timeout: float,
                 start_method: str, task_timeout: float | None = None) -> None:
        self.init = init
        self.names = names
        self.max_restarts = max_restarts
        self.task_timeout = task_timeout
        self.directory = directory
        self.prefix = prefix
        self.inline_limit = inline_limit
        self.shutdown_timeout = shutdown_timeout
        self.start_method = start_method
        self.owner = os.getpid()
        self.lock = threading.RLock()
        self.workers: list[_Worker | None] = [None] * num_workers
        self.broken: BaseException | None = None
        self.stopping = False
        self.startup_deaths = 0
        #: Bytes the workers' readers read, over the results received.
        self.bytes_read = 0
        self._rr = 0
        self._wake_r, self._wake_w = os.pipe()
        # Started by unguarded top-level code of the main script, the workers die on start-up
        # (each re-runs the script): say so if they do. In such a worker, this stops it.
        self.unguarded = unguarded_start()
        try:
            for slot in range(num_workers):
                self.workers[slot] = self._start(slot)
        except BaseException:
            self.shutdown()
            raise
        self.thread = threading.Thread(target=self._run, name="zephon-process-supervisor",
                                       daemon=True)
        self.thread.start()
        logger.debug("process runner: %d worker process(es) started (%s)", num_workers,
                     start_method)

    # ------------------------------------------------------------------ workers

    def _start(self, slot: int) -> _Worker:
        process, task_w, result_r = start_child(
            self.start_method, worker_main, name=f"zephon-worker-{slot}", daemon=True,
            args=lambda task_r, result_w, *_: (slot, task_r, result_w, self.directory,
                                               self.prefix, self.inline_limit),
        )
        worker = _Worker(slot, process, task_w, result_r)
        # The operators go as the first message, not as process arguments, so
        # that start() never blocks writing a large pickle to a child still booting.
        worker.outbox.put(self.init)
        worker.feeder.start()
        return worker

    def _pick(self) -> _Worker | None:
        live = [w for w in self.workers if w is not None and w.alive]
        if not live:
            return None
        self._rr += 1
        count = len(live)
        # Least loaded first; a worker still starting counts one extra task;
        # ties rotate so that equal workers share the work.
        return min(
            (live[(self._rr + i) % count] for i in range(count)),
            key=lambda w: len(w.in_flight) + (0 if w.ready else 1),
        )

    def dispatch(self, task: _Task) -> None:
        """Send a task to the least-loaded live worker (or fail it if the pool cannot run it)."""
        with self.lock:
            error = self.refusal(task.stage)
            if error is None:
                worker = self._pick()
                if worker is not None:
                    worker.in_flight[task.id] = task
                    if len(worker.in_flight) == 1 and worker.ready:
                        worker.busy_since = time.monotonic()
                    worker.outbox.put(task.message)
                    return
                error = RuntimeError("zephon ProcessPool has no live worker")
        _fail(task.future, error)

    def refusal(self, stage: int) -> BaseException | None:
        """Why a micro-batch of ``stage`` cannot run now (broken or closed pool), or None."""
        if self.broken is not None:
            return self.broken
        if self.stopping:
            return RuntimeError(
                f"zephon ProcessPool is closed; stage {self.names[stage]!r} cannot run"
            )
        return None

    # ------------------------------------------------------------------ supervisor thread

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    if self.stopping:
                        return
                    owners: dict[Any, _Worker] = {}
                    for worker in self.workers:
                        if worker is not None and worker.alive:
                            owners[worker.results] = worker
                            owners[worker.process.sentinel] = worker
                for ready in mp_connection.wait([*owners, self._wake_r], self._watchdog()):
                    if ready == self._wake_r:
                        os.read(self._wake_r, 512)
                        continue
                    worker = owners[ready]
                    if not worker.alive:
                        continue
                    if ready is worker.results:
                        if not self._receive(worker):
                            self._on_death(worker)
                    else:  # the process ended: take what it sent before dying
                        while self._receive(worker, block=False):
                            pass
                        self._on_death(worker)
        except BaseException as exc:  # never leave a consumer waiting on a future
            error = RuntimeError(f"zephon ProcessPool supervisor failed: {exc!r}")
            error.__cause__ = exc
            self._break(error)

    def _receive(self, worker: _Worker, block: bool = True) -> bool:
        """Handle one message; False at end of stream (or, without ``block``, none waiting)."""
        try:
            if not block and not worker.results.poll():
                return False
            data = worker.results.recv_bytes()
        except (EOFError, OSError):
            return False
        message = pickle.loads(data)
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            with self.lock:
                self.startup_deaths = 0
                if worker.in_flight:
                    worker.busy_since = time.monotonic()
        elif kind == "result":
            _, task_id, ref, read = message
            if read:
                with self.lock:
                    self.bytes_read += read
            with self.lock:
                task = worker.in_flight.pop(task_id, None)
                worker.busy_since = time.monotonic() if worker.in_flight else None
            try:
                unit = wire.load_unit(ref, self.directory, copy=True)
            except BaseException as exc:
                unit = None
                error: BaseException | None = exc
            else:
                error = None
            finally:
                shm.unlink_ref(ref, self.directory)
            if task is not None:
                self.done(task)
                if error is not None:
                    _fail(task.future, error)
                elif not task.future.done():
                    with contextlib.suppress(cf.InvalidStateError):
                        task.future.set_result(unit)
        elif kind == "error":
            _, task_id, blob, type_name, text_message, text = message
            with self.lock:
                task = worker.in_flight.pop(task_id, None)
                worker.busy_since = time.monotonic() if worker.in_flight else None
            if task is not None:
                self.done(task)
                _fail(task.future, wire.remote_error(blob, type_name, text_message, text))
        elif kind == "fatal":
            _, _, blob, type_name, text_message, text = message
            self._break(wire.remote_error(blob, type_name, text_message, text))
        return True

    def done(self, task: _Task) -> None:
        """A task is over: its input segment is no longer needed."""
        shm.unlink_ref(task.input, self.directory)

    def _watchdog(self) -> float | None:
        """Kill workers stuck on one micro-batch past ``task_timeout``; seconds to the next check.

        A killed worker is then handled like any dead one: its micro-batch is
        sent again, and after ``max_restarts`` such deaths it fails with an error
        saying it hung. None (wait without a timeout) when there is no limit.
        """
        limit = self.task_timeout
        if limit is None:
            return None
        now = time.monotonic()
        wait = limit
        with self.lock:
            for worker in self.workers:
                if worker is None or not worker.alive or worker.busy_since is None:
                    continue
                left = worker.busy_since + limit - now
                if left <= 0 and not worker.timed_out:
                    worker.timed_out = True
                    with contextlib.suppress(OSError):
                        worker.process.kill()  # its sentinel wakes the loop: _on_death
                elif left > 0:
                    wait = min(wait, left)
        return max(wait, 0.01)

    def _on_death(self, worker: _Worker) -> None:
        process = worker.process
        process.join(timeout=1.0)
        if process.is_alive():  # its pipe broke but it lingers: it is useless now
            process.kill()
            process.join()
        how = describe_exit(process.exitcode)
        if worker.timed_out:
            how = (f"ran one micro-batch for more than task_timeout={self.task_timeout:g} s "
                   "and was killed")
        with self.lock:
            worker.alive = False
            self.workers[worker.slot] = None
            tasks = list(worker.in_flight.values())
            worker.in_flight.clear()
            self._retire(worker)
            # A worker that died mid-write leaves a segment nobody adopted.
            shm.sweep_prefix(self.directory, f"{self.prefix}-{process.pid}-")
            if self.stopping or self.broken is not None:
                return  # nothing to restart for; pending futures have been failed
            failed: list[tuple[_Task, BaseException]] = []
            if not worker.ready:
                self.startup_deaths += 1
                if self.startup_deaths > self.max_restarts:
                    error = RuntimeError(
                        f"zephon worker processes keep dying before they are ready: worker "
                        f"{worker.slot} (pid {process.pid}) {how}, {self.startup_deaths} "
                        "start-ups in a row; "
                        + (self.unguarded or "a crash while unpickling an operator or in "
                           "its setup()?")
                    )
                    self._break(error, tasks)
                    return
            elif tasks:
                head = tasks[0]  # the one it was running: a worker runs its tasks in order
                head.deaths += 1
                if head.deaths > self.max_restarts:
                    tasks.pop(0)
                    name = self.names[head.stage]
                    failed.append((head, RuntimeError(
                        f"a zephon worker process died while running stage {name!r}: worker "
                        f"{worker.slot} (pid {process.pid}) {how}. The micro-batch was "
                        f"dispatched {head.deaths} times and its worker died every time, so "
                        f"the run stops here ("
                        + ("a hang: a deadlock, an endless loop or a call that never returns"
                           if worker.timed_out else "a crash in native code, os._exit or the "
                           "out-of-memory killer")
                        + f", in the operator of stage {name!r}?)"
                    )))
            logger.warning("process runner: worker %d (pid %s) %s; starting a new one and sending "
                           "its %d micro-batch(es) again", worker.slot, process.pid, how,
                           len(tasks))
            try:
                self.workers[worker.slot] = self._start(worker.slot)
            except Exception as exc:
                error = RuntimeError(f"zephon could not restart a dead worker process: {exc}")
                error.__cause__ = exc
                self._break(error, tasks)
                return
            for task in tasks:
                if not task.future.done():
                    self.dispatch(task)
        for task, exc in failed:
            _fail(task.future, exc)

    def _retire(self, worker: _Worker) -> None:
        worker.outbox.put(None)
        worker.feeder.join(timeout=5.0)
        if not worker.feeder.is_alive():  # else leak the fd rather than close it under a send
            worker.tasks.close()
        worker.results.close()

    def _break(self, error: BaseException, extra: Sequence[_Task] = ()) -> None:
        """Mark the pool unusable and fail every pending future with ``error``."""
        with self.lock:
            if self.broken is None:
                self.broken = error
            tasks = list(extra)
            for worker in self.workers:
                if worker is not None:
                    tasks.extend(worker.in_flight.values())
                    worker.in_flight.clear()
        for task in tasks:
            self.done(task)
            _fail(task.future, error)

    # ------------------------------------------------------------------ shutdown

    def terminate_now(self) -> None:
        """Kill the workers and unlink every segment, from a SIGTERM handler.

        The process dies right after, so nothing is joined or failed: no future
        callback runs, and no lock is waited on for long (the interrupted
        main thread may hold one). The workers are killed, and seen to be
        dead, before the sweep, so that none can write a segment after it.
        """
        if os.getpid() != self.owner:  # a forked child: these are its parent's
            return
        locked = self.lock.acquire(timeout=2.0)  # no restart of a dead worker from now on
        try:
            self.stopping = True
            workers = [w for w in self.workers if w is not None]
        finally:
            if locked:
                self.lock.release()
        kill_now([worker.process for worker in workers])
        shm.sweep_prefix(self.directory, f"{self.prefix}-")

    def shutdown(self) -> None:
        """Stop everything, join every process and thread, unlink every segment."""
        if os.getpid() != self.owner:  # a forked child must not touch our workers
            return
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
            workers = [w for w in self.workers if w is not None]
            pending = [t for w in workers for t in w.in_flight.values()]
            for worker in workers:
                worker.in_flight.clear()
                if worker.alive:
                    # Tasks not yet sent are dropped, so that a worker stops after the
                    # task it is running instead of working through its queue first.
                    with contextlib.suppress(queue.Empty):
                        while True:
                            worker.outbox.get_nowait()
                    worker.outbox.put(wire.STOP)
        for task in pending:
            _fail(task.future, RuntimeError(
                f"zephon ProcessPool was closed before a micro-batch of stage "
                f"{self.names[task.stage]!r} finished"
            ))
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        thread = getattr(self, "thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        reap([worker.process for worker in workers], self.shutdown_timeout, 1.0)
        for worker in workers:
            if worker.alive:
                worker.alive = False
                self._retire(worker)
        shm.sweep_prefix(self.directory, f"{self.prefix}-")
        unwatch_sigterm(self)
        if thread is None or not thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)


class ProcessPool(Pool):
    """Runs micro-batches in worker processes (see the module doc).

    Args:
        ops: The compiled plan's operators, by stage index.
        ctxs: Their contexts (``setup`` runs in every worker for each
            operator whose ``traits().inline`` is False).
        num_workers: Worker processes (each runs any stage).
        max_restarts: Deaths a micro-batch may cause before its future fails;
            also how many workers may die in a row before being ready.
        inline_limit: Units of at most this many bytes travel in the message
            instead of a shared-memory segment.
        shutdown_timeout: Seconds :meth:`close` waits for workers to stop
            before terminating them.
        task_timeout: Seconds one micro-batch may run in a worker (None: no
            limit). A worker past it is killed and handled like a dead one
            (the micro-batch is sent again, at most ``max_restarts`` times),
            so a hang becomes a clear error instead of a stalled run.
        start_method: ``"spawn"`` (default) or ``"forkserver"``.

    Raises:
        ValueError: A bad argument.
        TypeError: The operators cannot be pickled by cloudpickle.
    """

    def __init__(self, ops: Sequence[Operator], ctxs: Sequence[OpContext], num_workers: int,
                 *, max_restarts: int = 3, inline_limit: int = 16 * 1024,
                 shutdown_timeout: float = 1.0, start_method: str = "spawn",
                 task_timeout: float | None = None) -> None:
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
        if not isinstance(inline_limit, int) or inline_limit < 0:
            raise ValueError(f"inline_limit must be an integer >= 0, got {inline_limit!r}")
        if not shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout!r}")
        if task_timeout is not None and (isinstance(task_timeout, bool)
                                         or not isinstance(task_timeout, (int, float))
                                         or not task_timeout > 0):
            raise ValueError(f"task_timeout must be a number of seconds > 0 or None (no "
                             f"limit), got {task_timeout!r}")
        if start_method not in _START_METHODS:
            raise ValueError(
                f"start_method must be one of {list(_START_METHODS)}, got {start_method!r} "
                "(a bare fork of a process with threads can deadlock the child)"
            )
        ops = list(ops)
        ctxs = list(ctxs)
        if len(ops) != len(ctxs):
            raise ValueError(f"got {len(ops)} operators but {len(ctxs)} contexts")
        init = wire.init_message(ops, ctxs)
        directory = shm.segment_dir()
        shm.sweep_stale(directory)
        prefix = shm.new_prefix()
        self._names = [ctx.stage_name or f"stage {i}" for i, ctx in enumerate(ctxs)]
        self._directory = directory
        self._writer = shm.Writer(directory, f"{prefix}-{os.getpid()}", inline_limit)
        self._ids = itertools.count()
        self._supervisor = _Supervisor(
            init, self._names, num_workers, max_restarts=max_restarts, directory=directory,
            prefix=prefix, inline_limit=inline_limit, shutdown_timeout=shutdown_timeout,
            start_method=start_method, task_timeout=task_timeout,
        )
        self._finalizer = weakref.finalize(self, self._supervisor.shutdown)
        watch_sigterm(self._supervisor)

    @property
    def prefix(self) -> str:
        """Name prefix of every shared-memory segment of this pool."""
        return self._supervisor.prefix

    @property
    def directory(self) -> str:
        """Directory of the segments."""
        return self._directory

    def bytes_read(self) -> int:
        """Bytes the workers' readers read for the micro-batches whose results came back
        (a worker that dies takes the count of the task it was running with it)."""
        with self._supervisor.lock:
            return self._supervisor.bytes_read

    def worker_pids(self) -> list[int]:
        """Pids of the live workers (tests and diagnostics)."""
        with self._supervisor.lock:
            return [w.process.pid for w in self._supervisor.workers
                    if w is not None and w.alive]

    def submit(self, stage_index: int, elems: Any) -> cf.Future:
        """Send the micro-batch ``elems`` (a block or a list) to a worker."""
        future: cf.Future = cf.Future()
        if not 0 <= stage_index < len(self._names):
            future.set_exception(IndexError(
                f"stage index {stage_index} out of range for {len(self._names)} stages"
            ))
            return future
        refusal = self._supervisor.refusal(stage_index)
        if refusal is not None:  # fail fast, before writing anything to shared memory
            future.set_exception(refusal)
            return future
        try:
            task = self._task(stage_index, elems, future)
        except Exception as exc:
            future.set_exception(exc)
            return future
        self._supervisor.dispatch(task)
        return future

    def _task(self, stage: int, unit: Any, future: cf.Future) -> _Task:
        name = self._names[stage]
        try:
            ref = wire.dump_unit(self._writer, unit)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(
                f"stage {name!r}: a record of this micro-batch cannot be pickled for a "
                f"worker process: {exc}"
            ) from exc
        task_id = next(self._ids)
        message = wire.task_message(task_id, stage, ref)
        return _Task(task_id, stage, message, future, ref)

    def close(self) -> None:
        """Stop the workers, fail pending futures, unlink every segment; idempotent."""
        self._finalizer()

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
