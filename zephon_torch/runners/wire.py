"""The process runner's wire format: how a unit, a reply and an error travel.

A micro-batch travels as one *unit*: a :class:`~zephon_torch.block.Block`
(the common case: one lane's records as a few arrays) or a list of records
and batches (user operators). It is pickled in one call with protocol 5, its
array buffers written out of band into one shared-memory segment
(``shm.py``), so that a block of tokens crosses as its identity, offset and
value arrays, not as a pickle per record; only the segment's
:class:`~zephon_torch.runners.shm.BlockRef` goes through a pipe.

The messages on the pipes (each one pickled tuple, except the operators)::

    main -> worker   cloudpickle of (ops, ctxs)               first, once (init_message)
                     ("task", task_id, stage, ref)             a micro-batch to run
                     ("stop",)                                 end after the current task
    worker -> main   ("ready",)                                set up, taking tasks
                     ("result", task_id, ref, bytes_read)      the output unit's segment
                     ("error", task_id, blob, type, message, traceback)
                     ("fatal", -1, blob, type, message, traceback)   set-up failed

An error travels as the pickled exception (``blob``, None when it does not
survive a round trip) with its type name, message and formatted traceback,
so the consumer re-raises it with its own type and message and the worker's
traceback attached as ``__cause__`` (a :class:`WorkerTraceback`); one that
cannot be pickled becomes a ``RuntimeError`` carrying the rest. The Ray
runner (``ray.py``) sends its errors the same way.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Sequence
from typing import Any

from zephon_torch.runners import shm

__all__ = [
    "PROTOCOL",
    "READY",
    "STOP",
    "Orphaned",
    "WorkerTraceback",
    "dump_unit",
    "error_message",
    "exception_parts",
    "init_message",
    "load_unit",
    "recv_from_parent",
    "remote_error",
    "result_message",
    "revived_exception",
    "send_to_parent",
    "task_message",
]

PROTOCOL = pickle.HIGHEST_PROTOCOL
#: Main -> worker: stop after the task being run.
STOP = pickle.dumps(("stop",), protocol=PROTOCOL)
#: Worker -> main: the operators are set up.
READY = pickle.dumps(("ready",), protocol=PROTOCOL)
#: Seconds between checks that the parent lives, while a child waits on a pipe.
_PARENT_POLL = 0.2


class Orphaned(Exception):
    """A child's parent process is gone (a pipe to it broke or hit end-of-file)."""


def recv_from_parent(control: Any, parent: int) -> bytes:
    """The next message from the parent process on ``control``; waits while it lives.

    Other processes may hold the parent's end of the pipe (a sibling forked
    before the parent closed its copies), so end-of-file alone does not tell
    that the parent is gone: the child's parent pid changing does.

    Raises:
        Orphaned: The pipe broke, or this process's parent is no longer ``parent``.
    """
    try:
        while not control.poll(_PARENT_POLL):
            if os.getppid() != parent:
                raise Orphaned
        return control.recv_bytes()
    except (EOFError, OSError) as exc:
        raise Orphaned from exc


def send_to_parent(data: Any, message: bytes) -> None:
    """Send ``message`` on ``data``; :class:`Orphaned` when the parent's end is gone."""
    try:
        data.send_bytes(message)
    except OSError as exc:
        raise Orphaned from exc



class WorkerTraceback(Exception):
    """The formatted traceback of an exception raised in a worker process.

    It is attached as ``__cause__`` of the exception re-raised in the
    consumer, so a printed traceback shows the worker's stack under "The
    above exception was the direct cause of the following exception".

    Attributes:
        text: The traceback text, headed by the worker and the stage.
    """

    # Its public home, where the docs name it, tracebacks print it and pickles find it.
    __module__ = "zephon_torch.runners.process"

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


# --------------------------------------------------------------------------- units


def dump_unit(writer: shm.Writer, unit: Any) -> shm.BlockRef:
    """Write a unit into a segment of ``writer``'s; the ref that crosses the pipe.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: Something in the
            unit cannot be pickled (callers say which stage).
    """
    return writer.dump([unit])


def load_unit(ref: shm.BlockRef, directory: str, *, copy: bool) -> Any:
    """The unit a ref points to (``copy``: into memory of our own, see ``shm.py``)."""
    return shm.load(ref, directory, copy=copy)[0]


# --------------------------------------------------------------------------- messages


def init_message(ops: Sequence[Any], ctxs: Sequence[Any]) -> bytes:
    """The operators and their contexts, for a worker's start (cloudpickle: lambdas work).

    Raises:
        TypeError: An operator cannot be pickled.
    """
    import cloudpickle

    try:
        return cloudpickle.dumps((list(ops), list(ctxs)), protocol=PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"runner='process' sends the operators to worker processes with cloudpickle, "
            f"and pickling them failed: {exc}. Keep open files, locks and clients out of "
            "an operator's attributes (create them in setup())."
        ) from exc


def task_message(task_id: int, stage: int, ref: shm.BlockRef) -> bytes:
    """Main -> worker: run stage ``stage`` on the unit at ``ref``."""
    return pickle.dumps(("task", task_id, stage, ref), protocol=PROTOCOL)


def result_message(task_id: int, ref: shm.BlockRef, bytes_read: int) -> bytes:
    """Worker -> main: the output unit of ``task_id`` is at ``ref``."""
    return pickle.dumps(("result", task_id, ref, bytes_read), protocol=PROTOCOL)


def exception_parts(exc: BaseException) -> tuple[bytes | None, str, str]:
    """What travels of an exception: itself pickled (None when it does not survive a round
    trip), its type's full name and its message."""
    blob: bytes | None
    try:
        blob = pickle.dumps(exc, protocol=PROTOCOL)
        pickle.loads(blob)  # an exception whose __init__ breaks unpickling fails here
    except Exception:
        blob = None
    return blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc)


def revived_exception(blob: bytes | None) -> Any:
    """What ``blob`` (from :func:`exception_parts`) unpickles to; None if it cannot."""
    if blob is None:
        return None
    try:
        return pickle.loads(blob)
    except Exception:
        return None


def error_message(kind: str, task_id: int, exc: BaseException, header: str) -> bytes:
    """An error reply: the pickled exception if it survives a round trip, and its text."""
    text = f"{header}\n{''.join(traceback.format_exception(exc))}"
    blob, kind_name, message = exception_parts(exc)
    return pickle.dumps((kind, task_id, blob, kind_name, message, text), protocol=PROTOCOL)


def remote_error(blob: bytes | None, type_name: str, message: str, text: str) -> BaseException:
    """The exception an error reply carries, to raise here, with the remote traceback."""
    exc = revived_exception(blob)
    if not isinstance(exc, BaseException):
        exc = RuntimeError(
            f"{type_name}: {message} (raised in a zephon worker process; the exception "
            f"could not be pickled back, so it is re-raised as RuntimeError)\n{text}"
        )
    exc.__cause__ = WorkerTraceback(text)
    return exc
