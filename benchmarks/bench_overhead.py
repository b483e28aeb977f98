"""Engine overhead: records/s through 5 identity ``map_transform`` stages.

1,000,000 small in-memory items flow through ``from_items(...)`` and five
``map_transform(lambda p: p)`` stages on the inline runner, timed from
``iter()`` (source, meta construction and the consumer included), against a
plain generator chain doing the same five calls. Side by side, in one run,
alternating, median of the rounds.

Run: ``.venv/bin/python benchmarks/bench_overhead.py [--items 1000000 --rounds 3]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import zephon_torch as zt


def generator_chain(items: list[dict]) -> int:
    def stage(src):
        for p in src:
            yield (lambda x: x)(p)

    it = iter(items)
    for _ in range(5):
        it = stage(it)
    return sum(1 for _ in it)


def zephon_chain(items: list[dict], runner: str) -> int:
    pipe = zt.Pipeline.from_items(items, num_lanes=8, chunk_size=512)
    for _ in range(5):
        pipe = pipe.map_transform(lambda p: p)
    it = pipe.iter(runner=runner, num_workers=2)
    count = sum(1 for _ in it)
    it.close()
    return count


def zephon_replay_batch(items: list[dict], runner: str) -> int:
    """No stage of ours: the source, the replay filter and batch(64), then the consumer."""
    pipe = zt.Pipeline.from_items(items, num_lanes=8, chunk_size=512).batch(64)
    it = pipe.iter(runner=runner)
    count = sum(len(batch) for batch in it)
    it.close()
    return count


def timed(fn, *args) -> tuple[float, int]:
    start = time.perf_counter()
    n = fn(*args)
    return time.perf_counter() - start, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    items = [{"text": f"item {i}"} for i in range(args.items)]
    results: dict[str, list[float]] = {"generator chain": [], "zephon inline": [],
                                       "zephon threads(2)": [], "replay+batch(64)": []}
    for _ in range(args.rounds):
        for name, fn, extra in (("generator chain", generator_chain, ()),
                                ("zephon inline", zephon_chain, ("inline",)),
                                ("zephon threads(2)", zephon_chain, ("threads",)),
                                ("replay+batch(64)", zephon_replay_batch, ("inline",))):
            seconds, n = timed(fn, items, *extra)
            if n != args.items:
                raise SystemExit(f"{name} delivered {n} of {args.items} records")
            results[name].append(seconds)
    base = statistics.median(results["generator chain"])
    print(f"{args.items} records, 5 identity stages (replay+batch(64): no stage of ours, "
          f"inline), median of {args.rounds} rounds")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"  {name:<18} {args.items / med:>12,.0f} records/s   "
              f"({med:.2f} s; {med / base:.1f}x the generator chain)")
    print("targets (issue 14): zephon inline >= 1,000,000 records/s through the 5 stages; "
          "replay+batch(64) >= 3,000,000 records/s (issue 7 asked 1,000,000 and 2,000,000)")


if __name__ == "__main__":
    main()
