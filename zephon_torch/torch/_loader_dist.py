"""Distributed helpers for ``zephon_torch.DataLoader``: the per-step vote and the state gather.

With ``on_uneven="stop"``, before handing a batch over, every rank says
whether it has one; an ``all_reduce(MIN)`` turns that into "everyone has
one", and the first rank to run out stops them all at the same step::

    step      rank 0 (lanes 0, 2)    rank 1 (lane 1)     vote (MIN)   result
    ...
    6         batch                  batch               2            both train
    7         batch                  end                 1            both stop

The vote carries three values, so that the ranks also learn why it stops:
``2`` a batch, ``1`` the end of this rank's data, ``0`` a failure (an error
in this rank's pipeline). At ``1`` the epoch is over on every rank: a rank
that still had batches drops the rest of the epoch, and its state says so
(:func:`stopped_state`: every lane ended), so that every rank's state is of
the same epoch, with nothing left in it, as the end state of the rank that
ran out is; they merge, and a resume goes on with the next epoch, as the
run does. At ``0`` the ranks without an error raise one too, rather than
wait for the failed rank at their next collective.

Votes and state gathers go through a gloo group, on CPU tensors: a CUDA
tensor (nccl) would need ``.item()``, a device synchronization per step.
The default group serves when its backend includes gloo; otherwise one gloo
group is created (collectively, on every rank) at first use and cached.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from zephon_torch.checkpoint import state_checksum

__all__ = ["BATCH", "END", "FAILED", "StepVote", "gather", "in_group", "stopped_state",
           "vote_group"]

#: What a rank votes at a step: it has a batch, its data has ended, it failed.
BATCH, END, FAILED = 2, 1, 0


_GROUPS: dict[int, Any] = {}  # default group id -> gloo group used for votes and gathers


def in_group(rank: int, world_size: int) -> bool:
    """Whether this loader's ranks are the initialized distributed group's (of 2+ ranks).

    A loader given an explicit other topology (a sub-topology, a test) runs
    alone: its peers are not the group's, so it takes part in no collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or world_size < 2:
        return False
    return (rank, world_size) == (dist.get_rank(), dist.get_world_size())


def vote_group() -> Any:
    """A gloo group over all ranks (None: the default group is gloo already)."""
    import torch.distributed as dist

    backend = str(dist.get_backend()).lower()
    if "gloo" in backend:
        return None
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        try:
            _GROUPS[key] = dist.new_group(backend="gloo")
        except Exception:  # no gloo in this build: vote on the default (nccl) group
            _GROUPS[key] = "default"
    group = _GROUPS[key]
    return None if group == "default" else group


def gather(value: Any, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's ``value`` (a collective, over the gloo group), or None when this
    topology is not the initialized distributed group's (see :func:`in_group`).

    The loader's ``state_dict(gather=True)`` and ``ZephonDataModule.state_dict()``
    gather their ranks' positions through here.
    """
    if not in_group(rank, world_size):
        return None
    import torch.distributed as dist

    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=vote_group())
    return values


def stopped_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every lane ended: the rest of its epoch dropped by a stop.

    What a rank that still had batches keeps when the vote stops the epoch
    (see the module doc): the lanes' counts of what was delivered stay; what
    they had not read yet is no longer to be read in this epoch. A state of
    an epoch with nothing left, like the end state of the rank that ran out:
    loading it starts the next epoch.
    """
    stopped = copy.deepcopy(dict(state))
    for entry in stopped["lanes"].values():
        entry.update(window=[], epoch_boundaries=[], replay_cursor=None, replay_count=0,
                     next=None)
    stopped["checksum"] = state_checksum(stopped)
    return stopped


class StepVote:
    """One ``all_reduce(MIN)`` per step of what each rank has (see the module doc)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.flag = torch.ones(1, dtype=torch.int32, device=device)

    @classmethod
    def create(cls, rank: int, world_size: int) -> StepVote | None:
        """A vote over the distributed group, when there is one this loader belongs to."""
        import torch.distributed as dist

        if not in_group(rank, world_size):
            return None
        group = vote_group()
        device = torch.device("cpu")
        if group is None and "gloo" not in str(dist.get_backend()).lower():
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(group, device)

    def agree(self, have: int) -> int:
        """The least of every rank's ``have`` (:data:`BATCH`, :data:`END` or
        :data:`FAILED`) for this step (a collective call)."""
        import torch.distributed as dist

        self.flag.fill_(have)
        dist.all_reduce(self.flag, op=dist.ReduceOp.MIN, group=self.group)
        return int(self.flag.item())
