"""A ``torchrun`` job for tests/test_uneven_ranks.py: uneven ranks under ``on_uneven``.

Every rank runs the scenario named on the command line and writes what it
saw (the ids of every batch, per epoch; its states; the gathered states) to
``<out>/<scenario>-<world>-<rank>.json``. The test compares those files with
single-process references. Not a test module itself (no ``test_`` prefix).

Scenarios:
    ``tiny``: 3 documents in 4 lanes (all in lane 0): rank 1 of 2 has no
        batch in any epoch. Three epochs, a gathered state after each.
    ``uneven``: 36 shuffled documents in 4 lanes of 4-document chunks,
        batches of 2 (rank 0 owns 10 batches, rank 1 8). Three epochs; a
        gathered state after epoch 0 and one after step 3 of epoch 1.
    ``fail``: ``uneven`` whose pipeline raises on a document of rank 1's
        (its first chunk, before step 0 of epoch 0): every rank must raise, none wait.
    ``resume``: load ``--state`` and iterate the loader until ``--epochs``
        iterations have run (used on 2 ranks and on 1).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

import zephon_torch as zt


def _boom(payload: dict[str, str]) -> dict[str, str]:
    if payload["text"] == FAILING:
        raise ValueError(f"bad document {FAILING}")
    return payload


FAILING = "d21"  # in the first chunk of lane 1, the first lane of rank 1 (epoch 0)


def pipeline(name: str) -> zt.Pipeline:
    """The pipeline of a scenario (the same in the job and in the test's reference)."""
    if name == "tiny":
        return zt.Pipeline.from_items(["d0", "d1", "d2"], num_lanes=4).batch(1)
    pipe = zt.Pipeline.from_items([f"d{i}" for i in range(36)], num_lanes=4, chunk_size=4,
                                  shuffle=True, seed=3)
    if name == "fail":
        pipe = pipe.map_transform(_boom)
    return pipe.batch(2)


def _ids(batch: Any) -> list[str]:
    return [str(record.payload["text"]) for record in batch.records]


def _epochs(loader: zt.DataLoader, epochs: int, save_at: tuple[int, int] | None,
            record: dict[str, Any]) -> None:
    """Iterate ``epochs`` epochs; gather after each, and at ``save_at`` (epoch, step)."""
    for _ in range(epochs):
        seen: list[list[str]] = []
        for step, batch in enumerate(loader):
            seen.append(_ids(batch))
            if save_at == (loader.epoch, step + 1):  # the epoch of the iteration in progress
                record["mid"] = loader.state_dict(gather=True)
        record["batches"].append(seen)
        record["loader_epoch"].append(loader.epoch)
        record["own"].append(loader.state_dict())
        record["gathered"].append(loader.state_dict(gather=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=("tiny", "uneven", "fail", "resume"))
    parser.add_argument("--pipeline", default="tiny")
    parser.add_argument("--out", required=True)
    parser.add_argument("--state", default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--on-uneven", default="stop")
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    name = args.pipeline if args.scenario == "resume" else args.scenario
    loader = zt.DataLoader(pipeline(name), to_training=False, num_workers=args.workers,
                           on_uneven=args.on_uneven)
    record: dict[str, Any] = {"rank": rank, "world_size": world, "batches": [],
                              "loader_epoch": [], "own": [], "gathered": [], "errors": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.state:
            loader.load_state_dict(json.loads(Path(args.state).read_text()))
        record["start_epoch"] = loader.epoch
        try:
            save_at = (1, 3) if args.scenario == "uneven" else None
            _epochs(loader, args.epochs, save_at, record)
        except Exception as exc:  # reported, so that the test shows it
            record["errors"].append(f"{type(exc).__name__}: {exc}")
    record["warnings"] = [str(w.message) for w in caught]
    loader.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.scenario}-{args.on_uneven}-{world}-{rank}.json"
    path.write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
