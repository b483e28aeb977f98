"""The producers behind ``zephon_torch.DataLoader``: where the pipeline runs.

A producer runs the pipeline's iterator and turns each item into an *event*:
``("batch", payload, state)`` where ``payload`` is what the caller will get
(``to_training`` output, or the ``SampleBatch``) and ``state`` is the
iterator's ``state_dict()`` right after that item (None under
``deterministic=False``, which cannot checkpoint), then one
``("end", state)``. In this process (:class:`InProcessProducer`) a batch's
state is a :class:`~zephon_torch.runners.snapshots.StateSnapshot` of that
moment, whose ``state()`` is the dict: the loader keeps one per batch and
builds few. Sending the state *with* the batch is what lets the
loader prefetch freely and still checkpoint exactly: the loader keeps the
state of the last batch it handed to the caller, never the state of what
the engine has produced ahead.

Two producers, one loop (:func:`run_pipeline`):

* :class:`InProcessProducer` runs the iterator on the loader's prefetch
  thread: the inline runner (``num_workers=0``), the lane workers
  (``runner="lanes"``, the default with workers: the workers run each
  lane's pipeline and ``to_training`` and ship finished tensors through
  shared memory, see ``runners/lanes.py``), or any runner with
  ``in_process=True``;
* :class:`EngineProcess` runs it in a process of its own, for the
  stage-parallel runners (``"threads"``, ``"process"``), so the training
  process keeps its GIL. Only finished batches cross over::

    training process                               engine process (spawned, non-daemonic)
    ────────────────                               ──────────────────────────────────────
    prefetch thread                                PipelineIterator (+ its worker pool)
      start(): spawn, send the spec ── control ──► load the state, iterate
                                                   item.to_training(**kwargs)
                                                   tensors -> numpy, one pickle (protocol 5),
                                                   big buffers out of band into a /dev/shm
                                                   segment (runners/shm.py's Writer)
      recv ◄──────────────────────────── data ──── ("batch", BlockRef, state after it)
      read the segment, unlink it,
      numpy -> torch.from_numpy
      credit ─────────────────────────── control ─► one more batch may be produced
      ...                                          ("end", state) / ("error", ...)
      stop ───────────────────────────── control ─► close the iterator and its pool, exit

Flow control is by credits: the engine produces a batch only when it holds
a credit; the loader grants ``credits`` at start and one more for each
batch it takes off the pipe, so at most that many finished batches (and
their segments) wait in transit. The loop and its protocol are the lane
workers' (``runners/workers.py``, where the engine is started and stopped too).

Segments are named ``<loader prefix>-<engine pid>-<seq>``, where the loader
prefix (``shm.new_prefix()`` in the training process) starts with the
*training* process's pid: they belong to the reader. The reader unlinks
each segment as soon as it has copied it out; closing the producer sweeps
whatever is left. An engine that finds its parent gone (a broken pipe)
sweeps its own segments. So does an engine that ``SIGTERM`` ends, if its
parent dies within a few seconds too: a ``SIGTERM`` sent to the whole
process group (a scheduler stopping the job) kills a reader that has no
handler of its own by the default action, which unlinks nothing, so the
batches in transit would stay (see :func:`_reader_gone`). A reader that
outlives the signal reads the batches in transit, then raises an error
saying that the engine was stopped by ``SIGTERM``. If both die by
``SIGKILL``, the next pool or loader's ``shm.sweep_stale`` removes them
(their owner pid is dead).

Lifetime of the engine process: ``close()`` resumes it if it was stopped
(``SIGCONT``), asks it to stop (it closes the iterator, which stops and
joins its pool workers, and exits), waits, then sends ``SIGTERM`` (turned
into ``SystemExit(143)`` in the engine so that the same clean-up runs), then
``SIGKILL``. ``SIGINT`` is ignored in the engine: Ctrl-C reaches the whole
process group, and the training process is the one
that decides to stop. An engine whose parent dies sees end-of-file on its
control pipe (or a broken data pipe) and exits.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from zephon_torch.runners import shm
from zephon_torch.runners.lanes import Finished
from zephon_torch.runners.options import RunOptions
from zephon_torch.runners.registry import runner_spec
from zephon_torch.runners.wire import (
    Orphaned,
    WorkerTraceback,
    error_message,
    revived_exception,
)
from zephon_torch.runners.workers import (
    CREDIT,
    STOP,
    CreditChild,
    Ship,
    child_signals,
    describe_exit,
    exit_on_sigterm,
    receive_job,
    serve_credits,
    start_child,
    stop_children,
)

__all__ = ["EngineProcess", "EngineSpec", "InProcessProducer", "finish_batch", "open_iterator",
           "run_pipeline"]

_PROTOCOL = pickle.HIGHEST_PROTOCOL
# Batches up to this size travel inside the message: a few small records are
# cheaper through the pipe than through a create/write/read/unlink of a file.
_INLINE_LIMIT = 16 * 1024
# Seconds an engine gets to stop by itself (it answers between two batches), then to
# clean up after SIGTERM (which interrupts a long batch), before SIGKILL.
_STOP_TIMEOUT = 2.0
_TERM_TIMEOUT = 5.0
# Seconds an engine ended by SIGTERM waits to learn whether its reader is gone too (a
# SIGTERM to the whole process group kills a reader without a handler at once).
_READER_GRACE = 3.0


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """Everything a producer needs to run one iteration of a pipeline.

    Attributes:
        pipeline: The pipeline.
        iter_kwargs: Arguments of ``pipeline.iter`` (runner, workers,
            explicit rank and world size, ...).
        state: A state to resume from, or None to start afresh.
        to_training: ``to_training`` keyword arguments, or None to hand out
            the ``SampleBatch`` (or record) itself.
    """

    pipeline: Any
    iter_kwargs: Mapping[str, Any]
    state: Mapping[str, Any] | None
    to_training: Mapping[str, Any] | None


def finish_batch(kwargs: Mapping[str, Any], batch: Any) -> Any:
    """``batch.to_training(**kwargs)``, its tensors as arrays for the trip out of a lane
    worker (``runners/lanes.py``: a worker runs this on each batch)."""
    return _encode(batch.to_training(**kwargs))


def _workers_finish(iter_kwargs: Mapping[str, Any]) -> bool:
    """Whether the run's workers finish each batch themselves (lane workers)."""
    return runner_spec(iter_kwargs.get("runner", RunOptions.runner)).takes_finish


def open_iterator(spec: EngineSpec) -> Any:
    """The pipeline iterator of ``spec``, with its state loaded.

    Under ``runner="lanes"`` the lane workers run ``to_training`` themselves
    (:func:`finish_batch`) and are started here, on the calling thread.
    """
    kwargs = dict(spec.iter_kwargs)
    if _workers_finish(kwargs) and spec.to_training is not None:
        kwargs["finish"] = functools.partial(finish_batch, dict(spec.to_training))
    it = spec.pipeline.run(RunOptions(**kwargs))
    try:
        if spec.state is not None:
            it.load_state_dict(spec.state)
        it.start()
    except BaseException:
        it.close()
        raise
    return it


def run_pipeline(spec: EngineSpec, it: Any = None, *, lazy: bool = False) -> Iterator[tuple]:
    """The producer loop: ``("batch", payload, state)`` events, then ``("end", state)``.

    Args:
        spec: What to run.
        it: The iterator, when :func:`open_iterator` made it already.
        lazy: Each batch's state is a
            :class:`~zephon_torch.runners.snapshots.StateSnapshot` (its
            ``state()`` is the dict), taken for the price of the lanes that
            changed, rather than the whole dict: for a consumer in this
            process, which asks for few of them. The end's state is a dict.

    The iterator is closed (its workers joined) when the generator ends or is closed.
    """
    if it is None:
        it = open_iterator(spec)
    try:
        kwargs = spec.to_training
        # deterministic=False cannot checkpoint: no state travels (None), and the
        # loader's state_dict() raises saying why.
        state_of = it.state_dict if it.checkpointable else lambda: None
        batch_state = it.state_snapshot if lazy and it.checkpointable else state_of
        for item in it:
            if type(item) is Finished:  # to_training ran in its lane worker
                payload = _decode(item.payload)
            else:
                payload = item if kwargs is None else item.to_training(**kwargs)
            yield ("batch", payload, batch_state())
        yield ("end", state_of())
    finally:
        it.close()


class InProcessProducer:
    """Runs :func:`run_pipeline` on the calling (prefetch) thread.

    Under ``runner="lanes"`` the iterator is made, and its workers started,
    when the producer is: on the thread that starts the iteration (the
    training loop's), so that forking happens there, and the workers start
    while the prefetch thread is being set up.
    """

    def __init__(self, spec: EngineSpec) -> None:
        self._spec = spec
        self._events: Any = None
        self._iterator: Any = None
        if _workers_finish(spec.iter_kwargs):
            self._iterator = open_iterator(spec)
        #: The pipeline iterator once made (for the loader's stats()).
        self.iterator: Any = self._iterator

    @property
    def pid(self) -> int | None:
        """No engine process: None."""
        return None

    def worker_pids(self) -> list[int]:
        """The pids of the lane workers (none for the other runners)."""
        return [] if self._iterator is None else self._iterator.worker_pids()

    def describe_wait(self) -> tuple[str, int]:
        """What a caller waiting for a batch waits for, and the pid to look at."""
        if self._iterator is not None:
            worker = self._iterator.engine.waiting_on
            if worker is not None:
                return f"the loader's {worker.describe()}", worker.process.pid
            return ("the loader's lane workers (pids "
                    f"{', '.join(map(str, self.worker_pids()))}), through its prefetch thread",
                    os.getpid())
        return ("the pipeline on the loader's prefetch thread (in_process=True or "
                f"num_workers=0: in this process, pid {os.getpid()})", os.getpid())

    def events(self) -> Iterator[tuple]:
        """The events, produced here and now."""
        it = self._iterator if self._iterator is not None else open_iterator(self._spec)
        self.iterator = it
        # The loader keeps each batch's state and builds few: snapshots (see run_pipeline).
        self._events = run_pipeline(self._spec, it, lazy=True)
        return self._events

    def credit(self) -> None:
        """No flow control is needed: the prefetch queue bounds this producer."""

    def close(self) -> None:
        """Stop the lane workers now (from any thread); the generator is closed by the
        thread that runs it."""
        if self._iterator is not None:
            self._iterator.close()


# --------------------------------------------------------------------------- transport


class _Array:
    """A tensor on its way between processes, as a numpy array (pickled out of band)."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __reduce__(self) -> Any:
        return (_Array, (self.array,))


def _encode(payload: Any) -> Any:
    """Tensors of a ``to_training`` dict become numpy arrays (one out-of-band buffer each)."""
    if not isinstance(payload, dict):
        return payload  # a SampleBatch: its numpy payloads already travel out of band
    torch = sys.modules.get("torch")
    if torch is None:
        return payload
    out = {}
    for key, value in payload.items():
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            # No numpy dtype (bfloat16): the tensor is pickled whole instead. The
            # copy happens only for views (labels = tokens[:, 1:]).
            with contextlib.suppress(TypeError, RuntimeError):
                value = _Array(value.detach().contiguous().numpy())
        out[key] = value
    return out


def _decode(payload: Any) -> Any:
    if not isinstance(payload, dict):
        return payload
    import torch

    return {k: torch.from_numpy(v.array) if type(v) is _Array else v for k, v in payload.items()}


_ERROR_HEADER = "Traceback in the zephon loader's engine process:"


def _remote_error(blob: bytes | None, name: str, message: str, text: str) -> BaseException:
    """The exception of an error message (``wire.error_message``) from the engine."""
    exc = revived_exception(blob)
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{name}: {message} (raised in the zephon loader's engine process; "
                           f"it could not be pickled back)")
    exc.__cause__ = WorkerTraceback(text)
    return exc


# --------------------------------------------------------------------------- engine side


def _engine_main(data: Any, control: Any, directory: str, prefix: str, credits: int) -> None:
    """The engine process: receive the spec, iterate, send batches while credits last."""
    child_signals(exit_on_sigterm)
    parent = os.getppid()
    own = f"{prefix}-{os.getpid()}"
    writer = shm.Writer(directory, own, _INLINE_LIMIT)
    orphaned = False  # nobody will read our segments any more
    terminated = False  # SIGTERM ended us
    events: Any = None
    try:
        spec = receive_job(control, parent)
        if spec is None:
            return
        events = run_pipeline(spec)
        serve_credits(functools.partial(_ship, events), control, data, writer, parent, credits)
    except Orphaned:
        orphaned = True
    except SystemExit:
        # SIGTERM (from the loader, or to the whole group): clean up below, then exit
        # with 128 + SIGTERM, so that a reader still alive can say what ended us.
        terminated = True
        raise
    except BaseException as exc:
        with contextlib.suppress(OSError):
            data.send_bytes(error_message("error", -1, exc, _ERROR_HEADER))
    finally:
        if events is not None:
            events.close()  # closes the pipeline iterator: joins its workers, frees its segments
        if terminated:
            orphaned = _reader_gone(control, _READER_GRACE)
        if orphaned:
            shm.sweep_prefix(directory, f"{own}-")


def _ship(events: Iterator[tuple]) -> tuple[Ship | None, tuple | None]:
    """One event of :func:`run_pipeline` for the credit loop: a batch (its payload through
    a segment, its state in the message), or the end."""
    event = next(events)
    if event[0] == "end":
        return None, event
    _, payload, state = event
    return Ship("batch", _encode(payload), (state,)), None


def _reader_gone(control: Any, timeout: float) -> bool:
    """After a SIGTERM: whether the training process died too (end-of-file on ``control``).

    A SIGTERM sent to the whole process group (a scheduler stopping the job) also
    reaches the training process, and one without a handler of its own dies by the
    default action, which unlinks nothing: the batches in transit are ours to remove.
    A loader that is closing sends the stop (and sweeps after us), and a reader that
    outlives the signal (a trainer's handler that stops after the step) still reads
    the batches we sent, then learns how we ended from our exit code: both keep them.
    """
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0 or not control.poll(remaining):
                return False  # alive, and not closing this loader (yet)
            if control.recv_bytes() == STOP:
                return False
        except (EOFError, OSError):
            return True


# --------------------------------------------------------------------------- training side


class EngineProcess:
    """Runs the pipeline in a spawned, non-daemonic engine process (see the module doc).

    :meth:`events` starts the process (on the calling thread, which is the
    loader's prefetch thread, so the spawn overlaps the caller's work) and
    yields its events; :meth:`close` stops it from any thread.

    Args:
        spec: What to run.
        credits: Finished batches the engine may have in transit.
    """

    def __init__(self, spec: EngineSpec, credits: int) -> None:
        import cloudpickle  # user functions in the pipeline travel by value

        self._blob = cloudpickle.dumps(spec, protocol=_PROTOCOL)
        self._credits = credits
        self._directory = shm.segment_dir()
        self._prefix = shm.new_prefix()
        self._lock = threading.Lock()  # guards the control pipe and the process handle
        self._closing = False
        self._child: CreditChild | None = None

    @property
    def pid(self) -> int | None:
        """The engine's pid once started (tests and diagnostics)."""
        child = self._child
        return None if child is None else child.process.pid

    @property
    def prefix(self) -> str:
        """Name prefix of every segment this producer's engine writes."""
        return self._prefix

    def _start(self) -> bool:
        with self._lock:
            if self._closing:
                return False
            shm.sweep_stale(self._directory)
            process, control, data = start_child(
                "spawn", _engine_main, name="zephon-loader-engine", daemon=False,
                args=lambda control_r, data_w, *_: (data_w, control_r, self._directory,
                                                    self._prefix, self._credits),
            )
            self._child = CreditChild(process, control, data)
        # The spec goes as the first message rather than a process argument, and from
        # this thread: a large pipeline (in-memory items) may take a while to send.
        self._send(self._blob)
        self._blob = b""
        return True

    def _send(self, message: bytes) -> None:
        with self._lock:
            if self._child is None or self._closing:
                return
            self._child.send(message)

    def credit(self) -> None:
        """Let the engine produce one more batch."""
        self._send(CREDIT)

    def events(self) -> Iterator[tuple]:
        """Start the engine; yield ``("batch", payload, state)`` events, then ``("end", state)``.

        Raises:
            Exception: What the pipeline raised in the engine (same type and
                message, the engine's traceback as ``__cause__``).
            RuntimeError: The engine process died.
        """
        if not self._start():
            return
        data = self._child.data
        try:
            while True:
                try:
                    message = pickle.loads(data.recv_bytes())
                except (EOFError, OSError):
                    if self._closing:
                        return
                    raise self._died() from None
                kind = message[0]
                if kind == "batch":
                    _, ref, state = message
                    try:
                        payload = self._read(ref)
                    except FileNotFoundError:
                        # Its segment is gone: the engine removes the batches it sent only
                        # once we are gone, so someone else deleted it.
                        if self._closing:
                            return
                        raise self._died(missing=ref.name) from None
                    yield ("batch", _decode(payload), state)
                elif kind == "end":
                    yield message
                    return
                else:
                    raise _remote_error(*message[2:])
        finally:
            # Only this (reading) thread closes the data pipe: closing it under a
            # blocked recv from another thread could hand its fd number to a new file.
            with contextlib.suppress(OSError):
                data.close()

    def _died(self, missing: str | None = None) -> RuntimeError:
        """The error for an engine that ended before the end of the data.

        Args:
            missing: The segment of a batch that was not there to read, if that
                is how the end showed.
        """
        process = self._child.process
        # A missing segment means the engine still runs (it removes the batches it sent
        # only once their reader is gone): no long wait for an exit that will not come.
        process.join(timeout=0.5 if missing is not None else _TERM_TIMEOUT)
        code = process.exitcode
        if code is None and missing is not None:
            return RuntimeError(
                f"the shared-memory segment {os.path.join(self._directory, missing)} of a "
                f"batch from the zephon loader's engine process (pid {process.pid}) was "
                "removed before it was read, while the engine still runs: something deletes "
                f"files in {self._directory} (systemd-logind's RemoveIPC=yes for a user who "
                "logs out, a clean-up job). Stop that, or set ZEPHON_SHM_DIR to a directory "
                "of your own"
            )
        if code == 128 + signal.SIGTERM:  # its SIGTERM handler's SystemExit
            return RuntimeError(
                f"the zephon loader's engine process (pid {process.pid}) was stopped by "
                f"SIGTERM (exit code {code}) before the end of the data, after the batches "
                "it had sent: a SIGTERM sent to the engine, or to the whole process group "
                "(a scheduler stopping the job, which reaches the engine too)"
            )
        return RuntimeError(
            f"the zephon loader's engine process (pid {process.pid}) "
            f"{describe_exit(code)} before the end of the data; see its stderr. A training "
            "script that starts work at import time needs `if __name__ == \"__main__\":` "
            "(the engine is spawned and re-imports it), and a signal may mean the "
            "out-of-memory killer"
        )

    def _read(self, ref: shm.BlockRef) -> Any:
        """The batch of a block; its segment is unlinked at once and a credit sent."""
        return self._child.take(ref, self._directory)

    def close(self) -> None:
        """Stop the engine (politely, then SIGTERM, then SIGKILL) and sweep its segments."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            child = self._child
        if child is None:
            return
        # A stopped engine (SIGSTOP, a debugger; the loader's timeout= may be why it is
        # closed) could neither answer the stop nor handle SIGTERM: stop_children resumes it.
        killed = stop_children([child], _STOP_TIMEOUT, _TERM_TIMEOUT)
        shm.sweep_prefix(self._directory, self._prefix)
        if killed:  # its pool's segments are named after it, and it is dead now
            shm.sweep_stale(self._directory)
