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
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zephon_torch.checkpoint import describe_difference, differing_parts, state_checksum

__all__ = ["BATCH", "END", "FAILED", "StepVote", "check_peers", "fingerprint_digest", "gather",
           "in_group", "stopped_state", "vote_group"]

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


def fingerprint_digest(fingerprint: Mapping[str, Any]) -> str:
    """A digest of a whole pipeline fingerprint: sources, file list and contents, operators."""
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def check_peers(digest: str, epoch: int, rank: int, world_size: int,
                parts: Callable[[], dict[str, Any]],
                fingerprint: Mapping[str, Any]) -> None:
    """Check, at the start of an iteration, that every rank runs this pipeline and epoch.

    A collective (one gather of a digest and an epoch; a second one, of the
    fingerprints' parts, only when they differ). Ranks whose pipelines
    differ (another file list, files of other content, another operator)
    split the data by lanes of different schedules: documents would be
    trained on twice and others never, without a word. Ranks in different
    epochs read different orders. Either raises on every rank, naming the
    ranks and what differs. ``parts`` gives this rank's
    :func:`~zephon_torch.checkpoint.fingerprint_parts` (called on a mismatch).

    Raises:
        RuntimeError: Some rank's pipeline or epoch differs from rank 0's.
    """
    seen = gather((digest, int(epoch)), rank, world_size)
    if seen is None:
        return
    digests = [d for d, _ in seen]
    if any(d != digests[0] for d in digests):
        # The fingerprints too, so that every rank names the same shards.
        every = gather((parts(), fingerprint), rank, world_size) or []
        first = every[0][0]
        others = [r for r, d in enumerate(digests) if d != digests[0]]
        notes = []
        for r in others[:3]:
            mine, theirs = every[r]
            differ = differing_parts(mine, first)
            what = (describe_difference(differ, mine, first, theirs,
                                        sides=("on rank 0", f"on rank {r}")) if differ
                    else "the content of its files differs (data)")
            notes.append(f"rank {r}: {what} (values: rank 0's -> rank {r}'s)")
        more = f"; and {len(others) - 3} more rank(s)" if len(others) > 3 else ""
        raise RuntimeError(
            f"zephon DataLoader: the ranks do not run the same pipeline: {'; '.join(notes)}"
            f"{more}. Each rank reads its own lanes of one schedule, so ranks over other files "
            "or operators would train on some documents twice and never on others. Give every "
            "rank the same pipeline: the same sources (file list, in the same order, and the "
            "same file contents: a shared file system, not a copy per node that may differ), "
            "operators, num_lanes, chunk_size and seed"
        )
    epochs = [e for _, e in seen]
    if any(e != epochs[0] for e in epochs):
        shown = ", ".join(f"rank {r}: {e}" for r, e in enumerate(epochs[:8]))
        raise RuntimeError(
            f"zephon DataLoader: the ranks would start different epochs ({shown}"
            f"{', ...' if len(epochs) > 8 else ''}), each reading another order of the data. "
            "Load the same checkpoint on every rank (a gathered state: state_dict(gather=True), "
            "or merge_states() of every rank's), and call set_epoch() with the same value on "
            "every rank"
        )


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
