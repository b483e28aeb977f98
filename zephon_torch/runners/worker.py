"""The process runner's worker: one spawned process that runs micro-batches.

:func:`worker_main` is the target of every worker process of a
``ProcessPool`` (``process.py``). It receives the operators and their
contexts first (``wire.init_message``), calls ``op.setup(ctx)`` once for
every operator that is not ``inline``, says it is ready, then runs tasks in
arrival order until it is told to stop or the main process goes away::

    task pipe  ──► ("task", id, stage, ref) ─► map the segment (zero-copy)
                                               run the stage's operator
    result pipe ◄── ("result", id, ref, bytes read)  (a new segment of ours)
                or  ("error", id, ...)               (the operator raised)

A worker imports only what the operators' pickles import, so no torch
unless an operator needs it. It ignores ``SIGINT``: Ctrl-C goes to the whole
process group, and the main process handles it and closes the pool.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from typing import Any

from zephon_torch.block import Block
from zephon_torch.ops.base import Operator, check_elements
from zephon_torch.runners import shm, wire
from zephon_torch.runners.base import run_unit
from zephon_torch.runners.workers import child_signals
from zephon_torch.sources.base import thread_bytes_read

__all__ = ["worker_main"]


def worker_main(slot: int, tasks: Any, results: Any, directory: str, prefix: str,
                inline_limit: int) -> None:
    """A worker process: set up the operators, then run tasks in arrival order."""
    # Ctrl-C goes to the whole process group; the main process handles it and closes us.
    child_signals()
    pid = os.getpid()
    writer = shm.Writer(directory, f"{prefix}-{pid}", inline_limit)
    try:
        init = tasks.recv_bytes()
    except (EOFError, OSError):
        return  # the main process went away before sending the operators
    try:
        loaded = pickle.loads(init)
        del init
        if isinstance(loaded[0], str):  # ("stop",): the pool closed before we were set up
            return
        ops, ctxs = loaded
        names = [ctx.stage_name or f"stage {i}" for i, ctx in enumerate(ctxs)]
        for op, ctx in zip(ops, ctxs):
            if not op.traits().inline:
                op.setup(ctx)
    except Exception as exc:
        header = (f"zephon worker {slot} (pid {pid}) failed while starting (unpickling the "
                  "operators or running op.setup):")
        with contextlib.suppress(OSError):
            results.send_bytes(wire.error_message("fatal", -1, exc, header))
        return
    try:
        results.send_bytes(wire.READY)
    except OSError:
        return
    while True:
        try:
            message = pickle.loads(tasks.recv_bytes())
        except (EOFError, OSError):
            return  # the main process is gone
        if message[0] == "stop":
            return
        reply, ref = _run_task(message, ops, names, writer, directory, slot, pid)
        try:
            results.send_bytes(reply)
        except OSError:
            writer.discard(ref)  # nobody will ever adopt this segment
            return


def _run_task(message: tuple, ops: list[Operator], names: list[str], writer: shm.Writer,
              directory: str, slot: int, pid: int) -> tuple[bytes, shm.BlockRef | None]:
    _, task_id, stage, in_ref = message
    ref = None
    try:
        unit = wire.load_unit(in_ref, directory, copy=False)
        before = thread_bytes_read()
        out = run_unit(ops[stage], unit)
        read = thread_bytes_read() - before  # what the readers read for this task
        del unit  # its mapping goes once nothing of it is in use
        if type(out) is not Block:
            out = check_elements(out, names[stage])
        try:
            ref = wire.dump_unit(writer, out)
            reply = wire.result_message(task_id, ref, read)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            writer.discard(ref)
            ref = None
            raise TypeError(
                f"stage {names[stage]!r} returned an element that cannot be pickled for the "
                f"trip back to the main process: {exc}"
            ) from exc
        return reply, ref
    except Exception as exc:
        header = f"Traceback of zephon worker {slot} (pid {pid}), stage {names[stage]!r}:"
        return wire.error_message("error", task_id, exc, header), None
