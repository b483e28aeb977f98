"""What a :class:`~zephon_torch.torch.loader.DataLoader` saves and loads: its state.

The loader's checkpoint methods, written here as functions over ``self`` and
bound in ``DataLoader``'s body (as ``Pipeline``'s builders are, see
``zephon_torch/_builder.py``), so that they read as the loader's own in
``help()``, in Python's messages and in the API reference:
:meth:`~DataLoader.state_dict` (this rank's state, or every rank's gathered
and merged), :meth:`~DataLoader.load_state_dict` (checked against this
pipeline and this rank's lanes), the state of an iteration the ranks voted
to stop, and the message of a rank whose peer failed (see
``_loader_dist.py``).

They use of the loader only its options (``pipeline``, ``rank``,
``world_size``, ``iter_kwargs``, ``checkpointable``), its records
(``_position``, ``_epochs``, ``_loaded``, ``_fingerprint``) and
``_end_active``; this module does not import the loader's.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from zephon_torch._lightning_compat import FitView, fit_loop_view
from zephon_torch.checkpoint import check_state, merge_states, refuse_nondeterministic
from zephon_torch.epochs import state_epoch
from zephon_torch.runners.resume import (
    check_lanes_present,
    check_resumable,
    narrow_state,
    with_grown_lanes,
)
from zephon_torch.runners.snapshots import StateSnapshot
from zephon_torch.sources.lane_plan import lane_count
from zephon_torch.topology import owned_lanes, resolve_topology
from zephon_torch.torch._loader_dist import gather as gather_states
from zephon_torch.torch._loader_dist import stopped_state

__all__: list[str] = []

F = TypeVar("F", bound=Callable[..., Any])


def _loader_method(fn: F) -> F:
    """``fn``, a method of ``DataLoader`` written outside the class, named as one."""
    fn.__qualname__ = f"DataLoader.{fn.__name__}"
    return fn


# ------------------------------------------------------------------ checkpoints


@_loader_method
def state_dict(self, *, gather: bool | None = None) -> dict[str, Any]:
    """The pipeline's position after the last batch handed to the caller.

    Args:
        gather: ``True``: under an initialized ``torch.distributed``
            group with more than one rank (and this loader's rank and
            world size being the group's), all-gather every rank's state
            (a collective: call it on every rank, over gloo, see the
            module doc) and return their
            :func:`~zephon_torch.checkpoint.merge_states`, which any
            world size can load. ``False``: this rank's state. ``None``
            (the default): gather only when Lightning's fit loop saves
            this loader in a checkpoint, which it does on every rank;
            otherwise this rank's state.

    Returns:
        A JSON-able dict (the pipeline iterator's ``state_dict()``
        format): before any batch, the start of the next iteration (a
        loaded state, or the beginning); after the last, the end.

    Raises:
        RuntimeError: Under Lightning, its fetcher holds more batches of
            this loader than the loader remembers the states of.
        NotCheckpointableError: The loader runs with ``deterministic=False``.

    While Lightning's ``Trainer.fit`` iterates this loader as its train
    loader, the caller is the training step rather than Lightning's
    fetcher: the answer is the position after the last batch the
    fetcher passed on (the batches it prefetched do not count), or, once
    Lightning's epoch is over, the start of the next epoch's iteration.
    Under Lightning's DDP, where only rank 0 writes the checkpoint, the
    state Lightning saves is gathered (``gather=None``): each rank first
    answers for the batches its own fetcher holds, then the ranks merge.
    """
    if not self.checkpointable:
        raise refuse_nondeterministic("DataLoader.state_dict()")
    view = fit_loop_view(self)  # how Lightning's fit loop, if it iterates us, stands
    local = self._local_state(view)
    if gather is None:
        gather = view is not None and view.saving
    states = gather and gather_states(local, *resolve_topology(self.rank, self.world_size))
    return merge_states(states) if states else local


@_loader_method
def _local_state(self, view: FitView | None = None) -> dict[str, Any]:
    """This rank's state; ``view``: what Lightning's fit loop holds, under Lightning."""
    if view is None:
        return self._state_before(0)
    return self._state_before(view.held, epoch_over=view.epoch_over)


@_loader_method
def _state_before(self, held: int, *, epoch_over: bool = False) -> dict[str, Any]:
    """This rank's state before the last ``held`` batches handed over.

    Args:
        held: Batches a consumer (Lightning's fetcher, a ``ZephonDataModule``
            stream) took from the loader and has not used yet.
        epoch_over: The consumer has used the iteration's last batch: the
            next iteration starts from the beginning of the next epoch.

    Raises:
        NotCheckpointableError: The loader runs with ``deterministic=False``.
        RuntimeError: ``held`` goes back further than :class:`Position` remembers.
    """
    if not self.checkpointable:
        raise refuse_nondeterministic("DataLoader.state_dict()")
    if self._loaded is not None:
        state: dict[str, Any] | None = self._loaded
    elif epoch_over and not held:
        state = None  # the next iteration (iter() again) starts the next epoch
    else:
        state = self._position.before(held)
    if state is not None:
        # Only this rank's lanes of a (possibly merged) state, so that gathers merge;
        # a copy, which the caller may edit.
        return narrow_state(state_copy(state), self._own_lanes())
    return self._fresh_state()


def state_copy(state: dict[str, Any] | StateSnapshot) -> dict[str, Any]:
    """A copy of a state the loader keeps, which the caller may edit: the position
    remembers each batch's state as a snapshot (built here), or a dict (loaded, or an
    end)."""
    if type(state) is StateSnapshot:
        return state.state()  # a fresh dict at each call
    return copy.deepcopy(state)


@_loader_method
def _own_lanes(self) -> list[int]:
    rank, world_size = resolve_topology(self.rank, self.world_size)
    return owned_lanes(lane_count(self.pipeline.source), rank, world_size,
                       self.iter_kwargs.get("lanes"))


@_loader_method
def _fresh_state(self, epoch: int | None = None) -> dict[str, Any]:
    """The state of an iterator of ``epoch`` (default: the next) that has not started
    (built inline, here)."""
    rank, world_size = resolve_topology(self.rank, self.world_size)
    # A state needs no workers: no task_timeout (which only the process runner takes).
    kwargs = {k: v for k, v in self.iter_kwargs.items() if k != "task_timeout"}
    it = self.pipeline.iter(runner="inline", rank=rank, world_size=world_size,
                            epoch=self._epochs.next_epoch if epoch is None else epoch,
                            **kwargs)
    try:
        return it.state_dict()
    finally:
        it.close()


@_loader_method
def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Make the next iteration continue exactly where ``state`` stopped.

    ``state`` is a :meth:`state_dict` of this pipeline: one rank's, or a
    merged one (this rank takes its own lanes from it, whatever the world
    size). An iteration in progress is ended.

    Raises:
        ValueError: The state is corrupted or belongs to another pipeline
            configuration.
    """
    checked = check_state(state, self._fingerprint, stage_names=self.pipeline.stage_names(),
                          deterministic=self.checkpointable)
    checked = with_grown_lanes(checked, self.pipeline, self._own_lanes())  # change_lanes
    # Another rank's state is refused even when its epoch had ended: taking it as
    # finished would skip what is left of this rank's lanes in that epoch.
    check_lanes_present(checked, self._own_lanes())
    check_resumable(checked, self.pipeline, epoch=state_epoch(checked),
                    lanes=self._own_lanes())
    self._end_active("load_state_dict()")
    # The state's epoch runs next; a state saved after the end of its epoch leaves
    # nothing to resume: the next iteration starts the following epoch afresh.
    pending = self._epochs.resume(checked)
    self._loaded = None if pending is None else copy.deepcopy(checked)
    self._position.reset(self._loaded)


# ------------------------------------------------------------------ ranks


@_loader_method
def _stopped(self) -> None:
    """The ranks voted to stop this iteration: its epoch is over here too.

    What this rank had not read of the epoch is dropped, and its
    position says so (every lane ended), as the position of the rank
    that ran out does: every rank's state is of this epoch, with nothing
    left in it, so they merge, and loading them starts the next epoch,
    as iterating again does (see ``_loader_dist.py``).
    """
    position = self._position
    epoch = self._epochs.epoch
    base = state_copy(position.state) if position.state is not None else self._fresh_state(epoch)
    position.state = stopped_state(base)
    if not position.count:
        rank, world_size = resolve_topology(self.rank, self.world_size)
        warnings.warn(
            f"zephon DataLoader: epoch {epoch} ended at step 0 on every rank "
            f"(on_uneven='stop'): rank {rank} of {world_size} has batches in it, but "
            "another rank has none, so none of them is trained on in this epoch. Give "
            "every rank data (more documents, smaller chunk_size, or num_lanes a multiple "
            "of the world size), or use on_uneven='continue' for a loop without a "
            "collective per step (evaluation)", RuntimeWarning, stacklevel=4)


@_loader_method
def _peer_failed(self, step: int) -> str:
    """The message of a rank whose peer's loader failed at ``step`` of this epoch."""
    rank, world_size = resolve_topology(self.rank, self.world_size)
    return (
        f"zephon DataLoader: another rank's loader failed at step {step} of epoch "
        f"{self._epochs.epoch} (its error is in that rank's log); rank {rank} of "
        f"{world_size} stops too, rather than wait for it in the next collective"
    )
