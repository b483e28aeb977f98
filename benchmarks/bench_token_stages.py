"""The token job stage by stage: the hand-written loop's parts against the zephon
inline pipeline cut after each stage, on the compare corpus (best of N runs).

It shows where zephon's per-document time goes (docs/performance.md, "Where
the misses come from")::

    python benchmarks/bench_token_stages.py --mb 40 --reps 3
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
# This checkout's zephon_torch, whatever an editable install elsewhere points to.
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _compare_contenders as cc  # noqa: E402
import _compare_data as data  # noqa: E402

import zephon_torch as zt  # noqa: E402

#: (name, hand-written part or None, number of zephon stages after fetch)
STAGES = (("read", 0, 0), ("read+pack", 1, 1), ("read+pack+shuffle", None, 2),
          ("whole job", 2, 3))


def zephon(files: list[str], stages: int) -> Callable[[], int]:
    """The inline pipeline up to ``stages`` operators after fetch (3: the whole job)."""
    def run() -> int:
        pipe = zt.Pipeline.from_parquet(files, columns=["input_ids"], num_lanes=1,
                                        chunk_size=512, shuffle=False).fetch()
        if stages >= 1:
            pipe = pipe.pack_flat(cc.ROW, num_bins=cc.BINS)
        if stages >= 2:
            pipe = pipe.shuffle(cc.SHUFFLE, seed=0)
        if stages >= 3:
            pipe = pipe.batch(cc.BATCH, drop_last=False)
        count = 0
        with pipe.iter(runner="inline") as it:
            for item in it:
                if stages >= 3:
                    item.to_training(return_labels=True)
                count += 1
        return count

    return run


def handwritten(files: list[str], part: int) -> Callable[[], int]:
    """The hand-written loop: read (0), read and pack (1), or the whole job (2)."""
    def run() -> int:
        count = 0
        if part == 0:
            for _ in cc.token_docs(files):
                count += 1
        elif part == 1:
            packer = cc.FirstFit()
            for doc in cc.token_docs(files):
                count += len(packer.add(doc))
            count += len(packer.flush())
        else:
            for _ in cc.pack_shuffle_batch(cc.token_docs(files)):
                count += 1
        return count

    return run


def best(fn: Callable[[], int], reps: int) -> float:
    times = []
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=40.0, help="corpus size in MB of JSONL")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure (best kept)")
    args = parser.parse_args()
    import torch  # noqa: F401  (imported before any clock, as by the contenders)

    corpus = data.make_corpus(args.mb)
    shards = data.make_token_shards(corpus, data.make_tokenizer())
    files = [str(p) for p in data.parquet_files(shards)]
    docs = sum(1 for _ in cc.token_docs(files))
    print(f"token job stages, {args.mb:g} MB corpus, {docs:,} documents, "
          f"best of {args.reps} (s, us per document)")
    print("| stages | handwritten | zephon inline | zephon - handwritten per document |")
    print("| --- | --- | --- | --- |")
    for name, part, stages in STAGES:
        tz = best(zephon(files, stages), args.reps)
        if part is None:
            print(f"| {name} | - | {tz:.3f} s ({tz / docs * 1e6:.1f} us) | - |")
            continue
        th = best(handwritten(files, part), args.reps)
        print(f"| {name} | {th:.3f} s ({th / docs * 1e6:.1f} us) | "
              f"{tz:.3f} s ({tz / docs * 1e6:.1f} us) | {(tz - th) / docs * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
