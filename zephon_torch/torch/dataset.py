"""A pipeline as a stateful torch ``IterableDataset``.

:class:`TorchIterableDataset` is what ``pipe.to_torch_dataset()`` returns. It
keeps the :class:`~zephon_torch.Pipeline` an immutable description and holds
the one thing that changes, the *live* iterator, plus a state waiting to be
resumed from.

**Lanes per worker.** Outside a DataLoader worker, ``iter(dataset)`` runs the
rank's lanes. Inside worker ``w`` of ``N`` it runs ``rank_lanes[w::N]`` (on
the inline runner unless ``runner=`` says otherwise: a torch worker is
already a process of its own). torch asks its workers round-robin, so with
lanes that produce equally the loader's order is our own iterator's order.

**Checkpoints.** ``state_dict()`` is the live iterator's state: the position
after the last item it handed out. ``load_state_dict(state)`` stores the state
and the next ``iter()`` loads it into the new iterator, which takes its own
lanes (a state holding more lanes, a merged global one for instance, is
fine). That is all torchdata's ``StatefulDataLoader`` needs, in both of its
modes:

* ``num_workers=0``: it calls ``state_dict()`` on the dataset in the main
  process, and on restore ``load_state_dict`` then ``iter()``;
* ``num_workers=N``: each worker process calls ``state_dict()`` on its own
  copy of the dataset after each item it produces and ships the state with
  the item; the loader keeps, per worker, the state that came with the last
  item the *caller* received. On restore each worker gets its own state back
  (``load_state_dict`` before ``iter()``), holding exactly its lanes.

A worker that owns no lane has nothing to save: its state is ``{}``, and
loading ``{}`` means "start fresh". :func:`merged_state` turns a loader's
checkpoint (per-worker states nested inside torchdata's own dict) into one
global pipeline state, for ``pipe.iter().load_state_dict`` or any other
worker count.

Between a load and the first item the live iterator hands out, its
``state_dict()`` is the loaded state itself, narrowed to the iterator's
lanes (``PipelineIterator`` keeps that position; nothing here does).

**One iteration at a time.** The dataset has one position, so it runs one
iteration at a time. An iteration is *in progress* from its first item
until it ends, or until nothing references its iterator any more (a torch
loader's iterator dropped after a ``break``). ``iter(dataset)`` while one is
in progress returns an iterator that waits: at its first ``next()`` it takes
over if the other has ended or been dropped by then, and is refused with a
``RuntimeError`` if not (``next(iter(loader))`` inside a loop over a torch
``DataLoader`` with ``num_workers=0``, which calls ``iter(dataset)``), so
the running loop neither ends early nor has its saved position moved.
``state_dict()`` settles the same question: torchdata's
``StatefulDataLoader`` creates the new epoch's iterator while it still
holds the previous one, and drops that one right after. Threads change
none of this: a lock covers ``iter()`` and an iteration's start (up to its
first item), so of two iterators started at the same moment from two
threads one runs and the other is refused.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.utils.data

from zephon_torch.checkpoint import merge_states
from zephon_torch.epochs import check_epoch
from zephon_torch.pipeline import Pipeline
from zephon_torch.runners.options import ITER_KWARGS
from zephon_torch.sources.lane_plan import lane_count
from zephon_torch.topology import owned_lanes, resolve_topology, worker_lanes

if TYPE_CHECKING:
    from zephon_torch.runners.iterator import PipelineIterator

__all__ = ["LiveIterator", "TorchIterableDataset", "merged_state"]

_STATE_KEYS = frozenset({"version", "fingerprint", "lanes", "checksum"})


def check_iter_kwargs(iter_kwargs: Mapping[str, Any], owner: str = "Pipeline.iter",
                      allowed: Sequence[str] = ITER_KWARGS) -> None:
    """Raise ValueError for a keyword ``Pipeline.iter`` (or ``allowed``) does not take."""
    unknown = sorted(set(iter_kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"unknown iter() argument(s) {unknown}; {owner} takes {sorted(allowed)}")


def pipeline_of(owner: str, value: Any) -> Pipeline:
    """The pipeline a torch wrapper was given: a ``Pipeline``, or ``pipe.to_torch_dataset()``.

    Raises:
        TypeError: ``value`` is neither (named with ``owner``, the wrapper).
    """
    if isinstance(value, Pipeline):
        return value
    inner = getattr(value, "pipeline", None)  # pipe.to_torch_dataset()
    if isinstance(inner, Pipeline):
        return inner
    raise TypeError(f"{owner} takes a zephon_torch.Pipeline (or pipe.to_torch_dataset()), got "
                    f"{type(value).__name__}; for other datasets use torch's own classes")


def checked_pipeline(owner: str, pipeline: Any, iter_kwargs: Mapping[str, Any]) -> Pipeline:
    """The common constructor checks of the torch wrappers: a Pipeline and valid kwargs."""
    pipeline = pipeline_of(owner, pipeline)
    check_iter_kwargs(iter_kwargs)
    return pipeline


def is_pipeline_state(value: Any) -> bool:
    """Whether ``value`` looks like a ``PipelineIterator.state_dict()``."""
    return isinstance(value, Mapping) and set(value) >= _STATE_KEYS


class LiveIterator:
    """A :class:`PipelineIterator` and whether it has started handing out items.

    Deliberately not "stateful" in torchdata's sense (no ``state_dict`` /
    ``load_state_dict``): the dataset answers for it, so a loader saves the
    position once, not twice. The position itself is the iterator's
    ``state_dict()`` (the loaded state until the first item).

    Args:
        iterator: A fresh iterator, with its resume state already loaded if any.
    """

    def __init__(self, iterator: PipelineIterator) -> None:
        self.iterator = iterator
        self.pid = os.getpid()
        self.handed = 0  # items handed out
        self.ended = False  # ran out, raised, or closed

    def __iter__(self) -> LiveIterator:
        return self

    def __next__(self) -> Any:
        try:
            item = next(self.iterator)
        except BaseException:
            self.ended = True
            raise
        self.handed += 1
        return item

    @property
    def in_progress(self) -> bool:
        """Whether it has handed out items and has not ended."""
        return self.handed > 0 and not self.ended

    def position(self) -> dict[str, Any]:
        """The state after the last item handed out (the resume state before any)."""
        # torchdata snapshots after every item: under deterministic=False a state that
        # refuses to load (and a warning) rather than an error that stops the iteration.
        return self.iterator.state_for_snapshot()

    def close(self) -> None:
        """Release the iterator's workers, unless they belong to another process."""
        self.ended = True
        # A forked DataLoader worker inherits this object but not its threads or
        # child processes: closing them there could wait forever.
        if self.pid == os.getpid():
            self.iterator.close()


class _DatasetIterator:
    """What ``iter(dataset)`` returns: one iteration, started when the dataset lets it.

    The dataset holds it weakly: once nothing else references it, its
    iteration no longer counts as in progress.
    """

    def __init__(self, dataset: TorchIterableDataset, live: LiveIterator | None) -> None:
        self._dataset = dataset
        self.live = live  # None: waits for the iteration in progress (see the module doc)

    def __iter__(self) -> _DatasetIterator:
        return self

    def __next__(self) -> Any:
        if self.live is not None and self.live.handed:
            return next(self.live)
        # Not started yet: the start and the first item under the dataset's lock, so that
        # another thread starting meanwhile finds this iteration in progress.
        with self._dataset._lock:
            if self.live is not None and self.live.handed == 0 \
                    and self.live is not self._dataset._live:
                self.live = None  # a newer iter() replaced it before it started: start afresh
            if self.live is None:
                self._dataset._take_over(self)  # refuses while another is in progress
                if self.live is None:  # the dataset owns no lane here
                    raise StopIteration
            return next(self.live)


class TorchIterableDataset(torch.utils.data.IterableDataset):
    """A pipeline as a torch ``IterableDataset``, with ``state_dict``/``load_state_dict``.

    Args:
        pipeline: The pipeline to run.
        **iter_kwargs: Passed to :meth:`Pipeline.iter` (``runner``,
            ``num_workers``, ``deterministic``, ``rank``, ``world_size``,
            ``microbatch_sizes``, ``lanes``, ``epoch``). Inside a torch
            DataLoader worker ``runner`` defaults to ``"inline"`` and ``lanes``
            to the worker's share of the rank's lanes.

    Epochs follow Hugging Face's ``IterableDataset``: :meth:`set_epoch` chooses
    the epoch the next iterations run (a new, reproducible order, see
    ``docs/epochs.md``); nothing advances it by itself. A torch DataLoader
    with workers copies the dataset into them at every ``iter(loader)``, so
    call ``set_epoch`` before that (not with ``persistent_workers=True``,
    whose workers keep their first copy).

    Raises:
        TypeError: ``pipeline`` is not a :class:`~zephon_torch.Pipeline`.
        ValueError: An unknown keyword for ``Pipeline.iter``.
    """

    def __init__(self, pipeline: Pipeline, **iter_kwargs: Any) -> None:
        super().__init__()
        self.pipeline = checked_pipeline("TorchIterableDataset", pipeline, iter_kwargs)
        self.iter_kwargs = dict(iter_kwargs)
        self._epoch: int | None = None  # set_epoch's, else iter_kwargs' (or the state's)
        self._pending: dict[str, Any] | None = None
        self._live: LiveIterator | None = None
        # The iterator handed out for _live, and the latest one waiting to take over.
        self._owner: weakref.ref[_DatasetIterator] | None = None
        self._waiting: weakref.ref[_DatasetIterator] | None = None
        self._lock = threading.RLock()  # iter() and starts (see the module doc)

    # ------------------------------------------------------------------ epochs

    def set_epoch(self, epoch: int) -> None:
        """Run ``epoch`` from the next ``iter()`` on (Hugging Face's ``set_epoch``).

        A loaded state must be of that epoch: the next ``iter()`` refuses
        another epoch's state (a position of one epoch means other samples
        in another).

        Raises:
            ValueError: ``epoch`` is not an integer >= 0.
        """
        self._epoch = check_epoch(epoch)

    @property
    def epoch(self) -> int | None:
        """The epoch :meth:`set_epoch` chose (None: ``iter_kwargs``' or a loaded state's)."""
        return self._epoch

    # ------------------------------------------------------------------ iteration

    def _plan(self) -> tuple[list[int], dict[str, Any]]:
        """The lanes this process runs, and the keywords for ``Pipeline.iter``."""
        kwargs = dict(self.iter_kwargs)
        if self._epoch is not None:
            kwargs["epoch"] = self._epoch
        explicit = kwargs.pop("lanes", None)
        num_lanes = lane_count(self.pipeline.source)
        share = worker_lanes(num_lanes, kwargs.get("rank"), kwargs.get("world_size"), explicit)
        if share is not None:
            kwargs.setdefault("runner", "inline")
            return share, kwargs
        rank, world_size = resolve_topology(kwargs.get("rank"), kwargs.get("world_size"))
        return owned_lanes(num_lanes, rank, world_size, explicit), kwargs

    def __iter__(self) -> Iterator[Any]:
        """A new iterator over this process's lanes, resuming a loaded state if any.

        While another iteration is in progress, the iterator starts at its
        first ``next()``, and only if that one has ended by then (see the
        module doc).
        """
        handle = _DatasetIterator(self, None)
        with self._lock:
            if self._in_progress() is not None:
                self._waiting = weakref.ref(handle)
                return handle
            self._claim(handle)
        if handle.live is None:
            return iter(())
        return handle

    def _in_progress(self) -> _DatasetIterator | None:
        """The iterator of the iteration in progress, if anything still references it."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner.live is self._live and self._live is not None \
                and self._live.in_progress and self._live.pid == os.getpid():
            return owner
        return None

    def _claim(self, handle: _DatasetIterator) -> None:
        """End the current iteration and start ``handle``'s (from a loaded state, if any)."""
        self._drop_live()
        self._waiting = None
        lanes, kwargs = self._plan()
        pending, self._pending = self._pending, None
        if not lanes:
            return
        iterator = self.pipeline.iter(lanes=lanes, **kwargs)
        if pending is not None:
            try:
                iterator.load_state_dict(pending)
            except BaseException:
                iterator.close()
                raise
        handle.live = self._live = LiveIterator(iterator)
        self._owner = weakref.ref(handle)

    def _take_over(self, handle: _DatasetIterator) -> None:
        """Start a waiting ``handle`` at its first ``next()``.

        Raises:
            RuntimeError: Another iteration is still in progress.
        """
        running = self._in_progress()
        if running is not None:
            raise RuntimeError(
                f"this zephon TorchIterableDataset has an iteration in progress "
                f"({running.live.handed if running.live else 0} item(s) handed out, not "
                "finished), and a dataset runs one iteration at a time: starting another would "
                "end that one and move the position state_dict() saves. A torch DataLoader "
                "with num_workers=0 calls iter(dataset) at every iter(loader), so "
                "next(iter(loader)) inside the training loop lands here: to look at a batch, "
                "use a second loader over pipe.to_torch_dataset(); to start over, let the "
                "first iteration end (run it out or break out of its loop) and drop references "
                "to its iterator"
            )
        self._claim(handle)

    def _settle(self) -> None:
        """Let a waiting iterator take over if the iteration in progress was dropped unfinished.

        (An iteration that ran out keeps its end as the position until the
        waiting iterator's first ``next()``, as after any finished pass.)
        """
        waiting = self._waiting() if self._waiting is not None else None
        if waiting is None or waiting.live is not None:
            self._waiting = None
            return
        owner = self._owner() if self._owner is not None else None
        if owner is None and self._live is not None and self._live.in_progress \
                and self._live.pid == os.getpid():
            self._claim(waiting)

    def _drop_live(self) -> None:
        if self._live is not None:
            self._live.close()
            self._live = None
        self._owner = None

    def close(self) -> None:
        """Release the live iterator's workers (it is also released when it ends)."""
        self._drop_live()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from, as JSON-able builtins.

        The live iterator's position (after the last item it handed out);
        before any iteration, the state waiting to be loaded, else the
        start of this process's lanes; ``{}`` for a DataLoader worker that
        owns no lane. An iterator waiting for an iteration in progress that
        has meanwhile been dropped takes over first (see the module doc).
        """
        with self._lock:
            self._settle()
        live = self._live
        if live is not None and live.pid == os.getpid():
            return live.position()
        if self._pending is not None:
            return dict(self._pending)
        lanes, kwargs = self._plan()
        if not lanes:
            return {}
        kwargs["runner"] = "inline"  # a state needs no worker pool
        with self.pipeline.iter(lanes=lanes, **kwargs) as start:
            return start.state_for_snapshot()  # the state_dict() unless deterministic=False

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume from ``state`` at the next ``iter()``.

        Args:
            state: A pipeline state (one rank's, one worker's or a merged
                global one), a sequence of such states (merged here with
                :func:`~zephon_torch.checkpoint.merge_states`), or ``{}``
                (start fresh).

        Raises:
            ValueError: ``state`` is none of these.
        """
        if isinstance(state, Mapping):
            if not state:
                self._pending = None
                return
            if not is_pipeline_state(state):
                raise ValueError(
                    f"not a pipeline state (keys {sorted(state)[:6]}); to restore a torchdata "
                    "StatefulDataLoader, call the loader's load_state_dict, or turn its state "
                    "into a pipeline state with zephon_torch.torch.dataset.merged_state()"
                )
            self._pending = dict(state)
            return
        states = [s for s in state if s]
        if not states or not all(is_pipeline_state(s) for s in states):
            raise ValueError("load_state_dict takes a pipeline state or a sequence of them")
        self._pending = merge_states(states) if len(states) > 1 else dict(states[0])

    def __getstate__(self) -> dict[str, Any]:
        # The live iterator (threads, pools) stays in the process that made it.
        state = dict(self.__dict__)
        state["_live"] = state["_owner"] = state["_waiting"] = state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"TorchIterableDataset({self.pipeline!r})"


def merged_state(checkpoint: Any) -> dict[str, Any]:
    """One global pipeline state out of a loader's checkpoint.

    Collects every pipeline state nested in ``checkpoint`` (a torchdata
    ``StatefulDataLoader.state_dict()``, with one state per worker, or a list
    of states) and merges them, so the position can be loaded by
    ``pipe.iter()``, another worker count or another world size.

    Raises:
        ValueError: No pipeline state inside, two states share a lane, or the
            checkpoint records steps taken after its last snapshot (save with
            ``snapshot_every_n_steps=1``, the default, to merge).
    """
    found: list[Mapping[str, Any]] = []

    def walk(value: Any) -> None:
        if is_pipeline_state(value):
            found.append(value)
        elif isinstance(value, Mapping):
            # torchdata names the key with a leading underscore; accept both spellings.
            behind = value.get("_steps_since_snapshot") or value.get("steps_since_snapshot")
            if behind:
                raise ValueError(
                    f"the checkpoint was taken between snapshots (steps_since_snapshot="
                    f"{behind}): its pipeline states are behind the loader; save with "
                    "snapshot_every_n_steps=1 to merge them"
                )
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(checkpoint)
    if not found:
        raise ValueError("the checkpoint holds no pipeline state")
    return merge_states(found)
