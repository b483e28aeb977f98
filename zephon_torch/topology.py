"""Who runs which lanes: ranks, world sizes and torch DataLoader workers.

This module sits at the bottom of the package (it imports nothing from
``zephon_torch`` and never imports torch), so that the pipeline, the
iterator, the torch wrappers and Lightning all take the answer from one
place.

**Ranks.** Rank ``r`` of ``world_size`` owns the lanes ``l % world_size ==
r`` (:func:`owned_lanes`); the rank and world size are explicit, else those
of an initialised ``torch.distributed`` group, else ``RANK`` and
``WORLD_SIZE`` from the environment, else 0 and 1 (:func:`resolve_topology`).

**Workers.** Worker ``w`` of ``N`` takes the rank's lanes at positions ``w,
w + N, ...``, ``rank_lanes[w::N]`` (:func:`deal_lanes`): the lane workers of
``runner="lanes"`` and of ``zephon_torch.DataLoader`` (:func:`lane_shares`),
and the worker processes of a plain torch ``DataLoader`` over a pipeline
(:func:`worker_lanes`). torch's loader asks its workers round-robin, so with
four lanes and two workers::

    worker 0: lanes 0, 2   -> 0 2 0 2 ...
    worker 1: lanes 1, 3   -> 1 3 1 3 ...
    loader:                -> 0 1 2 3 0 1 2 3 ...   (our own round-robin order)

as long as the lanes produce equally (a lane that ends early shifts the two
orders differently; neither duplicates nor drops anything).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence

__all__ = ["deal_lanes", "lane_shares", "owned_lanes", "resolve_topology", "warn_idle_workers",
           "worker_info", "worker_lanes"]


def resolve_topology(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size: explicit, else ``torch.distributed``, else the environment.

    ``torch.distributed`` is consulted only if torch is already imported (a
    job that initialised a process group has imported it), so the core never
    imports torch itself.
    """
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    torch = sys.modules.get("torch")
    if torch is not None:
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            return (dist.get_rank() if rank is None else int(rank),
                    dist.get_world_size() if world_size is None else int(world_size))
    env_rank = os.environ.get("RANK")
    env_world = os.environ.get("WORLD_SIZE")
    return (int(env_rank) if rank is None and env_rank is not None else int(rank or 0),
            int(env_world) if world_size is None and env_world is not None
            else int(world_size or 1))


def owned_lanes(num_lanes: int, rank: int, world_size: int,
                lanes: Sequence[int] | None = None) -> list[int]:
    """The lanes of ``rank``: ``l % world_size == rank`` (or an explicit subset)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size > num_lanes:
        raise ValueError(
            f"world_size {world_size} exceeds num_lanes {num_lanes}: every rank needs at "
            f"least one lane. A new run: build the pipeline with num_lanes >= {world_size}; "
            f"resuming a state on more ranks: grow its lanes from the state's step on, "
            f"pipe.change_lanes({world_size}, state=state) on the pipeline the state was "
            "saved by (see docs/elastic-determinism.md)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if lanes is not None:
        chosen = sorted(set(int(lane) for lane in lanes))
        bad = [lane for lane in chosen if not 0 <= lane < num_lanes]
        if bad or not chosen:
            raise ValueError(f"lanes={list(lanes)} must be a nonempty subset of 0..{num_lanes - 1}")
        return chosen
    return [lane for lane in range(num_lanes) if lane % world_size == rank]


def deal_lanes(rank_lanes: Sequence[int], num_workers: int) -> list[list[int]]:
    """Worker ``w``'s lanes for each of ``num_workers`` workers: ``rank_lanes[w::num_workers]``.

    Dealing by position keeps every worker's share a round-robin of its own,
    so that the main process's round-robin over the rank's lanes asks the
    workers in turn. A worker beyond the number of lanes gets none.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    return [list(rank_lanes[w::num_workers]) for w in range(num_workers)]


def lane_shares(rank_lanes: Sequence[int], num_workers: int, *, stacklevel: int = 3
                ) -> list[list[int]]:
    """The non-empty shares of :func:`deal_lanes`, warning once when workers go without.

    Used where the workers are ours to start (``runner="lanes"``): a worker
    that would own no lane is not started at all.
    """
    shares = deal_lanes(rank_lanes, num_workers)
    if num_workers > len(rank_lanes):
        warn_idle_workers(num_workers, len(rank_lanes), stacklevel)
    return [share for share in shares if share]


def warn_idle_workers(num_workers: int, num_lanes: int, stacklevel: int) -> None:
    """The warning for workers beyond a rank's lanes (``stacklevel`` as ``warnings.warn``
    would take it in the caller of this function)."""
    warnings.warn(
        f"{num_workers} workers but this rank owns {num_lanes} lane(s): "
        f"{num_workers - num_lanes} worker(s) get no lane and do nothing; use at most "
        f"{num_lanes} workers or build the pipeline with more lanes",
        RuntimeWarning, stacklevel=stacklevel + 1,
    )


def worker_info() -> tuple[int, int] | None:
    """``(worker_id, num_workers)`` inside a torch DataLoader worker, else None.

    Looks only at modules already imported: a process that never imported
    torch is not a torch worker, and asking must not import torch.
    """
    data = sys.modules.get("torch.utils.data")
    get = getattr(data, "get_worker_info", None)
    if get is None:
        return None
    info = get()
    if info is None:
        return None
    return int(info.id), int(info.num_workers)


def worker_lanes(num_lanes: int, rank: int | None = None, world_size: int | None = None,
                 lanes: Sequence[int] | None = None) -> list[int] | None:
    """This torch worker's share of the rank's lanes; None outside a worker.

    Args:
        num_lanes: The pipeline's lane count.
        rank, world_size: The topology (default: detected, as ``Pipeline.iter``).
        lanes: An explicit subset of lanes for the rank.

    Returns:
        None when not in a torch DataLoader worker; otherwise the lanes
        ``rank_lanes[w::N]`` of worker ``w`` of ``N`` (empty when there are
        more workers than lanes; worker 0 warns about it then).
    """
    info = worker_info()
    if info is None:
        return None
    worker_id, num_workers = info
    rank, world_size = resolve_topology(rank, world_size)
    rank_lanes = owned_lanes(num_lanes, rank, world_size, lanes)
    if num_workers > len(rank_lanes) and worker_id == 0:  # one warning, not one per worker
        warn_idle_workers(num_workers, len(rank_lanes), 3)
    return deal_lanes(rank_lanes, num_workers)[worker_id]
