"""What a lane costs: the same job at several ``num_lanes``, side by side.

Each configuration runs in a fresh child process (so its peak memory is its
own) over the corpus of ``compare.py`` (generated, cached under
``benchmarks/.data``), with the same total shuffle buffer, and prints:

* ``Mtok/s``: non-pad tokens delivered per second (inline runner);
* ``PSS MB``: the peak PSS of the child (sampled every 50 ms);
* ``padding``: the share of delivered row slots that are padding;
* ``rho``: Spearman's rank correlation of each row's first document's place
  in the files to the row's place in the output (1.0: file order; nearer 0:
  better mixed), and ``disp``: the mean displacement of a row from its
  document's place, as a share of the run (0.0: file order);
* ``state B/lane``: the bytes of ``json.dumps(state_dict())`` taken after 100
  batches, over the lanes it holds;
* ``replayed`` and ``resume s``: a resume from that state (inline): the
  samples its lanes read again to rebuild their windows, and the seconds to
  its first batch.

Each configuration runs ``--rounds`` times (alternating); medians are shown,
then the ratios of each lane count to the first.

Run::

    python benchmarks/bench_lanes.py --mb 64 --lanes 8,1024 --jobs token,text

The source reads the files in order (``shuffle=False``), so ``rho`` measures
what the pipeline's lanes, packing and shuffle do to that order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def order_quality(source_pos: list[int]) -> tuple[float, float]:
    """Spearman's rho of source position to output position, and mean |displacement| / n."""
    n = len(source_pos)
    if n < 2:
        return 1.0, 0.0
    rs = _ranks([float(p) for p in source_pos])
    mean = (n - 1) / 2
    num = sum((r - mean) * (i - mean) for i, r in enumerate(rs))
    den = sum((i - mean) ** 2 for i in range(n))
    disp = sum(abs(r - i) for i, r in enumerate(rs)) / n / n
    return num / den, disp


def child(job: str, mb: float, lanes: int, shuffle: int, chunk: int) -> dict[str, Any]:
    """One run of ``job`` at ``lanes`` lanes; the figures as a dict."""
    import _compare_data as data
    from _compare_contenders import BATCH, BINS, ROW, Tally, load_tokenizer
    from compare import _import_engine, _TreeMemory

    import zephon_torch as zt

    text = data.make_corpus(mb)
    tokenizer = data.make_tokenizer()
    source = {"num_lanes": lanes, "chunk_size": chunk, "shuffle": False}
    if job == "text":
        files = [str(f) for f in data.jsonl_files(text)]
        tok, _eos = load_tokenizer(str(tokenizer))
        pipe = (zt.Pipeline.from_jsonl(files, **source)
                .fetch().decode_text().tokenize(tok, special_tokens="eos"))
    else:
        files = [str(f) for f in data.parquet_files(data.make_token_shards(text, tokenizer))]
        pipe = zt.Pipeline.from_parquet(files, columns=["input_ids"], **source).fetch()
    pipe = pipe.pack_flat(ROW, num_bins=BINS).shuffle(shuffle, seed=0).batch(BATCH, drop_last=False)
    _import_engine()
    tally = Tally()
    firsts: list[tuple[int, int]] = []
    state_bytes = 0
    state_lanes = 0
    blob = ""
    with _TreeMemory() as memory:
        start = time.perf_counter()
        it = pipe.iter(runner="inline")
        for n, batch in enumerate(it):
            out = batch.to_training(return_labels=True)
            tally.add(out["input_ids"], out["labels"], out["positions"])
            firsts.extend((ids[1], ids[2]) for ids in batch.ids)
            if n == 100:
                blob = json.dumps(it.state_dict())
                state_bytes = len(blob)
                state_lanes = len(json.loads(blob)["lanes"])
        seconds = time.perf_counter() - start
        it.close()
    resumed = pipe.iter(runner="inline")
    start = time.perf_counter()
    resumed.load_state_dict(json.loads(blob))
    next(resumed)
    resume_s = time.perf_counter() - start
    replayed = sum(resumed.stats()["replayed_by_lane"].values())
    resumed.close()
    rho, disp = order_quality([shard * 10_000_000 + local for shard, local in firsts])
    res = tally.result()
    return {"job": job, "lanes": lanes, "seconds": seconds,
            "mtok_s": res["tokens"] / seconds / 1e6, "pss_mb": memory.peak,
            "padding": 1 - res["tokens"] / max(1, res["rows"] * ROW),
            "rows": res["rows"], "tokens": res["tokens"], "rho": rho, "disp": disp,
            "state_bytes": state_bytes, "state_lanes": state_lanes,
            "bytes_per_lane": state_bytes / max(1, state_lanes),
            "replayed": replayed, "resume_s": resume_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--lanes", default="8,1024")
    parser.add_argument("--jobs", default="token,text")
    parser.add_argument("--shuffle", type=int, default=8192, help="total shuffle buffer (rows)")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        job, lanes = args.child.split(":")
        print(json.dumps(child(job, args.mb, int(lanes), args.shuffle, args.chunk)))
        return
    lanes_list = [int(x) for x in args.lanes.split(",")]
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for job in args.jobs.split(","):
            for lanes in lanes_list:
                cmd = [sys.executable, __file__, "--mb", str(args.mb), "--shuffle",
                       str(args.shuffle), "--chunk", str(args.chunk), "--child", f"{job}:{lanes}"]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True)
                results.setdefault((job, lanes), []).append(
                    json.loads(out.stdout.strip().splitlines()[-1]))
    keys = ("mtok_s", "pss_mb", "padding", "rho", "disp", "bytes_per_lane", "replayed",
            "resume_s")
    print(f"{args.mb:g} MB corpus, chunk_size {args.chunk}, shuffle {args.shuffle} rows in all, "
          f"inline, medians of {args.rounds} round(s)")
    print(f"{'job':6} {'lanes':>6} {'Mtok/s':>7} {'PSS MB':>7} {'padding':>8} {'rho':>6} "
          f"{'disp':>6} {'state B/lane':>12} {'replayed':>9} {'resume s':>9}")
    med: dict[tuple[str, int], dict[str, float]] = {}
    for (job, lanes), runs in results.items():
        m = med[(job, lanes)] = {k: statistics.median(r[k] for r in runs) for k in keys}
        print(f"{job:6} {lanes:>6} {m['mtok_s']:>7.2f} {m['pss_mb']:>7.0f} "
              f"{m['padding']:>8.4f} {m['rho']:>6.3f} {m['disp']:>6.3f} "
              f"{m['bytes_per_lane']:>12.0f} {m['replayed']:>9.0f} {m['resume_s']:>9.2f}")
    for job in args.jobs.split(","):
        base = med[(job, lanes_list[0])]
        for lanes in lanes_list[1:]:
            m = med[(job, lanes)]
            print(f"{job} {lanes} lanes / {lanes_list[0]}: throughput "
                  f"{m['mtok_s'] / base['mtok_s']:.2f}x, "
                  f"peak PSS {m['pss_mb'] / base['pss_mb']:.2f}x, "
                  f"padding {m['padding'] / max(base['padding'], 1e-12):.2f}x, replayed "
                  f"{m['replayed'] / max(base['replayed'], 1):.1f}x")


if __name__ == "__main__":
    main()
