"""Benchmark ``SampleBatch.to_training`` against the least possible work.

A batch of 8 packed rows of 4096 tokens with about 8 documents each goes
through ``to_training(return_labels=True, return_cu_seqlens=True,
return_loss_mask=True)``, twice: as the batch a pipeline hands out (a view
of a block whose token and position columns are ``[8, 4096]`` arrays, read
as whole arrays) and as a ``SampleBatch`` of records built by hand (the
general path, row by row). The floor is ``torch.from_numpy(np.stack(rows))``:
stacking the token rows into one tensor. All are timed side by side in the
same process, interleaved, so that machine noise hits them alike.

A pipeline's batch goes through the compiled kernel
(``zephon_torch/_native/training.c``) when it is built; ``ZEPHON_NATIVE=0``
times its numpy twin instead. The first line says which one ran.

Run: ``.venv/bin/python benchmarks/bench_to_training.py [--rows 8 --length 4096]``
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np
import torch

from zephon_torch._training_native import kernel_enabled
from zephon_torch.block import Block
from zephon_torch.block_views import BlockBatch
from zephon_torch.types import PACKING_METADATA_TAG, SampleBatch, SampleMeta, SampleRecord


def make_batch(rows: int, length: int, segments: int, seed: int = 0) -> SampleBatch:
    """Packed rows: ``segments`` documents of random length, then trailing padding."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(rows):
        pad = int(rng.integers(0, length // 16))
        cuts = np.sort(rng.choice(np.arange(1, length - pad), segments - 1, replace=False))
        bounds = np.concatenate([[0], cuts, [length - pad]])
        positions = np.concatenate(
            [np.arange(b - a, dtype=np.int32) for a, b in itertools.pairwise(bounds)]
            + [np.arange(pad, dtype=np.int32)]
        )
        tokens = rng.integers(3, 32000, size=length, dtype=np.int32)
        tokens[length - pad:] = 0
        meta = SampleMeta((0, 0, i), 0, 0, i, {0: segments}, None, (0,),
                          {PACKING_METADATA_TAG: {"padding_length": pad}})
        records.append(SampleRecord(meta, {"input_ids": tokens, "positions": positions}))
    return SampleBatch(records)


def time_call(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200, help="calls per timing")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timings")
    args = parser.parse_args()
    torch.set_num_threads(1)

    batch = make_batch(args.rows, args.length, args.segments)
    rows = [r.payload["input_ids"] for r in batch]
    # What a pipeline hands out: a view of a block of packed rows held as columns.
    columns = {name: np.stack([r.payload[name] for r in batch])
               for name in ("input_ids", "positions")}
    viewed = BlockBatch(Block.from_records(list(batch)).with_fields(columns))
    kwargs = {"return_labels": True, "return_cu_seqlens": True, "return_loss_mask": True}

    def floor() -> torch.Tensor:
        return torch.from_numpy(np.stack(rows))

    def full() -> dict:
        return viewed.to_training(**kwargs)

    def records() -> dict:
        return batch.to_training(**kwargs)

    full(), floor(), records()  # warm up (imports, allocator)
    floors, fulls, slow = [], [], []
    for _ in range(args.rounds):
        floors.append(time_call(floor, args.repeats))
        fulls.append(time_call(full, args.repeats))
        slow.append(time_call(records, args.repeats))
    floor_s, full_s = statistics.median(floors), statistics.median(fulls)
    records_s = statistics.median(slow)
    path = "the compiled kernel" if kernel_enabled() else "the numpy twin"
    print(f"batch: {args.rows} rows x {args.length} tokens, ~{args.segments} segments per row; "
          f"a pipeline's batch takes {path}")
    print(f"floor  torch.from_numpy(np.stack(rows)):  {floor_s * 1e6:8.1f} us per batch "
          f"(median of {args.rounds} rounds x {args.repeats} calls)")
    print(f"to_training(labels, cu_seqlens, loss_mask), a pipeline's batch (columns): "
          f"{full_s * 1e6:8.1f} us per batch")
    print(f"the same, a SampleBatch of records built by hand (row by row):    "
          f"{records_s * 1e6:8.1f} us per batch")
    print(f"ratio to_training / floor: {full_s / floor_s:.1f}x  (target <= 5x); "
          f"records: {records_s / floor_s:.1f}x")


if __name__ == "__main__":
    main()
