"""Start-up over many small shards: building the pipeline and its first batch.

Generates (once, under ``benchmarks/.data/startup``) folders of small JSONL
shards (5,000 of 20 lines, 100,000 of 2 lines) and Parquet shards (5,000 of
20 rows), then times, each round in a fresh child process (imports not
counted):

* ``build``: ``Pipeline.from_jsonl(folder, cache_dir=...)`` (or
  ``from_parquet``) with ``.fetch()`` (and ``.decode_text()`` for JSONL)
  and ``.batch(32)``;
* ``first``: ``next(iter(pipe))`` after it;

on a cold index cache (an empty ``cache_dir``: every JSONL file is scanned
and its entry written) and a warm one (the entries of the cold run: one
listing of the folder counts every file). ``4 ranks cold`` starts four
(``--ranks``) children at once on an empty cache, as ``torchrun`` ranks do; the figure is
the slowest rank's build + first batch. Medians of ``--rounds``.

``--against PATH`` runs the same children on another checkout of the package
(e.g. the main branch before a change) side by side, with its own caches.

Run: ``.venv/bin/python benchmarks/bench_startup.py [--rounds 3]
[--sizes 5000,100000] [--against /path/to/other/checkout]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = HERE / ".data" / "startup"
JSONL_LINES = {5_000: 20, 100_000: 2}


def jsonl_folder(count: int) -> Path:
    """``count`` JSONL shards (generated once)."""
    folder = DATA / f"jsonl-{count}"
    done = folder / ".done"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    lines = JSONL_LINES.get(count, 2)
    for shard in range(count):
        body = "".join(json.dumps({"text": f"shard {shard} line {i} " + "w" * (i % 7 + 20)})
                       + "\n" for i in range(lines))
        (folder / f"part-{shard:06d}.jsonl").write_text(body)
    done.write_text("")
    return folder


def parquet_folder(count: int) -> Path | None:
    """``count`` Parquet shards of 20 rows (generated once), or None without pyarrow."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return None
    folder = DATA / f"parquet-{count}"
    done = folder / ".done"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for shard in range(count):
        texts = [f"shard {shard} row {i} " + "w" * (i % 7 + 20) for i in range(20)]
        pq.write_table(pa.table({"text": texts}), folder / f"part-{shard:06d}.parquet")
    done.write_text("")
    return folder


_CHILD = r"""
import json, sys, time
kind, folder, cache = sys.argv[1:4]
import zephon_torch as zt
start = time.perf_counter()
if kind == "jsonl":
    pipe = zt.Pipeline.from_jsonl(folder, cache_dir=cache).fetch().decode_text().batch(32)
else:
    pipe = zt.Pipeline.from_parquet(folder).fetch().batch(32)
built = time.perf_counter()
it = iter(pipe)
next(it)
first = time.perf_counter()
print(json.dumps({"build": built - start, "first": first - built}))
"""


def child(tree: Path, kind: str, folder: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # -P and cwd: the tree named, not the folder this script runs from, is imported
    return subprocess.Popen([sys.executable, "-P", "-c", _CHILD, kind, str(folder), str(cache)],
                            cwd=str(tree),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen) -> dict[str, float]:
    out, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def measure(tree: Path, kind: str, folder: Path, rounds: int, work: Path,
            ranks: int) -> dict[str, dict]:
    """Cold, warm and ranks-cold medians for one tree and one folder."""
    together = f"{ranks} ranks cold"
    rows: dict[str, list[dict[str, float]]] = {"cold": [], "warm": [], together: []}
    for r in range(rounds):
        cache = work / f"cache-{r}"
        shutil.rmtree(cache, ignore_errors=True)
        rows["cold"].append(finish(child(tree, kind, folder, cache)))
        if kind != "jsonl":  # no index cache: one fresh process a round
            continue
        rows["warm"].append(finish(child(tree, kind, folder, cache)))
        shutil.rmtree(cache, ignore_errors=True)
        if kind == "jsonl" and ranks:
            times = [finish(p) for p in [child(tree, kind, folder, cache) for _ in range(ranks)]]
            rows[together].append(max(times, key=lambda t: t["build"] + t["first"]))
        shutil.rmtree(cache, ignore_errors=True)
    out = {}
    for name, runs in rows.items():
        if runs:
            out[name] = {k: statistics.median(run[k] for run in runs) for k in ("build", "first")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="5000,100000",
                        help="shard counts of the JSONL folders")
    parser.add_argument("--parquet", type=int, default=5000,
                        help="Parquet shards (0: none)")
    parser.add_argument("--ranks", type=int, default=4,
                        help="processes started together on a cold cache (0: none)")
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout of the package, run side by side")
    args = parser.parse_args()
    trees = [("this", ROOT)] + ([("against", args.against.resolve())] if args.against else [])
    jobs: list[tuple[str, Path]] = []
    for count in (int(s) for s in args.sizes.split(",") if s):
        started = time.perf_counter()
        jobs.append((f"jsonl x {count:,}", jsonl_folder(count)))
        print(f"# data: jsonl x {count:,} ready in {time.perf_counter() - started:.1f} s",
              flush=True)
    if args.parquet:
        folder = parquet_folder(args.parquet)
        if folder is not None:
            jobs.append((f"parquet x {args.parquet:,}", folder))
    print("| shards | tree | cache | build s | first batch s | total s |")
    print("|---|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(dir=DATA) as tmp:
        for label, folder in jobs:
            kind = label.split()[0]
            for tree_name, tree in trees:
                work = Path(tmp) / f"{tree_name}-{label.replace(' ', '')}"
                work.mkdir()
                for cache, t in measure(tree, kind, folder, args.rounds, work,
                                               args.ranks).items():
                    cache = cache if kind == "jsonl" else "(none)"
                    print(f"| {label} | {tree_name} | {cache} | {t['build']:.3f} | "
                          f"{t['first']:.3f} | {t['build'] + t['first']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
