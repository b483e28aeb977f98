"""The process runner's pool: micro-batches in worker processes.

Every worker can run every stage. A micro-batch travels as one *unit*
(a block, or a list of records), its buffers in a shared-memory segment and
only a small ref on the pipes (``wire.py`` has the format, ``shm.py`` the
segments); the worker loop is ``worker.py``. The main side is the pool the
engine submits to (this module) and the supervisor that owns the workers
(``supervisor.py``)::

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
import itertools
import os
import pickle
import weakref
from collections.abc import Sequence
from typing import Any

from zephon_torch.ops.base import OpContext, Operator
from zephon_torch.runners import shm, wire
from zephon_torch.runners.base import Pool
from zephon_torch.runners.supervisor import Supervisor, Task
from zephon_torch.runners.wire import WorkerTraceback
from zephon_torch.runners.workers import (
    SigtermGuard,
    describe_exit,
    reap,
    unwatch_sigterm,
    watch_sigterm,
)

# WorkerTraceback lives in wire.py, the process lifetime helpers in workers.py; they
# stay importable from here.
__all__ = ["ProcessPool", "SigtermGuard", "WorkerTraceback", "describe_exit", "reap",
           "unwatch_sigterm", "watch_sigterm"]

_START_METHODS = ("spawn", "forkserver")


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
        self._supervisor = Supervisor(
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

    def _task(self, stage: int, unit: Any, future: cf.Future) -> Task:
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
        return Task(task_id, stage, message, future, ref)

    def close(self) -> None:
        """Stop the workers, fail pending futures, unlink every segment; idempotent."""
        self._finalizer()

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
