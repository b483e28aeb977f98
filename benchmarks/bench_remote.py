"""Remote tokenization on a local Ray cluster against the process runner.

Three measurements, side by side in one run, on a local Ray instance with
as many CPUs as the machine (``--cpus``):

1. **Per-micro-batch overhead of a remote stage.** An identity operator on
   micro-batches of 64 tokenized records (int32 arrays, as ``tokenize``
   emits), placed on one Ray actor, against the same operator inline:

   * *round trip*: one micro-batch submitted and awaited at a time (latency);
   * *pipelined*: a full pipeline with the identity stage remote, minus the
     same pipeline inline, divided by the micro-batches (what each one costs
     when several are in flight), and the driver's own CPU time per
     micro-batch (``time.process_time``: the serial part that bounds how
     many micro-batches per second one driver can feed to any cluster).

2. **The canonical job** of ``bench_pipeline.py`` (JSONL -> parse ->
   tokenize -> pack_flat 2049 -> shuffle 1024 -> batch 8): ``process-N``
   (everything in N worker processes) against ``remote-tokenize`` (tokenize
   on N Ray actors, the other stages inline) and ``remote-tokenize+process``
   (the other stages in N worker processes). Non-pad tokens/s of whole runs
   and their ratio, the start-up (a run over 8 documents: pools, actors,
   set-up) and the steady rate without it; every contender must deliver the
   same tokens.

3. The tokenize compute time per micro-batch (inline), from which
   ``docs/remote-stages.md`` derives when a cluster pays off.

Run: ``.venv/bin/python benchmarks/bench_remote.py [--mb 8 --rounds 3]``.
The corpus and tokenizer are generated under ``benchmarks/.data`` once
(shared with ``bench_pipeline.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_pipeline import ROW, make_corpus, make_tokenizer  # noqa: E402


def canonical(files: list[Path], tok: Any, placement: Any) -> Any:
    import zephon_torch as zt

    return (
        zt.Pipeline.from_jsonl([str(f) for f in files], num_lanes=1, chunk_size=512,
                               shuffle=False)
        .fetch().decode_text()
        .tokenize(tok, special_tokens="eos", placement=placement)
        .pack_flat(ROW, num_bins=8)
        .shuffle(1024, seed=0)
        .batch(8, drop_last=False)
    )


def run_job(pipe: Any, runner: str, workers: int) -> dict[str, float]:
    """Non-pad tokens and wall seconds of a whole run (pool start-up included)."""
    start = time.perf_counter()
    it = pipe.iter(runner=runner, num_workers=workers)
    tokens = 0
    for batch in it:
        tokens += sum(ROW - (r.meta.padding_length or 0) for r in batch)
    it.close()
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def tiny_corpus(files: list[Path]) -> list[Path]:
    """The first 8 documents: a run over them measures the fixed start-up cost."""
    path = HERE / ".data" / "tiny.jsonl"
    if not path.exists():
        with open(files[0]) as fh:
            path.write_text("".join(next(fh) for _ in range(8)))
    return [path]


def identity_op() -> Any:
    """An operator whose ``process_many`` returns its input (pickled by value)."""
    from zephon_torch.ops.base import Operator

    class _Identity(Operator):
        name = "identity"

        def process_many(self, elems):
            return list(elems)

    return _Identity()


def token_records(files: list[Path], tok: Any, n: int) -> list[dict]:
    """The first ``n`` documents, tokenized (payloads as a remote stage sees them)."""
    import zephon_torch as zt

    pipe = (zt.Pipeline.from_jsonl([str(f) for f in files], num_lanes=1, shuffle=False)
            .fetch().decode_text().tokenize(tok, special_tokens="eos"))
    it = pipe.iter(runner="inline")
    out = []
    for rec in it:
        out.append(rec.payload)
        if len(out) == n:
            break
    it.close()
    return out


def overhead(payloads: list[dict], rounds: int, size: int) -> dict[str, float]:
    """Round-trip and pipelined cost of one remote micro-batch (identity operator)."""
    import zephon_torch as zt
    from zephon_torch.ops.base import OpContext
    from zephon_torch.runners.iterator import PipelineIterator
    from zephon_torch.runners.ray import RayPool

    # Round trip: one micro-batch at a time through one actor.
    base = zt.Pipeline.from_items(payloads, num_lanes=1, chunk_size=512)
    it = PipelineIterator(base, runner="inline")
    records = list(it)
    it.close()
    batches = [records[i:i + size] for i in range(0, len(records) - size + 1, size)]
    op = identity_op()
    from zephon_torch.ops.placement import set_placement

    set_placement(op, zt.Remote(num_actors=1, num_cpus=1))
    pool = RayPool([op], [OpContext(stage_name="identity")], [0])
    try:
        pool.submit(0, batches[0]).result()  # the actor is up
        trips = []
        for _ in range(max(1, rounds)):
            for batch in batches:
                t = time.perf_counter()
                pool.submit(0, batch).result()
                trips.append(time.perf_counter() - t)
    finally:
        pool.close()

    # Pipelined: the same records through a whole pipeline, remote against inline.
    def timed(placement: Any) -> tuple[float, float, int]:
        pipe = base.apply(identity_op(), placement=placement)
        it = pipe.iter(runner="inline", microbatch_sizes={"identity": size})
        first = next(it)  # actors up
        del first
        wall, cpu = time.perf_counter(), time.process_time()
        n = 1 + sum(1 for _ in it)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        mbs = it.stats()["stages"]["identity"]["microbatches"]
        it.close()
        assert n == len(payloads)
        return wall, cpu, mbs

    local_w, local_c, remote_w, remote_c = [], [], [], []
    for _ in range(max(1, rounds)):
        w, c, mbs = timed("local")
        local_w.append(w)
        local_c.append(c)
        w, c, _ = timed(zt.Remote(num_actors=1, num_cpus=1))
        remote_w.append(w)
        remote_c.append(c)
    ms = 1000.0 / mbs
    return {
        "trip_ms": 1000 * statistics.median(trips),
        "trip_p90_ms": 1000 * float(np.percentile(trips, 90)),
        "pipelined_ms": (statistics.median(remote_w) - statistics.median(local_w)) * ms,
        "driver_cpu_ms": (statistics.median(remote_c) - statistics.median(local_c)) * ms,
        "microbatches": mbs,
        "bytes_per_mb": sum(p["input_ids"].nbytes + len(p["text"]) for p in payloads)
        / len(payloads) * size,
        "tokens_per_mb": sum(len(p["input_ids"]) for p in payloads) / len(payloads) * size,
    }


def tokenize_cost(payloads: list[dict], tok: Any, rounds: int, size: int) -> float:
    """Seconds one core spends tokenizing one micro-batch of ``size`` documents."""
    from zephon_torch.ops.tokenize import Tokenize
    from zephon_torch.types import SampleMeta, SampleRecord

    op = Tokenize(tok, special_tokens="eos")
    _ = op.tokenizer  # built before the clock starts
    recs = [SampleRecord(SampleMeta(sample_id=(0, 0, i), lane_id=0, chunk_id=0),
                         {"text": p["text"]})
            for i, p in enumerate(payloads)]
    batches = [recs[i:i + size] for i in range(0, len(recs) - size + 1, size)]
    times = []
    for _ in range(max(1, rounds)):
        t = time.perf_counter()
        for batch in batches:
            op.process_many(batch)
        times.append((time.perf_counter() - t) / len(batches))
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="corpus size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                        help="CPUs of the local Ray instance, workers and actors")
    parser.add_argument("--overhead-docs", type=int, default=64 * 80)
    parser.add_argument("--overhead-sizes", default="64,512",
                        help="micro-batch sizes of the overhead measurement")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import ray
    from tokenizers import Tokenizer

    corpus = make_corpus(args.mb)
    tok = Tokenizer.from_file(str(make_tokenizer(corpus)))
    files = sorted(corpus.glob("*.jsonl"))
    here = str(Path(__file__).resolve().parent.parent)
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([here, str(HERE)])}})
    try:
        import zephon_torch as zt

        payloads = token_records(files, tok, args.overhead_docs)
        sizes = [int(x) for x in args.overhead_sizes.split(",")]
        costs = {size: overhead(payloads, args.rounds, size) for size in sizes}
        computes = {size: tokenize_cost(payloads, tok, args.rounds, size) for size in sizes}

        n = args.cpus
        jobs = {
            f"process-{n}": ("local", "process"),
            "remote-tokenize": (zt.Remote(num_actors=n), "inline"),
            "remote-tokenize+process": (zt.Remote(num_actors=n, num_cpus=0.5), "process"),
        }
        tiny = tiny_corpus(files)
        results: dict[str, list[dict[str, float]]] = {k: [] for k in jobs}
        startup: dict[str, list[float]] = {k: [] for k in jobs}
        for _ in range(args.rounds):
            for name, (placement, runner) in jobs.items():
                results[name].append(run_job(canonical(files, tok, placement), runner, n))
                startup[name].append(
                    run_job(canonical(tiny, tok, placement), runner, n)["seconds"])
    finally:
        ray.shutdown()

    tokens = {name: {r["tokens"] for r in rs} for name, rs in results.items()}
    if len({t for ts in tokens.values() for t in ts}) != 1:
        raise SystemExit(f"contenders delivered different token counts: {tokens}")
    print(f"remote stages on a local Ray instance ({args.cpus} CPUs), {args.rounds} rounds")
    for size, cost in costs.items():
        print(f"per-micro-batch overhead ({size} tokenized records, "
              f"{cost['bytes_per_mb'] / 1024:.0f} KiB, identity operator on 1 actor):")
        print(f"  round trip, one at a time: {cost['trip_ms']:.2f} ms median, "
              f"{cost['trip_p90_ms']:.2f} ms p90")
        print(f"  pipelined, remote minus inline: {cost['pipelined_ms']:.2f} ms wall per "
              f"micro-batch ({cost['microbatches']} micro-batches)")
        ceiling = 1000 / max(cost["driver_cpu_ms"], 1e-9)
        print(f"  driver CPU per micro-batch: {cost['driver_cpu_ms']:.2f} ms (one driver feeds "
              f"at most {ceiling:,.0f} micro-batches/s, {ceiling * cost['tokens_per_mb']:,.0f} "
              f"tokens/s at {cost['tokens_per_mb']:,.0f} tokens per micro-batch)")
        print(f"  tokenize compute per micro-batch of {size} documents (one core): "
              f"{computes[size] * 1000:.2f} ms")
    def rate(r: dict[str, float]) -> float:
        return r["tokens"] / r["seconds"]

    def steady(name: str, r: dict[str, float]) -> float:
        # NaN when the start-up is most of the run: use a bigger --mb.
        left = r["seconds"] - statistics.median(startup[name])
        return r["tokens"] / left if left > 0.2 * r["seconds"] else float("nan")

    base = statistics.median(rate(r) for r in results[f"process-{n}"])
    base_steady = statistics.median(steady(f"process-{n}", r) for r in results[f"process-{n}"])
    print(f"canonical text job, {args.mb:g} MB JSONL, {next(iter(tokens['process-' + str(n)]))} "
          "non-pad tokens, median (min-max); steady = whole run minus the start-up "
          "(a run over 8 documents)")
    print(f"| contender | tokens/s | vs process-{n} | start-up s | steady tokens/s | "
          f"steady vs process-{n} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rs in results.items():
        rates = [rate(r) for r in rs]
        med = statistics.median(rates)
        st = statistics.median(steady(name, r) for r in rs)
        print(f"| {name} | {med:,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | "
              f"{med / base:.2f}x | {statistics.median(startup[name]):.2f} | {st:,.0f} | "
              f"{st / base_steady:.2f}x |")


if __name__ == "__main__":
    main()
