"""Time to the first batch after ``load_state_dict``, against a fresh start.

The canonical text job (JSONL -> tokenize with EOS -> pack_flat 2049 ->
shuffle 1024 -> batch 8) runs to 10% and to 90% of the corpus, saves its
state (through JSON), and a new iterator resumes from it. A resume replays
each lane's current epoch only, so its time to first batch should stay
within 2x a fresh start and not depend on how deep the checkpoint is.
Side by side in one process, median of the rounds.

Run: ``.venv/bin/python benchmarks/bench_resume.py [--mb 20 --rounds 3]``
(uses the corpus and tokenizer of ``bench_pipeline.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench_pipeline import make_corpus, make_tokenizer

from zephon_torch.pipeline import Pipeline


def build(files: list, tokenizer_path: str) -> Pipeline:
    from tokenizers import Tokenizer

    import zephon_torch as zt

    tok = Tokenizer.from_file(tokenizer_path)
    return (
        zt.Pipeline.from_jsonl([str(f) for f in files], num_lanes=4, chunk_size=256, seed=0)
        .fetch().decode_text()
        .tokenize(tok, special_tokens="eos")
        .pack_flat(2049, num_bins=8)
        .shuffle(1024, seed=0)
        .batch(8, drop_last=True)
    )


def first_batch_seconds(pipe: Pipeline, state: dict | None) -> tuple[float, int]:
    start = time.perf_counter()
    it = pipe.iter(runner="inline")
    if state is not None:
        it.load_state_dict(state)
    next(it)
    seconds = time.perf_counter() - start
    replayed = it.stats()["replayed_samples"]
    it.close()
    return seconds, replayed


def state_at(pipe: Pipeline, fraction: float, total: int) -> dict:
    it = pipe.iter(runner="inline")
    for _ in range(int(total * fraction)):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    corpus = make_corpus(args.mb)
    tokenizer = str(make_tokenizer(corpus))
    pipe = build(sorted(corpus.glob("*.jsonl")), tokenizer)
    it = pipe.iter(runner="inline")
    total = sum(1 for _ in it)
    states = {f: state_at(pipe, f, total) for f in (0.1, 0.9)}
    timings: dict[str, list[float]] = {"fresh": [], "resume at 10%": [], "resume at 90%": []}
    replayed: dict[str, int] = {}
    for _ in range(args.rounds):
        timings["fresh"].append(first_batch_seconds(pipe, None)[0])
        for f, state in states.items():
            name = f"resume at {int(f * 100)}%"
            seconds, replayed[name] = first_batch_seconds(pipe, state)
            timings[name].append(seconds)
    fresh = statistics.median(timings["fresh"])
    print(f"canonical job on {args.mb:g} MB, {total} batches; time to first batch, "
          f"median of {args.rounds} rounds")
    for name, values in timings.items():
        med = statistics.median(values)
        extra = f", {replayed[name]} samples replayed" if name in replayed else ""
        print(f"  {name:<14} {med * 1000:8.1f} ms  ({med / fresh:.2f}x fresh{extra})")
    print("target: resume <= 2x fresh, and the same at 10% and 90%")


if __name__ == "__main__":
    main()
