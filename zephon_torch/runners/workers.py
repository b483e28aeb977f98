"""Worker processes: where zephon starts, supervises and stops them, and the credit loop.

Three kinds of child process run zephon code, and all are started, watched
and stopped here:

* the process runner's pool workers (``process.py``, ``worker.py``): one
  task pipe down, one result pipe up, a supervisor thread in the parent;
* the lane workers of ``runner="lanes"`` (``lanes.py``);
* the DataLoader's engine process (``torch/_loader_engine.py``).

(Ray actors are started and restarted by Ray itself: ``ray.py``.)

**Starting.** :func:`start_child` makes the two one-way pipes, starts the
process with the start method asked for (``fork``, ``spawn`` or
``forkserver``; :func:`start_method` is the lane workers' choice) and closes
the child's ends in the parent at once, so that the parent sees end-of-file
when the child goes. A child calls :func:`child_signals` first: ``SIGINT``
is ignored in every child (Ctrl-C reaches the whole process group, and the
main process decides), and ``SIGTERM`` gets the disposition its kind needs.

**The credit loop.** A lane worker and the loader's engine are *producers*:
they make messages ahead of a consumer in the parent. :func:`serve_credits`
is their loop, with one protocol on the control pipe: the child produces a
message only while it holds a credit, starts with ``credits`` of them and
gets one :data:`CREDIT` back for each message the consumer takes
(:meth:`CreditChild.grant`), so at most ``credits`` messages (and their
shared-memory segments) wait in transit; :data:`STOP` ends it between two
messages. Each message's payload goes into a segment (``shm.Writer``) and
only its ref crosses the data pipe, as ``(kind, ref, *extra)``; the last
message (``("end", ...)``) needs no credit::

    parent (consumer)                          child (producer)
    ─────────────────                          ────────────────
                                               wait for a credit (or STOP)
                                               step(): a payload to ship, and/or the end
                                               payload -> segment
    recv (kind, ref, ...) ◄──────── data ───── (kind, ref, *extra); one credit spent
    read the segment, unlink it
    grant() ─────────────────────── control ─► one more credit
    stop_children() ─────────────── control ─► STOP: close and exit

**Supervision and shutdown.** :func:`describe_exit` words how a child
ended, for the errors that name it. :func:`stop_children` is the one stop
path of producers: it resumes a stopped child (``SIGCONT``), sends
:data:`STOP`, and :func:`reap` gives each child a grace period, then
``SIGTERM``, then ``SIGKILL``, joining them all. While children live, the
parent's ``SIGTERM`` handling (:func:`watch_sigterm`) tears them down with
:func:`kill_now` and unlinks their segments, where the signal's default
action would skip every ``finally``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import connection as mp_connection
from typing import Any, NamedTuple

from zephon_torch.runners import shm
from zephon_torch.runners.wire import PROTOCOL, Orphaned, recv_from_parent, send_to_parent

__all__ = [
    "CREDIT",
    "STOP",
    "CreditChild",
    "Ship",
    "SigtermGuard",
    "child_signals",
    "describe_exit",
    "exit_on_sigterm",
    "kill_now",
    "reap",
    "receive_job",
    "resume",
    "serve_credits",
    "start_child",
    "start_method",
    "stop_children",
    "unwatch_sigterm",
    "watch_sigterm",
]

#: Parent -> producer: one more message may be produced.
CREDIT = b"c"
#: Parent -> producer: stop between two messages (the pool's task pipe uses ``wire.STOP``).
STOP = b"s"
_START_METHOD_ENV = "ZEPHON_LANES_START_METHOD"
_START_METHODS = ("fork", "spawn", "forkserver")


# --------------------------------------------------------------------------- starting


def start_method() -> str:
    """How lane workers start: ``ZEPHON_LANES_START_METHOD``, else fork where the
    platform's default is fork (Linux), else spawn (see ``lanes.py``)."""
    chosen = os.environ.get(_START_METHOD_ENV)
    if chosen:
        if chosen not in _START_METHODS:
            raise ValueError(f"{_START_METHOD_ENV}={chosen!r}: use one of {list(_START_METHODS)}")
        return chosen
    if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods():
        return "fork"
    return "spawn"


def start_child(method: str, target: Callable[..., None], *, name: str, daemon: bool,
                args: Callable[[Any, Any, Any, Any], tuple]) -> tuple[Any, Any, Any]:
    """Start a child process with a pipe down to it and a pipe up from it.

    Args:
        method: The start method (``fork``, ``spawn``, ``forkserver``).
        target: The child's main function.
        name: The process name.
        daemon: Whether the child is a daemon (a daemon cannot start children).
        args: Makes ``target``'s arguments from the child's ends (down: receiving,
            up: sending) and the parent's ends (down: sending, up: receiving),
            in that order; a forked child gets the parent's ends to close them.

    Returns:
        The process, the parent's sending end down and its receiving end up.
        The child's ends are closed here once it has started: open in the
        parent, they would hide the child's end-of-file.
    """
    ctx = multiprocessing.get_context(method)
    down_r, down_w = ctx.Pipe(duplex=False)
    up_r, up_w = ctx.Pipe(duplex=False)
    process = ctx.Process(target=target, name=name, daemon=daemon,
                          args=args(down_r, up_w, down_w, up_r))
    try:
        process.start()
    finally:
        down_r.close()
        up_w.close()
    return process, down_w, up_r


def exit_on_sigterm(signum: int, frame: Any) -> None:
    """A child's ``SIGTERM`` handler that runs its clean-up: ``SystemExit(128 + signum)``."""
    # Once: the clean-up that SystemExit triggers must not be interrupted again.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def child_signals(sigterm: Any = None) -> None:
    """A child's signal dispositions: ``SIGINT`` ignored; ``SIGTERM`` set to ``sigterm``
    unless None (a handler, ``signal.SIG_DFL``: a forked child inherits the parent's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sigterm is not None:
        signal.signal(signal.SIGTERM, sigterm)


# --------------------------------------------------------------------------- the credit loop


def receive_job(control: Any, parent: int) -> Any:
    """What a spawned child is sent first (its job), unpickled; None: :data:`STOP` came first.

    Raises:
        Orphaned: The parent is gone.
    """
    message = recv_from_parent(control, parent)
    if message == STOP:
        return None
    return pickle.loads(message)


class Ship(NamedTuple):
    """A message a producer ships: ``(kind, ref, *extra)``, ``payload`` in a segment."""

    kind: str
    payload: Any
    extra: tuple = ()


def serve_credits(step: Callable[[], tuple[Ship | None, tuple | None]], control: Any,
                  data: Any, writer: shm.Writer, parent: int, credits: int) -> None:
    """A producer's loop: call ``step`` while credits last, until the end or :data:`STOP`.

    Args:
        step: Produces one step: a message to ship (None: nothing this time),
            and the end message (None: more may come), sent after it and
            without a credit.
        control: The child's receiving end of the control pipe.
        data: The child's sending end of the data pipe.
        writer: Writes each payload into a segment (or inline in its ref).
        parent: The parent's pid (a change means the parent is gone).
        credits: The credits at the start.

    After the end message it waits for :data:`STOP`, so that a parent that
    dies before reading what was sent still leaves it to this producer to sweep.

    Raises:
        Orphaned: The parent is gone (a segment being sent is discarded).
    """
    while True:
        # Wait for a credit before producing; take pending credits (or the stop) at once.
        while credits == 0 or control.poll():
            if recv_from_parent(control, parent) == STOP:
                return
            credits += 1
        ship, end = step()
        if ship is not None:
            kind, extra = ship.kind, ship.extra
            ref = writer.dump([ship.payload])
            del ship
            try:
                send_to_parent(data, pickle.dumps((kind, ref, *extra), protocol=PROTOCOL))
            except Orphaned:
                writer.discard(ref)
                raise
            credits -= 1
        if end is not None:
            send_to_parent(data, pickle.dumps(end, protocol=PROTOCOL))
            # What was sent may still wait in transit: stay until the parent says
            # STOP (it has read or swept it) or is gone (Orphaned: the caller sweeps).
            while recv_from_parent(control, parent) != STOP:
                pass
            return


class CreditChild:
    """The parent's side of a producer running :func:`serve_credits`.

    Attributes:
        process: The child process.
        control: The parent's sending end of the control pipe.
        data: The parent's receiving end of the data pipe.
    """

    def __init__(self, process: Any, control: Any, data: Any) -> None:
        self.process = process
        self.control = control
        self.data = data
        self._lock = threading.RLock()  # sends come from the consumer and from close (a GC)
        self._stopping = False

    def send(self, message: bytes) -> None:
        """Send ``message`` down, unless the child is stopping (a gone child is ignored:
        its consumer finds out reading)."""
        with self._lock:
            if self._stopping:
                return
            with contextlib.suppress(OSError):
                self.control.send_bytes(message)

    def grant(self) -> None:
        """Give the child one more credit (the consumer took a message)."""
        self.send(CREDIT)

    def take(self, ref: shm.BlockRef, directory: str) -> Any:
        """The payload of a message's ``ref``, copied out; its segment is unlinked at once
        and, once read, a credit goes back (:meth:`grant`).

        Raises:
            FileNotFoundError: The segment was removed before it was read.
        """
        try:
            payload = shm.load(ref, directory, copy=True)[0]
        finally:
            shm.unlink_ref(ref, directory)
        self.grant()
        return payload

    def stop(self) -> None:
        """Ask the child to stop: resume it if it was stopped, then :data:`STOP`."""
        with self._lock:
            self._stopping = True
            resume(self.process)
            with contextlib.suppress(OSError):
                self.control.send_bytes(STOP)

    def close_control(self) -> None:
        """Close the control pipe (once the child has been joined)."""
        with self._lock, contextlib.suppress(OSError):
            self.control.close()


def stop_children(children: Sequence[CreditChild], grace: float,
                  after_terminate: float) -> bool:
    """Stop producers: :data:`STOP`, then :func:`reap`; close their control pipes.

    Returns:
        Whether any had to be killed (``SIGKILL``).
    """
    for child in children:
        child.stop()
    killed = reap([child.process for child in children], grace, after_terminate)
    for child in children:
        child.close_control()
    return killed


# --------------------------------------------------------------------------- supervision


def resume(process: Any) -> None:
    """Let a stopped child (``SIGSTOP``, a debugger) run again, so that it can stop."""
    if process.is_alive():
        with contextlib.suppress(OSError):
            os.kill(process.pid, signal.SIGCONT)


def reap(processes: Sequence[Any], grace: float, after_terminate: float) -> bool:
    """Join child processes that were asked to stop, forcing the ones that do not.

    Each gets until ``grace`` seconds from now to end by itself, then
    ``SIGTERM`` and ``after_terminate`` more seconds, then ``SIGKILL``; all
    are joined when this returns.

    Returns:
        Whether any had to be killed.
    """
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    killed = False
    for process in processes:
        process.join(timeout=after_terminate)
        if process.is_alive():
            killed = True
            process.kill()
            process.join()
    return killed


def kill_now(processes: Sequence[Any], timeout: float = 5.0) -> None:
    """Kill child processes and wait up to ``timeout`` seconds to see them dead, from a
    ``SIGTERM`` handler: nothing is joined, so no lock is waited on for long."""
    sentinels = []
    for process in processes:
        with contextlib.suppress(Exception):
            process.kill()
            sentinels.append(process.sentinel)
    deadline = time.monotonic() + timeout
    while sentinels and time.monotonic() < deadline:
        done = mp_connection.wait(sentinels, max(0.0, deadline - time.monotonic()))
        sentinels = [s for s in sentinels if s not in done]


def describe_exit(code: int | None) -> str:
    """How a child process ended, for error messages (``code`` is its exitcode)."""
    if code is None:
        return "stopped answering (exit status unknown)"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# --------------------------------------------------------------------------- SIGTERM

# SIGTERM is what schedulers, torchrun and ``kill`` send. Its default action ends
# the process at once, with no ``finally`` and no finalizer, which would leave
# every segment of live workers in /dev/shm until some later pool's stale sweep
# (SIGINT does not have this problem: it raises KeyboardInterrupt and the pools
# close as the stack unwinds). So while workers live the main thread's SIGTERM
# handler is ours. It never swallows the signal:
#
# * if a Python handler was installed before ours (Lightning, a trainer, the
#   loader's engine process), that handler is called and decides: it may raise
#   (SystemExit, KeyboardInterrupt: the pools then close while the stack unwinds,
#   as on Ctrl-C) or return to stop gracefully later (the pools stay usable);
# * if the previous disposition was the default, the live workers are torn down
#   on the spot (killed, segments unlinked) and the signal is raised again with
#   the default action, so the process still dies by SIGTERM and its parent sees
#   the usual status.
#
# A SIGTERM that was ignored (SIG_IGN) or handled in C (no Python handler to
# chain to) stays as it is. The handler is put back when the last one closes,
# if nobody replaced ours meanwhile and the close happens on the main thread.
# What SIGTERM must clean up in this process (anything with a ``terminate_now()``:
# a pool's supervisor, a lane run's teardown, a guard).
_LIVE: set[Any] = set()
_sigterm_previous: Any = signal.SIG_DFL  # the disposition ours replaced when installed


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM while workers live: chain to an earlier Python handler, else tear down and die."""
    previous = _sigterm_previous
    if callable(previous):
        previous(signum, frame)
        return
    # The process is about to die by the default action: no second run of this
    # clean-up if the signal comes again meanwhile.
    signal.signal(signum, signal.SIG_IGN)
    for supervisor in list(_LIVE):
        with contextlib.suppress(Exception):
            supervisor.terminate_now()
    signal.signal(signum, signal.SIG_DFL)
    # raise_signal delivers to this thread before it returns; the default action
    # ends the whole process with the status a SIGTERM gives.
    signal.raise_signal(signum)
    raise SystemExit(128 + signum)  # not reached unless the signal was blocked


def watch_sigterm(supervisor: Any) -> None:
    """Count ``supervisor`` as live, installing our SIGTERM handler if we can."""
    global _sigterm_previous
    _LIVE.add(supervisor)
    # signal.signal works only on the main thread; workers started elsewhere are
    # still cleaned up by a handler installed for others, else not at all.
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current is None or current == signal.SIG_IGN:
        return  # already ours; or a C-level handler we could not chain; or ignored
    signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm_previous = current


def unwatch_sigterm(supervisor: Any) -> None:
    """Forget ``supervisor``; the last one puts the previous SIGTERM handler back."""
    _LIVE.discard(supervisor)
    if _LIVE or threading.current_thread() is not threading.main_thread():
        return  # off the main thread ours stays: with nothing live it only passes it on
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _sigterm_previous)
    # Otherwise someone replaced ours; _sigterm_previous stays, for a handler of
    # theirs that passes the signal on to ours.


class SigtermGuard:
    """Our SIGTERM handling, installed on the main thread for workers started on others.

    ``signal.signal`` works on the main thread only, so a pool started on
    another thread (the pipeline of an in-process ``zephon_torch.DataLoader``
    runs on its prefetch thread) cannot install the handler itself. A guard
    made on the main thread installs it for as long as the guard is held;
    the pools register themselves as live wherever they start, and the
    handler tears down whichever are live when the signal comes. The guard
    itself owns nothing to tear down.
    """

    def __init__(self) -> None:
        watch_sigterm(self)

    def terminate_now(self) -> None:
        """Nothing of its own: the live pools are torn down by the handler."""

    def release(self) -> None:
        """Stop holding the handler (it is put back when nothing else holds it)."""
        unwatch_sigterm(self)
