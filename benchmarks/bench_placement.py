"""The placement kernel: per-document cost of the compiled kernel against its
pure-Python twin, alone and inside the packer, and the padding each algorithm
leaves (best of ``--reps`` runs, both measured side by side in one process)::

    python benchmarks/bench_placement.py --docs 100000 --bins 64 --reps 3

Lengths are heavy-tailed (lognormal, median about 245 tokens) in rows of
``--max-length``; the kernel places them ``--batch`` documents per call, as
the packer does one lane's documents per ``push_many``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# This checkout's zephon_torch, whatever an editable install elsewhere points to.
sys.path[:0] = [str(HERE.parent)]

from zephon_torch.ops._binpack import BinPlacer, native_available  # noqa: E402
from zephon_torch.ops.pack_engine import PackFlatAccumulator  # noqa: E402
from zephon_torch.types import SampleMeta, SampleRecord  # noqa: E402

ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_decreasing")


def best_of(reps: int, fn: Callable[[], object]) -> float:
    """The fastest of ``reps`` runs, in seconds."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def kernel_run(lengths: np.ndarray, args: argparse.Namespace, algorithm: str,
               native: bool) -> tuple[Callable[[], object], Callable[[], float]]:
    """A timed run of the kernel alone, and the padding fraction of its rows."""
    def run() -> tuple[int, int]:
        placer = BinPlacer(args.max_length, algorithm=algorithm, num_bins=args.bins,
                           window=args.window, native=native)
        rows = used = 0
        for start in range(0, len(lengths), args.batch):
            out = placer.place(lengths[start:start + args.batch])
            rows, used = rows + out.rows, used + int(out.row_used.sum())
        out = placer.flush()
        return rows + out.rows, used + int(out.row_used.sum())

    def padding() -> float:
        rows, used = run()
        return 1 - used / (rows * args.max_length)

    return run, padding


def packer_run(records: list[SampleRecord], args: argparse.Namespace, algorithm: str,
               bins: int) -> Callable[[], object]:
    """A timed run of the packer's accumulator (placement and bin plans, no assembly)."""
    def run() -> int:
        acc = PackFlatAccumulator(args.max_length, num_bins=bins, algorithm=algorithm)
        count = 0
        for start in range(0, len(records), 64):
            count += sum(len(mb) for mb in acc.push_many(records[start:start + 64]))
        return count + sum(len(mb) for mb in acc.flush())

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--bins", type=int, default=64, help="open bins (first/best fit)")
    parser.add_argument("--max-length", type=int, default=2049)
    parser.add_argument("--batch", type=int, default=512, help="documents per kernel call")
    parser.add_argument("--window", type=int, default=4096, help="best_fit_decreasing window")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not native_available():
        sys.exit("the compiled placement kernel is not built: pip install -e . (needs a C "
                 "compiler), or python setup.py build_ext --inplace")
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(5.5, 1.0, args.docs), 1).astype(np.int64)

    print(f"### kernel alone: {args.docs:,} documents, rows of {args.max_length}, "
          f"{args.bins} open bins, {args.batch} documents per call, best of {args.reps}\n")
    print("| algorithm | twin us/doc | C us/doc | twin / C | padding % |")
    print("| --- | --- | --- | --- | --- |")
    for algorithm in ALGORITHMS:
        per_doc = {}
        for native in (False, True):
            run, padding = kernel_run(lengths, args, algorithm, native)
            per_doc[native] = best_of(args.reps, run) / args.docs * 1e6
        pad = padding() * 100
        print(f"| {algorithm} | {per_doc[False]:.3f} | {per_doc[True]:.3f} | "
              f"{per_doc[False] / per_doc[True]:.1f}x | {pad:.3f} |")

    docs = min(args.docs, 50_000)
    tokens = np.zeros(int(lengths[:docs].max()), dtype=np.int32)
    records = [SampleRecord(SampleMeta((0, 0, i), lane_id=0, chunk_id=0, chunk_offset=i,
                                       component_sample_counts={0: 1}),
                            {"input_ids": tokens[:n]}) for i, n in enumerate(lengths[:docs])]
    print(f"\n### the packer's accumulator (placement + bin plans), {docs:,} documents, "
          "64 per push_many\n")
    print("| algorithm | open bins | twin us/doc | C us/doc |")
    print("| --- | --- | --- | --- |")
    for algorithm, bins in (("first_fit", 8), ("first_fit", args.bins),
                            ("best_fit", args.bins), ("best_fit_decreasing", 0)):
        per_doc = {}
        for native in (False, True):
            os.environ["ZEPHON_NATIVE"] = "1" if native else "0"
            per_doc[native] = best_of(args.reps, packer_run(records, args, algorithm,
                                                            bins or 8)) / docs * 1e6
        shown = bins or "-"
        print(f"| {algorithm} | {shown} | {per_doc[False]:.2f} | {per_doc[True]:.2f} |")


if __name__ == "__main__":
    main()
