"""What accounting costs: ``sample_bytes`` per chunk and ``verify=True`` per item.

A JSONL corpus (8 plain files of small lines) flows through ``fetch()`` and
``decode_text()`` on the inline runner, timed from ``iter()`` to the end of
the pass, three ways, side by side in one run, alternating, median of the
rounds:

* ``counts only``: the iterator's read counter without ``sample_bytes`` (what
  it did before byte accounting: one integer add per chunk);
* ``shipped``: the default, with ``sample_bytes`` (one ``Dataset.sample_bytes``
  call per run of one shard in a chunk, vectorized over its samples);
* ``verify=True``: the opt-in end-of-pass check, which records every closed
  sample.

Run: ``.venv/bin/python benchmarks/bench_accounting.py [--lines 400000 --rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import zephon_torch as zt
from zephon_torch.accounting import Accounting


def write_corpus(root: Path, lines: int, files: int = 8) -> str:
    per_file = lines // files
    for f in range(files):
        with open(root / f"part-{f}.jsonl", "w") as out:
            for i in range(per_file):
                out.write(json.dumps({"id": i, "text": f"document {i} of file {f}"}) + "\n")
    return str(root / "*.jsonl")


def run(glob: str, *, verify: bool = False) -> int:
    pipe = zt.Pipeline.from_jsonl(glob, num_lanes=8, chunk_size=512).fetch().decode_text()
    it = pipe.iter(runner="inline", verify=verify)
    count = sum(1 for _ in it)
    it.close()
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shipped_bytes = Accounting.sample_bytes

    def counts_only(self, chunk) -> int:  # the read counter alone: no storage looked up
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("ZEPHON_CACHE_DIR", os.path.join(tmp, "cache"))
        glob = write_corpus(Path(tmp), args.lines)
        run(glob)  # index the files once (cached), warm the imports
        results: dict[str, list[float]] = {"counts only": [], "shipped": [], "verify=True": []}
        for _ in range(args.rounds):
            for name in results:
                Accounting.sample_bytes = counts_only if name == "counts only" else \
                    shipped_bytes
                start = time.perf_counter()
                n = run(glob, verify=name == "verify=True")
                results[name].append(time.perf_counter() - start)
        Accounting.sample_bytes = shipped_bytes
    base = statistics.median(results["counts only"])
    print(f"{n} records through fetch + decode_text, inline, median of {args.rounds} rounds")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"  {name:12s} {median:7.3f} s  {n / median:12,.0f} records/s  "
              f"x{median / base:.3f} of counts only")


if __name__ == "__main__":
    main()
