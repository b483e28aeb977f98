"""The process pool's supervisor: the workers, their tasks, deaths and shutdown.

:class:`~zephon_torch.runners.process.ProcessPool` (its module doc has the
picture, the fault rules and the shutdown order) writes a micro-batch to
shared memory and hands a :class:`Task` to the :class:`Supervisor`. The
supervisor owns the worker processes: it sends each task to the least-loaded
live worker through that worker's feeder thread, and its own thread collects
results and errors, kills workers stuck past ``task_timeout``, replaces dead
ones and sends their micro-batches again, and breaks the pool when workers
keep dying. It also stops everything, on ``close``, on garbage collection and
on ``SIGTERM``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import pickle
import queue
import threading
import time
from collections.abc import Sequence
from multiprocessing import connection as mp_connection
from typing import Any

from zephon_torch._main_guard import unguarded_start
from zephon_torch.logs import logger
from zephon_torch.runners import shm, wire
from zephon_torch.runners.worker import worker_main
from zephon_torch.runners.workers import (
    describe_exit,
    kill_now,
    reap,
    start_child,
    unwatch_sigterm,
)

__all__ = ["Supervisor", "Task"]


# --------------------------------------------------------------------------- errors


def _fail(future: cf.Future, exc: BaseException) -> None:
    with contextlib.suppress(cf.InvalidStateError):  # cancelled or already done
        future.set_exception(exc)


# --------------------------------------------------------------------------- main side


class Task:
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
        self.in_flight: dict[int, Task] = {}  # in sending order = the order it runs them
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


class Supervisor:
    """Owns the workers; its thread collects results and replaces dead workers.

    Kept apart from :class:`~zephon_torch.runners.process.ProcessPool` so
    that the pool object itself can be garbage-collected (its finalizer then
    shuts this down) while the threads still reference the supervisor.
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

    def dispatch(self, task: Task) -> None:
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

    def done(self, task: Task) -> None:
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
            failed: list[tuple[Task, BaseException]] = []
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

    def _break(self, error: BaseException, extra: Sequence[Task] = ()) -> None:
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
