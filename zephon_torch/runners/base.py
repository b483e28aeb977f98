"""Worker pools: where ``process_many`` runs.

A pool takes ``(stage_index, micro_batch)`` jobs and returns a
``concurrent.futures.Future`` per job. The engine numbers jobs per stage and
its reorder buffer releases results in job order, so a pool may finish jobs
in any order. Three pools live here:

* :class:`InlinePool` runs the job at once on the calling thread;
* :class:`ThreadPool` gives each stage a thread pool of its own;
* the process pool (``process.py``) runs jobs in worker processes.

Each pool also reports the bytes that dataset readers read in the jobs it ran
away from the caller's thread (:meth:`Pool.bytes_read`); the iterator adds
what its own thread read.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Sequence
from typing import Any

from zephon_torch.block import Block
from zephon_torch.ops.base import OpContext, Operator
from zephon_torch.sources.base import thread_bytes_read

__all__ = ["InlinePool", "Pool", "ThreadPool", "completed", "run_unit"]


def run_unit(op: Operator, unit: Any) -> Any:
    """Run one micro-batch: ``process_block`` for a block, ``process_many`` for a list."""
    if type(unit) is Block:
        return op.process_block(unit)
    return op.process_many(unit)


def completed(value: Any = None, error: BaseException | None = None) -> cf.Future:
    """A future that is already done (the inline pool's answer)."""
    fut: cf.Future = cf.Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
    return fut


class Pool:
    """Interface of a worker pool."""

    def submit(self, stage_index: int, elems: Any) -> cf.Future:
        """Run the micro-batch ``elems`` (a block or a list) on stage ``stage_index``'s
        operator (see :func:`run_unit`); return its future."""
        raise NotImplementedError

    def bytes_read(self) -> int | None:
        """Bytes dataset readers read (:func:`~zephon_torch.sources.base.count_read`) in
        the jobs this pool ran on threads or processes of its own, since it started;
        ``None`` where they cannot be known. Jobs run on the caller's thread (the
        inline pool's) are the caller's to count: 0 here."""
        return 0

    def close(self) -> None:
        """Release every worker and resource; idempotent."""


class InlinePool(Pool):
    """Runs ``process_many`` immediately on the calling thread."""

    def __init__(self, ops: Sequence[Operator], ctxs: Sequence[OpContext]) -> None:
        self.ops = list(ops)
        for op, ctx in zip(self.ops, ctxs):
            op.setup(ctx)

    def submit(self, stage_index: int, elems: Any) -> cf.Future:
        try:
            return completed(run_unit(self.ops[stage_index], elems))
        except BaseException as exc:  # re-raised by the engine, in order
            return completed(error=exc)

    def run(self, stage_index: int, elems: Any) -> Any:
        """Run a job and return its result directly (no future)."""
        return run_unit(self.ops[stage_index], elems)


class ThreadPool(Pool):
    """A thread pool per stage; ``setup`` runs once (operators are shared by threads)."""

    def __init__(self, ops: Sequence[Operator], ctxs: Sequence[OpContext],
                 num_workers: int) -> None:
        self.ops = list(ops)
        for op, ctx in zip(self.ops, ctxs):
            op.setup(ctx)
        self._executors = [
            cf.ThreadPoolExecutor(max_workers=num_workers,
                                  thread_name_prefix=f"zephon-{ctx.stage_name}")
            for ctx in ctxs
        ]
        self._bytes = 0
        self._bytes_lock = threading.Lock()

    def submit(self, stage_index: int, elems: Any) -> cf.Future:
        return self._executors[stage_index].submit(self._counted, self.ops[stage_index], elems)

    def _counted(self, op: Operator, elems: Any) -> Any:
        """Run a job on a pool thread and add what it read to the pool's count."""
        before = thread_bytes_read()
        try:
            return run_unit(op, elems)
        finally:
            read = thread_bytes_read() - before
            if read:
                with self._bytes_lock:
                    self._bytes += read

    def bytes_read(self) -> int:
        """Bytes read by the jobs that have finished on the pool's threads."""
        with self._bytes_lock:
            return self._bytes

    def close(self) -> None:
        for executor in self._executors:
            executor.shutdown(wait=True, cancel_futures=True)
        self._executors = []
