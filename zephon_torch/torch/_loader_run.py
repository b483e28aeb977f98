"""One iteration of a :class:`~zephon_torch.torch.loader.DataLoader`: its run and its iterator.

:class:`_Run` holds what one iteration owns (the producer, the prefetch thread
and its queue); :class:`_LoaderIterator` hands the batches over to the caller,
with the per-step vote of the ranks. The iterator reaches its loader only
through the members named by :class:`_Loader`, so this module does not import
the loader's.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import queue
import threading
import time
import weakref
from typing import Any, Protocol

from zephon_torch.runners.process import SigtermGuard
from zephon_torch.torch._loader_dist import BATCH, END, FAILED, StepVote
from zephon_torch.torch._loader_engine import InProcessProducer
from zephon_torch.torch._loader_place import Placer
from zephon_torch.torch._loader_position import Position

__all__: list[str] = []


_POLL = 0.1  # seconds between liveness checks while a thread waits on a queue


class _Run:
    """The resources of one iteration: producer, prefetch thread, queue.

    Kept apart from :class:`_LoaderIterator` (which only holds it) so that the
    iterator can be garbage-collected while the thread runs: its finalizer
    then closes the run.
    """

    def __init__(self, producer: Any, placer: Placer, prefetch_factor: int,
                 vote: StepVote | None, guard: SigtermGuard | None = None) -> None:
        self.producer = producer
        self.guard = guard  # SIGTERM handling for a pool on the prefetch thread
        self.placer = placer
        self.vote = vote
        self.queue: queue.Queue[tuple] = queue.Queue(maxsize=prefetch_factor)
        self.stopping = threading.Event()
        self.closed = False
        self.timed_out = False  # the caller gave up waiting: the thread may be stuck
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._prefetch, name="zephon-loader-prefetch",
                                       daemon=True)
        _LIVE_RUNS.add(self)
        self.thread.start()

    def _prefetch(self) -> None:
        events = None
        final: tuple = ("gone",)  # what the caller sees if the loop ends without an end
        try:
            events = self.producer.events()
            for event in events:
                if event[0] == "end":
                    final = event
                    break
                payload, ready = self.placer.place(event[1])
                if not self._put(("batch", payload, event[2], ready)):
                    return
        except BaseException as exc:
            final = ("error", exc)
        finally:
            if events is not None:
                with contextlib.suppress(Exception):
                    events.close()  # in process: closes the pipeline iterator, here
        self._put(final)

    def _put(self, item: tuple) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def get(self, timeout: float = 0) -> tuple:
        """The next event, waiting as long as the prefetch thread lives (at most ``timeout`` s).

        Args:
            timeout: Seconds to wait; ``0``: no limit. When it passes, the
                event is an ``("error", RuntimeError)`` naming the producer.
        """
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            wait = _POLL if deadline is None else min(_POLL, max(0.0, deadline - time.monotonic()))
            try:
                return self.queue.get(timeout=wait)
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    return ("gone",)
                if deadline is not None and time.monotonic() >= deadline:
                    self.timed_out = True
                    return ("error", RuntimeError(self._timed_out(timeout)))

    def _timed_out(self, timeout: float) -> str:
        """The message of a batch that did not come within ``timeout`` seconds."""
        in_process = isinstance(self.producer, InProcessProducer)
        if in_process:
            who, pid = self.producer.describe_wait()
        else:
            pid = self.producer.pid
            who = (f"the loader's engine process (pid {pid})" if pid is not None
                   else "the loader's engine process (still starting)")
        where = f"`py-spy dump --pid {pid}` shows where it is; " if pid is not None else ""
        if in_process and self.producer.worker_pids():
            ended = "the iteration is ended and the workers stopped"
        elif in_process:
            ended = "the iteration is ended"
        else:
            ended = "the iteration is ended and the engine stopped"
        return (
            f"zephon DataLoader timed out after {timeout:g} seconds waiting for a batch from "
            f"{who}: it is stuck (a deadlock, a read that never returns), stopped (SIGSTOP, a "
            f"debugger) or slower than that; {ended}. {where}raise timeout= if batches "
            "legitimately take longer"
        )

    def close(self) -> None:
        """Stop the producer and the thread; idempotent, from any thread."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.stopping.set()
        self.producer.close()
        with contextlib.suppress(queue.Empty):  # unblock a put, drop prefetched batches
            while True:
                self.queue.get_nowait()
        if self.thread is not threading.current_thread():
            # After a timeout the thread may be stuck in the pipeline (in process): it ends
            # by itself, closing the pipeline iterator, when that call returns.
            self.thread.join(timeout=_POLL if self.timed_out else 10.0)
        if self.guard is not None:
            self.guard.release()
        _LIVE_RUNS.discard(self)


_LIVE_RUNS: weakref.WeakSet[_Run] = weakref.WeakSet()


def _close_live_runs() -> None:
    for run in list(_LIVE_RUNS):
        with contextlib.suppress(Exception):
            run.close()


# At exit, multiprocessing runs its finalizers of priority >= 0 *before* it joins
# the non-daemonic children (our engines): this one stops them first, so that the
# join cannot wait forever on an engine that is still producing.
multiprocessing.util.Finalize(None, _close_live_runs, exitpriority=100)


class _Loader(Protocol):
    """What :class:`_LoaderIterator` uses of its loader (a ``DataLoader``)."""

    _position: Position
    _starting: threading.Lock
    timeout: float

    def _begin(self, iterator: _LoaderIterator) -> _Run: ...

    def _stopped(self) -> None: ...

    def _peer_failed(self, step: int) -> str: ...



class _LoaderIterator:
    """The iterator of one pass over a :class:`DataLoader` (see the module doc).

    Its run (producer, prefetch thread) starts at the first ``next()``, if
    no other iteration of the loader is in progress then.
    """

    def __init__(self, loader: _Loader) -> None:
        self._loader = loader
        self._position = loader._position
        self._run: _Run | None = None
        self._done = False
        self.ended_by: str | None = None  # what ended the iteration while it was in progress
        self._finalizer: weakref.finalize | None = None
        self._busy = threading.Lock()  # held by the thread in next()

    @property
    def started(self) -> bool:
        """Whether the run has started (the first ``next()`` was accepted)."""
        return self._run is not None

    @property
    def done(self) -> bool:
        """Whether the iteration has ended (run out, failed, or closed)."""
        return self._done

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (None in process, or before it started)."""
        return getattr(self._run.producer, "pid", None) if self._run is not None else None

    @property
    def worker_pids(self) -> list[int]:
        """The lane workers' pids (none before the run started, or for other runners)."""
        if self._run is None or not isinstance(self._run.producer, InProcessProducer):
            return []
        return self._run.producer.worker_pids()

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> Any:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "next() on an iterator of a zephon DataLoader while another thread is in "
                "next() on it: an iterator hands out its batches in one order, to one thread "
                "at a time. Iterate in one thread and pass the batches on (a queue.Queue)"
            )
        try:
            if self.ended_by is not None:
                raise RuntimeError(
                    f"this iteration of the zephon DataLoader was ended by {self.ended_by}; the "
                    "loaded state applies to a new iteration: iterate the loader again (for batch "
                    "in loader) to continue from it"
                )
            if self._done:
                raise StopIteration
            run = self._run
            if run is None:
                with self._loader._starting:  # one thread starts; the others see it in progress
                    run = self._loader._begin(self)  # refuses while another is in progress
                    self._run = run
                    self._finalizer = weakref.finalize(self, run.close)
            event = run.get(self._loader.timeout)
            kind = event[0]
            vote = run.vote
            # Every rank votes at every step, errors and ends included, so that no rank
            # is left waiting in a collective for one that has stopped.
            if vote is not None:
                have = BATCH if kind == "batch" else END if kind == "end" else FAILED
                agreed = vote.agree(have)
                if agreed == FAILED and kind in ("batch", "end"):
                    self.close()  # the job fails: no position to keep for it
                    raise RuntimeError(self._loader._peer_failed(self._position.count))
                if agreed == END and kind == "batch":
                    raise self._finish(None)
            if kind != "batch":
                raise self._finish(event)
            _, payload, state, ready = event
            self._position.hand(state)
            return run.placer.hand_over(payload, ready)
        finally:
            self._busy.release()

    def _finish(self, event: tuple | None) -> BaseException:
        """End the iteration; what to raise after ``event`` (None: the ranks voted to stop)."""
        self._done = True
        self.close()
        if event is None:
            self._loader._stopped()
            return StopIteration()
        if event[0] == "end":
            self._position.state = event[1]
            return StopIteration()
        if event[0] == "error":
            return event[1]
        return RuntimeError("the zephon loader's prefetch thread ended without a result")

    def close(self) -> None:
        """Stop the engine process and the prefetch thread (the generator-style close)."""
        self._done = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> _LoaderIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
