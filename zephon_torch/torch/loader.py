"""``zephon_torch.DataLoader``: a drop-in for ``torch.utils.data.DataLoader`` over a pipeline.

Batching lives in the pipeline (``.batch(n)``), so the loader takes no
``batch_size`` or ``collate_fn``; it yields ``batch.to_training(**kwargs)``
dicts of tensors, optionally pinned and moved to a device, and it saves and
restores its position like torchdata's ``StatefulDataLoader``::

    loader = DataLoader(pipe, num_workers=4, to_training={"return_labels": True},
                        device="cuda")
    for step, batch in enumerate(loader):
        loss = model(batch["input_ids"], labels=batch["labels"])
        ...
        if step % 1000 == 0:
            save({"model": ..., "data": loader.state_dict(gather=True)})

How one iteration is laid out (``num_workers=N >= 1``, the default runner ``"lanes"``)::

    lane worker w of N (forked)           training process
    ───────────────────────────           ─────────────────────────────────────────────────
    the pipeline of lanes w, w+N, ...     prefetch thread                main thread
    (source to batch), to_training        ───────────────                ───────────
    tensors -> one shm segment  ─shm──►   read + unlink the segment
                                          round-robin over the lanes,
                                          the books, state_dict()
                                          pin, .to(device, non_blocking)
                                          on a side CUDA stream
                                          queue (prefetch_factor) ────►  [vote: all ranks
                                                                          have a batch?]
                                                                         keep its state
                                                                         yield the batch

* **Where the work happens.** ``num_workers`` is the number of *lane
  workers*, as torch's worker processes are: worker ``w`` owns the rank's
  lanes at positions ``w, w + N, ...`` and runs their whole pipeline and
  ``to_training`` (``runners/lanes.py``); the main process only merges
  finished batches in the fixed lane order and keeps the position, so the
  batches are the same bytes as ``pipe.iter(runner="inline")`` for any
  ``N``. Workers are forked where torch forks its own (Linux), so a script
  that works with torch's loader needs no ``if __name__ == "__main__":``;
  elsewhere they are spawned (see ``runners/lanes.py``). ``num_workers=0``
  runs the pipeline in this process, on the prefetch thread (the inline
  runner). ``runner="process"`` (or ``"threads"``) runs the stage-parallel
  runner instead, in a spawned *engine process* of its own (see
  ``_loader_engine.py``): the better choice for a pipeline with fewer lanes
  than workers and heavy stages. ``in_process=True`` keeps that engine in
  this process too, for debugging.
* **Overlap.** A prefetch thread holds up to ``prefetch_factor`` placed
  batches: while the caller trains on batch ``n``, batch ``n+1`` is read,
  pinned and copied with ``non_blocking=True`` on a side CUDA stream; the
  caller's stream waits for that copy (an event, not a host sync) when the
  batch is handed over, and ``record_stream`` keeps the caching allocator
  from reusing its memory early.
* **State per batch.** Every batch comes with the iterator's state right
  after it. The loader keeps the state of the last batch *handed to the
  caller* (:class:`Position`), so :meth:`DataLoader.state_dict` never counts
  what was only prefetched (by the prefetch thread, or by the workers), and
  loading it into a fresh loader, with any ``num_workers``, continues exactly.
  In this process that state is a snapshot (``runners/snapshots.py``),
  taken for the price of the lanes whose books changed; the dict is built
  when :meth:`DataLoader.state_dict` asks for it.
* **Under Lightning.** ``Trainer.fit`` fetches one batch ahead of the
  training step and saves the train loader's ``state_dict()`` in its
  checkpoints. When that call comes from within Lightning's fit loop, the
  loader answers with the position before the batches Lightning's fetcher
  still holds (:class:`Position` remembers the states of its last few
  batches); once Lightning's epoch is over, it answers the start, where the
  next epoch's iteration begins. Under Lightning's DDP the checkpoint's
  state is gathered from every rank. How the fit loop is read lives in
  ``zephon_torch/_lightning_compat.py`` (``fit_loop_view``), the one module
  that knows Lightning's private fit-loop structure; it imports neither
  Lightning nor this module, and acts only on a Lightning already imported.
* **Uneven ranks.** Ranks may own different numbers of lanes, and lanes end
  at different times. With ``on_uneven="stop"`` and an initialized
  ``torch.distributed`` group, the main thread takes one vote per step
  before handing a batch over: an ``all_reduce(MIN)`` of "I have a batch",
  so every rank stops at the step where the first one runs out and no
  collective training step waits for a rank that has left. Its cost is one
  one-element all-reduce per step on a gloo group, on CPU so that no CUDA
  stream is synchronized: about 0.15 ms between two ranks of one host
  (measured on a 2-core VM), a network round trip or two across hosts; and
  the step waits for the slowest rank's data, which its gradient all-reduce
  would wait for anyway. When the default
  backend has no gloo (pure ``nccl``), a gloo group is created once,
  collectively, at the first iteration; if gloo is unavailable the vote
  goes through the default group on the current CUDA device and its
  ``.item()`` synchronizes that device once per step. ``"continue"`` lets
  each rank run to its own end.
  The stop ends the epoch on every rank: what a rank had not read of it is
  dropped (as ``drop_last`` does for torch's ``DistributedSampler``), and
  its state says so (that epoch, every lane ended, as the state of the rank
  that ran out), so the ranks agree on their epoch, their states gather, and
  a resume from them starts the next epoch as iterating again does. A rank
  with no batch at all stops every rank at step 0, with a warning on the
  ranks that had some; a rank whose pipeline fails makes the others raise
  too (see ``_loader_dist.py``).
* **Epochs.** Every iteration runs one epoch of the pipeline
  (``pipe.iter(epoch=n)``, see ``docs/epochs.md``): iterating again after
  the end (or after a ``break``) starts the next epoch from its beginning,
  in a new order derived from the seeds and the epoch, unless a state was
  loaded in between (it continues in the state's epoch). The loader's
  :class:`~zephon_torch.epochs.EpochCounter` is ``loader.sampler`` and
  ``loader.batch_sampler.sampler``, where torch code and Lightning 2.x call
  ``set_epoch(n)`` before each epoch; ``loader.set_epoch(n)`` is the same.
  States carry their epoch; a state saved after the end of an epoch makes
  the next iteration start the following epoch.
* **One iteration at a time.** A loader has one position, so it runs one
  iteration at a time. An iteration is *in progress* from its first batch
  until it ends, is closed, or its iterator is no longer referenced (a
  ``break`` drops the ``for`` loop's iterator). A new iterator that starts
  (its first ``next()``) while another is in progress is refused with a
  ``RuntimeError`` and changes nothing: ``next(iter(loader))`` inside the
  training loop neither ends that loop nor moves the position
  :meth:`DataLoader.state_dict` saves. A bare ``iter()`` is always
  allowed; when nothing is in progress it becomes the current iteration
  at once (so the position is where it will start). Threads change none
  of this: of two iterators whose first ``next()`` comes at the same moment
  from two threads, one starts and the other is refused (a lock covers the
  start), and ``next()`` on one iterator while another thread is in it is
  refused too. :meth:`DataLoader.load_state_dict` ends an iteration in progress, whose
  next ``next()`` then raises a ``RuntimeError`` rather than ending quietly.
* **Timeout.** ``timeout=`` (seconds, as in torch) bounds the wait for
  each batch in ``next()``; when it passes, the iteration ends, its
  processes are stopped, and a ``RuntimeError`` names the process that did
  not deliver (the lane worker waited for, the engine's pid, or the
  prefetch thread in process).
* **Lifetime.** The workers (or the engine process and its pool) start at
  the iteration's first ``next()`` (a bare ``iter()``, such as Lightning's
  check that the loader is iterable, starts nothing and leaves a loaded
  state in place). They stop when the iteration ends, when its iterator is
  closed (``close()``, a ``break`` followed by garbage collection, an
  exception leaving the ``for`` loop), when the loader is closed
  (``close()``, ``with``), and at interpreter exit (a ``multiprocessing``
  finalizer that runs before ``multiprocessing`` joins its non-daemonic
  children).
"""

from __future__ import annotations

import multiprocessing
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zephon_torch._lightning_compat import follow_fit_loops
from zephon_torch.checkpoint import fingerprint_parts
from zephon_torch.epochs import EpochCounter, check_epoch
from zephon_torch.pipeline import Pipeline
from zephon_torch.runners.options import RunOptions, check_loader_workers
from zephon_torch.runners.process import SigtermGuard
from zephon_torch.runners.registry import RUNNER_SPECS
from zephon_torch.topology import resolve_topology, warn_idle_workers
from zephon_torch.torch import _loader_state as _state
from zephon_torch.torch._loader_args import (
    _UNEVEN,
    _check_kwargs,
    _check_timeout,
    _check_to_training,
    _resolve_pin,
    _resolve_runner,
)
from zephon_torch.torch._loader_dist import StepVote, check_peers, fingerprint_digest
from zephon_torch.torch._loader_engine import (
    EngineProcess,
    EngineSpec,
    InProcessProducer,
)
from zephon_torch.torch._loader_place import Placer, with_index
from zephon_torch.torch._loader_position import Position, _BatchSampler
from zephon_torch.torch._loader_run import _LoaderIterator, _Run
from zephon_torch.torch.dataset import pipeline_of

__all__ = ["DataLoader", "Position"]

#: Runners that run in an engine process of their own (unless in_process=True): those
#: whose stages run in a pool of their own, off the iterating thread.
_ENGINE_RUNNERS = tuple(name for name, spec in RUNNER_SPECS.items()
                        if spec.pool is not None and not spec.pool.on_this_thread)


# --------------------------------------------------------------------------- the loader


class DataLoader:
    """Iterates a pipeline's batches as training dicts, with an exact, saveable position.

    Args:
        pipeline: A :class:`~zephon_torch.Pipeline` (ending in ``.batch(n)``
            unless ``to_training=False``).
        num_workers: Worker processes, as torch's: with the default runner,
            lane workers, each running the whole pipeline and ``to_training``
            for the rank's lanes at positions ``w, w + N, ...`` (``0``: the
            pipeline runs in this process, on the prefetch thread); with
            ``runner="process"``, the stage-parallel pool's size.
        to_training: ``None``: ``batch.to_training()`` with its defaults; a
            dict: its keyword arguments; ``False``: yield the
            :class:`~zephon_torch.SampleBatch` itself.
        device: Where tensors go (``"cuda"``, ``"cuda:1"``, a
            ``torch.device``); copies use ``non_blocking=True``.
        pin_memory: Pin tensors before copying (``None``: pin when
            ``device`` is a CUDA device). Ignored, with a warning, without CUDA.
        prefetch_factor: Batches the prefetch thread prepares (pins, copies
            to ``device``) ahead of the caller; each worker may also have
            about ``prefetch_factor`` finished batches per lane it owns in
            transit in shared memory (torch's "per worker" meaning; the
            engine process of ``runner="process"``
            ``prefetch_factor * max(1, num_workers)``).
        runner: ``"lanes"`` (the default when ``num_workers > 0``; with
            ``task_timeout``, ``"process"``), ``"inline"`` (the default for
            ``num_workers=0``), or the stage-parallel ``"threads"`` or
            ``"process"``, which run in an engine process.
        in_process: Run a stage-parallel runner's engine in the training
            process (on the prefetch thread) instead of an engine process;
            for debugging. The other runners always run there.
        on_uneven: ``"stop"``: under an initialized ``torch.distributed``
            group every rank stops when the first runs out, and the rest of
            that epoch is dropped on every rank; ``"continue"``:
            each rank runs to its own end. No effect without distributed.
        rank, world_size: The topology (default: ``torch.distributed`` when
            initialized, else ``RANK``/``WORLD_SIZE``, else 0 and 1).
        timeout: Seconds ``next()`` waits for a batch before it ends the
            iteration with a ``RuntimeError`` naming the process it waited
            for (as torch's ``timeout``; ``0``, the default: wait as long as
            the workers live). The first batch's wait includes the start-up.
        epoch: The epoch of the first iteration (each further iteration runs
            the next one; ``set_epoch`` changes it, see ``docs/epochs.md``).
        deterministic: As for :meth:`Pipeline.iter`: ``False`` takes results
            as they complete (the order varies and nothing can checkpoint).
        microbatch_sizes: As for :meth:`Pipeline.iter`: ``{stage name:
            size}``, how much work a task carries (performance only).
        lanes: As for :meth:`Pipeline.iter`: read exactly these lanes instead
            of the rank's (tools and tests).
        verify: As for :meth:`Pipeline.iter`: at the end of the pass, check
            that every sample read was delivered or tombstoned exactly once.
        task_timeout: As for :meth:`Pipeline.iter`: with
            ``runner="process"``, seconds one micro-batch may run before its
            worker is killed and the micro-batch sent again (given without
            ``runner``, it selects the process runner).
        **torch_only: Not taken: torch's ``DataLoader`` arguments that do not
            apply here (``batch_size``, ``collate_fn``, ``sampler``, ...) are
            refused with a ``TypeError`` that says where that choice lives.

    Raises:
        TypeError: An argument of torch's DataLoader that does not apply
            here (``batch_size``, ``collate_fn``, ...), or an unknown one.
        ValueError: A bad value.

    Lane workers are forked on Linux (as torch's workers are), so a script
    needs no ``if __name__ == "__main__":``; where they are spawned (macOS,
    Windows, ``ZEPHON_LANES_START_METHOD=spawn``), and for the engine process
    of ``runner="process"``, the script is re-imported: keep its work under
    the guard (as for torch's loader with ``spawn``). Operators, user
    functions included, then travel by cloudpickle.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *args: Any,
        num_workers: int = 0,
        to_training: Mapping[str, Any] | bool | None = None,
        device: Any = None,
        pin_memory: bool | None = None,
        prefetch_factor: int = 2,
        runner: str | None = None,
        in_process: bool = False,
        on_uneven: str = "stop",
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float = 0,
        epoch: int = 0,
        deterministic: bool = True,
        microbatch_sizes: Mapping[str, int] | None = None,
        lanes: Sequence[int] | None = None,
        verify: bool = False,
        task_timeout: float | None = None,
        **torch_only: Any,
    ) -> None:
        if args:
            raise TypeError(
                "DataLoader takes the pipeline as its only positional argument: batching "
                "lives in the pipeline (end it with .batch(microbatch_size)), so there is no "
                "batch_size; pass the other options by keyword"
            )
        _check_kwargs(torch_only)
        # Pipeline.iter's own options, kept only where they differ from its defaults.
        iter_kwargs = {name: value for name, value, default in (
            ("deterministic", deterministic, True),
            ("microbatch_sizes", microbatch_sizes, None),
            ("lanes", lanes, None),
            ("verify", verify, False),
            ("task_timeout", task_timeout, None),
        ) if value is not default}
        self.pipeline = pipeline_of("zephon_torch.DataLoader", pipeline)
        self.num_workers = check_loader_workers(num_workers)
        self.runner = _resolve_runner(runner, self.num_workers, iter_kwargs.get("task_timeout"),
                                      self.pipeline)
        self.to_training = _check_to_training(to_training, self.pipeline)
        self.device = None if device is None else torch.device(device)
        self.pin_memory = _resolve_pin(pin_memory, self.device)
        if self.to_training is None and (self.device is not None or self.pin_memory):
            raise ValueError(
                "device=/pin_memory= place the tensors of to_training(); with "
                "to_training=False the loader yields SampleBatch objects, which hold none"
            )
        if not isinstance(prefetch_factor, int) or isinstance(prefetch_factor, bool) \
                or prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be a positive integer, got {prefetch_factor!r}")
        self.prefetch_factor = prefetch_factor
        self.in_process = bool(in_process)
        if on_uneven not in _UNEVEN:
            raise ValueError(f"on_uneven must be one of {list(_UNEVEN)}, got {on_uneven!r}")
        self.on_uneven = on_uneven
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.iter_kwargs = dict(iter_kwargs)
        self._fingerprint = self.pipeline.fingerprint()
        self._digest = fingerprint_digest(self._fingerprint)  # compared with the peers'
        self._position = Position()
        self._epochs = EpochCounter(check_epoch(epoch))
        self._batch_sampler = _BatchSampler(self._epochs)
        self._producer: Any = None  # the last iteration's producer, for stats()
        self._warned_idle = False  # more lane workers than lanes: said once
        self._loaded: dict[str, Any] | None = None  # waits for the next iteration
        # The current iteration's iterator (held weakly: a dropped iterator ends its run).
        self._active: weakref.ref[_LoaderIterator] | None = None
        # Held while an iteration is claimed or started, so that of two threads starting
        # at the same moment one starts and the other is refused (see the module doc).
        self._starting = threading.Lock()

    @property
    def timeout(self) -> float:
        """Seconds ``next()`` waits for a batch (``0``: no limit); read at every ``next()``."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = _check_timeout(value)

    @property
    def checkpointable(self) -> bool:
        """Whether :meth:`state_dict` can describe an exact position (``deterministic=True``)."""
        return bool(self.iter_kwargs.get("deterministic", True))

    @property
    def dataset(self) -> Pipeline:
        """The pipeline (the name torch's DataLoader uses)."""
        return self.pipeline

    # ------------------------------------------------------------------ epochs

    @property
    def sampler(self) -> EpochCounter:
        """The loader's epoch counter, where Lightning 2.x calls ``set_epoch`` (the order
        itself comes from the pipeline's seeds and the epoch)."""
        return self._epochs

    @property
    def batch_sampler(self) -> _BatchSampler:
        """Holds the same counter as ``.sampler`` (Lightning also looks there)."""
        return self._batch_sampler

    @property
    def epoch(self) -> int:
        """The epoch of the iteration in progress (before any: of the next one)."""
        return self._epochs.epoch

    def set_epoch(self, epoch: int) -> None:
        """Run ``epoch`` at the next iteration (a new, reproducible order per epoch).

        A state loaded before must be of that epoch, or the next iteration
        refuses it (a position of one epoch means other samples in another).
        """
        self._epochs.set_epoch(epoch)

    # ------------------------------------------------------------------ length

    def __len__(self) -> int:
        """Batches one epoch yields to this rank, when known without reading the data.

        ``Pipeline.num_batches`` for the loader's rank and world size (with
        ``on_uneven="stop"`` under an initialized ``torch.distributed`` group,
        the smallest over the ranks, where every rank stops).

        Raises:
            TypeError: The count depends on the data (torch's and
                Lightning's way of saying "no length"); the message says why.
        """
        rank, world_size = resolve_topology(self.rank, self.world_size)
        lanes = self.iter_kwargs.get("lanes")
        count = self.pipeline.num_batches(rank=rank, world_size=world_size, lanes=lanes)
        if count is None:
            raise TypeError(
                f"this zephon DataLoader has no len(): the number of batches depends on the data "
                f"({self.pipeline.num_batches_reason()}); train by steps (max_steps), see "
                "docs/epochs.md"
            )
        if self.on_uneven == "stop" and world_size > 1 and lanes is None \
                and torch.distributed.is_available() and torch.distributed.is_initialized():
            count = min(self.pipeline.num_batches(rank=r, world_size=world_size) or 0
                        for r in range(world_size))
        return count

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """The pipeline iterator's ``stats()`` of the iteration in progress (or the last).

        Throughput, data wait, per-lane and per-stage counts (see
        ``docs/observability.md``; ``zephon_torch.logs.metrics`` flattens it
        for a metrics logger).

        Raises:
            RuntimeError: No iteration has started yet, or the pipeline runs
                in an engine process (``runner="process"``/``"threads"``
                without ``in_process=True``), whose iterator is not here.
        """
        producer = self._producer
        if producer is None:
            raise RuntimeError(
                "this zephon DataLoader has not started an iteration yet: stats() describes the "
                "iteration in progress (or the last one); call it after the first batch"
            )
        source = getattr(producer, "iterator", None)
        if source is None:
            raise RuntimeError(
                f"stats() is not available with runner={self.runner!r} in an engine process: "
                "its pipeline iterator lives in another process. Pass in_process=True, or use "
                "the default lane workers (runner='lanes')"
            )
        return source.stats()

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> _LoaderIterator:
        # The iteration starts at its first next(): Lightning calls iter() once just to
        # check that the loader is iterable, which must neither start an engine process
        # nor use up a loaded state. While another iteration is in progress, the new
        # iterator changes nothing here; its first next() decides (see _begin).
        follow_fit_loops()  # a Lightning fit loop may iterate it: see fit_loop_view
        iterator = _LoaderIterator(self)
        with self._starting:
            if self._in_progress() is None:
                self._claim(iterator)
        return iterator

    def _in_progress(self) -> _LoaderIterator | None:
        """The current iteration, if it has started, not ended, and is still referenced."""
        active = self._active() if self._active is not None else None
        if active is not None and active.started and not active.done:
            return active
        return None

    def _claim(self, iterator: _LoaderIterator) -> None:
        """Make ``iterator`` the current iteration; the position is where it will start."""
        self._active = weakref.ref(iterator)
        self._position.reset(self._loaded)

    def _begin(self, iterator: _LoaderIterator) -> _Run:
        """Start ``iterator``'s run (its first next()), unless another iteration is in progress.

        Raises:
            RuntimeError: Another iterator of this loader has handed out
                batches, has not ended and is still referenced.
        """
        running = self._in_progress()
        if running is not None and running is not iterator:
            raise RuntimeError(
                f"this zephon DataLoader has an iteration in progress ({self._position.count} "
                "batch(es) handed out, not finished), and a loader runs one iteration at a time: "
                "starting another would end that one and move the position state_dict() saves. "
                "To look at a batch inside the training loop, use a second DataLoader over the "
                "same pipeline; to start over, let the first iteration end (run it out, break "
                "out of its loop, or call its close()) and drop references to its iterator"
            )
        if self._active is None or self._active() is not iterator:
            self._claim(iterator)
        return self._start()

    def _start(self) -> _Run:
        """Start the producer and prefetch thread of a new iteration (at its first next())."""
        rank, world_size = resolve_topology(self.rank, self.world_size)
        if self.on_uneven == "stop":  # the ranks run in step: check they run one pipeline
            check_peers(self._digest, self._epochs.next_epoch, rank, world_size,
                        lambda: fingerprint_parts(self._fingerprint, self.pipeline.stage_names()),
                        self._fingerprint)
        # The epoch of this iteration; a loaded state must be of it (set_epoch may have
        # chosen another since).
        epoch = self._epochs.begin(self._loaded)
        state, self._loaded = self._loaded, None
        self._position.reset(state)
        # The core's default pool size when a runner was named with num_workers=0.
        num_workers = self.num_workers or None
        prefetch = None
        if self.runner == "lanes" and self.num_workers:
            num_lanes = len(self._own_lanes())
            if self.num_workers > num_lanes:
                if not self._warned_idle:  # once per loader, at the caller's next()
                    self._warned_idle = True
                    warn_idle_workers(self.num_workers, num_lanes, stacklevel=4)
                num_workers = max(1, num_lanes)  # warned here, not again
            # As torch's prefetch_factor batches per worker: here per lane a worker owns
            # (a worker's messages carry its lanes' batches in turn).
            per_worker = -(-num_lanes // self.num_workers)
            prefetch = self.prefetch_factor * max(1, per_worker)
        options = RunOptions(runner=self.runner, rank=rank, world_size=world_size, epoch=epoch,
                             num_workers=num_workers, prefetch=prefetch, **self.iter_kwargs)
        spec = EngineSpec(pipeline=self.pipeline, iter_kwargs=options.as_kwargs(), state=state,
                          to_training=self.to_training)
        in_process = self.in_process or self.runner not in _ENGINE_RUNNERS
        if not in_process and multiprocessing.current_process().daemon:
            warnings.warn(
                "zephon DataLoader inside a daemonic process cannot start its engine process; "
                "running the pipeline in this process (in_process=True)",
                RuntimeWarning, stacklevel=3,
            )
            in_process = True
        guard = None
        if in_process:
            if self.runner == "process" and threading.current_thread() is threading.main_thread():
                # The pool starts on the prefetch thread, where no signal handler can be
                # installed: hold ours from here, so that SIGTERM still unlinks its segments.
                guard = SigtermGuard()
            producer: Any = InProcessProducer(spec)
        else:
            # As in torch, prefetch_factor batches per worker may be in flight: finished
            # batches waiting in shared memory absorb the pipeline's bursts (a chunk
            # tokenized, a packer flushing) without holding device memory.
            producer = EngineProcess(spec, self.prefetch_factor * max(1, self.num_workers))
        self._producer = producer
        vote = StepVote.create(rank, world_size) if self.on_uneven == "stop" else None
        placer = Placer(with_index(self.device), self.pin_memory)
        return _Run(producer, placer, self.prefetch_factor, vote, guard)

    def _end_active(self, reason: str | None = None) -> None:
        """End the current iteration; ``reason``: why, for an iterator in progress to raise."""
        active = self._active() if self._active is not None else None
        if active is not None and reason is not None and not active.started:
            return  # a bare iter(): it starts from the loaded state at its first next()
        self._active = None
        if active is not None:
            if reason is not None and not active.done:
                active.ended_by = f"{reason} after {self._position.count} batch(es)"
            active.close()

    # ------------------------------------------------------------------ checkpoints
    # Written in _loader_state.py and bound here, so that they read as the loader's own.

    state_dict = _state.state_dict
    load_state_dict = _state.load_state_dict
    _local_state = _state._local_state
    _state_before = _state._state_before
    _own_lanes = _state._own_lanes
    _fresh_state = _state._fresh_state
    # The state of an iteration the ranks voted to stop; a failed peer's message.
    _stopped = _state._stopped
    _peer_failed = _state._peer_failed

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """End the iteration in progress: stop its engine process and its workers."""
        self._end_active()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        engine = self.runner in _ENGINE_RUNNERS and not self.in_process
        where = "engine process" if engine else "in process"
        return (f"DataLoader({self.pipeline!r}, runner={self.runner!r}, "
                f"num_workers={self.num_workers}, {where}, device={self.device})")
