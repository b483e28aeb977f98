"""A ``torchrun`` job for tests/test_peer_agreement.py: do the ranks run one pipeline?

Rank ``r`` reads the JSONL files of ``<data>/rank<r>`` (the test lays out the
same files for every rank, or files that differ) and iterates one epoch
under ``on_uneven="stop"``. Every rank writes what it saw (its batches, or
the error it raised) to ``<out>/<scenario>-<rank>.json``. Not a test module
itself (no ``test_`` prefix).

Scenarios:
    ``same``: every rank the same files: both ranks iterate.
    ``files``, ``content``: rank 1's files differ (one more file; the same
        names and line counts with other text): every rank must raise.
    ``batch``: rank 1 batches by 3, rank 0 by 2: every rank must raise.
    ``epoch``: rank 1 calls set_epoch(1): every rank must raise.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

import zephon_torch as zt


def pipeline(folder: Path, batch_size: int = 2) -> zt.Pipeline:
    """The job's pipeline over the JSONL files of ``folder``."""
    files = sorted(str(p) for p in folder.glob("*.jsonl"))
    return (zt.Pipeline.from_jsonl(files, num_lanes=4, chunk_size=4).fetch().decode_text()
            .batch(batch_size))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=("same", "files", "content", "batch", "epoch"))
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch_size = 3 if args.scenario == "batch" and rank == 1 else 2
    loader = zt.DataLoader(pipeline(Path(args.data) / f"rank{rank}", batch_size),
                           to_training=False)
    if args.scenario == "epoch" and rank == 1:
        loader.set_epoch(1)
    record: dict[str, Any] = {"rank": rank, "batches": [], "error": None}
    try:
        for batch in loader:
            record["batches"].append([str(r.payload["text"]) for r in batch.records])
    except Exception as exc:  # reported, so that the test shows it
        record["error"] = f"{type(exc).__name__}: {exc}"
    loader.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.scenario}-{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
