"""The canonical text job, zephon_torch against a hand-written loop, side by side.

JSONL -> parse -> tokenize with EOS -> pack into flat 2049-token rows with
per-document positions -> shuffle (buffer 1024) -> batch 8 ->
``input_ids``/``labels`` tensors. Every contender runs in a child process of
its own (so peak RSS is its own), round-robin over several rounds, and
reports non-pad tokens/s and peak RSS; all must deliver the same number of
non-pad tokens.

Contenders:
* ``handwritten``: ``encode_batch_fast`` + numpy first-fit packing (8 bins) + a
  shuffle buffer + batching, the fastest reasonable plain loop;
* ``zephon-inline``, ``zephon-threads-2``, ``zephon-process-2``.

It also measures peak memory of the zephon inline run on 1x and 10x the
corpus (the 10x corpus is the same files repeated), which should be equal
within 10%.

Run: ``.venv/bin/python benchmarks/bench_pipeline.py [--mb 20 --rounds 3]``.
The corpus and tokenizer are generated under ``benchmarks/.data`` once.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data"
ROW = 2049
EOS_TOKEN = "<|endoftext|>"
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "data pipeline token model lane chunk shard packing shuffle batch training river stone "
    "mountain seven eleven orange yellow quantum lattice harbor engine signal"
).split()


# ---------------------------------------------------------------- data


def make_corpus(mb: float, seed: int = 0, words: int | None = None) -> Path:
    """JSONL shards (4 MB each) of heavy-tailed documents, ``mb`` megabytes in all
    (``words``: documents of about that many words each instead)."""
    folder = DATA / (f"corpus-{mb:g}mb" if words is None else f"corpus-{mb:g}mb-{words}w")
    done = folder / ".done"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    target = int(mb * 1e6)
    written, shard = 0, 0
    while written < target:
        lines = []
        size = 0
        while size < 4_000_000 and written + size < target:
            n = (max(1, int(rng.lognormal(5.0, 1.1))) if words is None
                 else max(1, int(rng.normal(words, words / 6))))
            picked = rng.choice(len(WORDS), size=n)
            text = " ".join(WORDS[w] for w in picked)
            line = json.dumps({"text": text}) + "\n"
            lines.append(line)
            size += len(line)
        (folder / f"part-{shard:04d}.jsonl").write_text("".join(lines))
        written += size
        shard += 1
    done.touch()
    return folder


def make_tokenizer(corpus: Path) -> Path:
    """A byte-level BPE (vocab 8192) trained on the first shard."""
    path = DATA / "tokenizer.json"
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    first = sorted(corpus.glob("*.jsonl"))[0]
    texts = [json.loads(line)["text"] for line in first.read_text().splitlines()]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


# ---------------------------------------------------------------- contenders


def handwritten(files: list[Path], tokenizer_path: Path) -> int:
    """The plain loop: the same work as the zephon job, in straight Python + numpy."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    # The call zephon's tokenize makes: without character offsets when available.
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    eos = tok.token_to_id(EOS_TOKEN)
    rng = np.random.default_rng(0)
    bins: list[list[np.ndarray]] = []
    room: list[int] = []
    shuffle_buf: list[tuple[np.ndarray, int, np.ndarray]] = []
    batch: list[tuple[np.ndarray, int, np.ndarray]] = []
    delivered = 0

    def emit_row(pieces: list[np.ndarray]) -> None:
        nonlocal delivered
        used = sum(len(p) for p in pieces)
        row = np.zeros(ROW, dtype=np.int32)
        row[:used] = np.concatenate(pieces)
        pos = np.concatenate([np.arange(len(p), dtype=np.int32) for p in pieces]
                             + [np.arange(ROW - used, dtype=np.int32)])
        shuffle_buf.append((row, used, pos))
        if len(shuffle_buf) >= 1024:
            i = int(rng.integers(len(shuffle_buf)))
            shuffle_buf[i], shuffle_buf[-1] = shuffle_buf[-1], shuffle_buf[i]
            take(shuffle_buf.pop())

    def take(item: tuple) -> None:
        nonlocal delivered
        batch.append(item)
        if len(batch) == 8:
            flush_batch()

    def flush_batch() -> None:
        nonlocal delivered
        rows = torch.from_numpy(np.stack([b[0] for b in batch]).astype(np.int64))
        positions = torch.from_numpy(np.stack([b[2] for b in batch])[:, :-1].astype(np.int64))
        labels = rows[:, 1:].clone()
        for i, b in enumerate(batch):
            labels[i, b[1] - 1:] = -100
        _ = (rows[:, :-1], labels, positions)
        delivered += sum(b[1] for b in batch)
        batch.clear()

    def add(doc: np.ndarray) -> None:
        for start in range(0, len(doc), ROW):
            piece = doc[start:start + ROW]
            for i, r in enumerate(room):
                if len(piece) <= r:
                    bins[i].append(piece)
                    room[i] -= len(piece)
                    if room[i] == 0:
                        emit_row(bins.pop(i))
                        room.pop(i)
                    break
            else:
                if len(bins) == 8:
                    full = int(np.argmin(room))
                    emit_row(bins.pop(full))
                    room.pop(full)
                bins.append([piece])
                room.append(ROW - len(piece))

    for path in files:
        with open(path, "rb") as fh:
            texts: list[str] = []
            for line in fh:
                texts.append(json.loads(line)["text"])
                if len(texts) == 256:
                    for enc in encode(texts, add_special_tokens=False):
                        add(np.array([*enc.ids, eos], dtype=np.int32))
                    texts = []
            for enc in encode(texts, add_special_tokens=False):
                add(np.array([*enc.ids, eos], dtype=np.int32))
    for pieces in bins:
        emit_row(pieces)
    while shuffle_buf:
        take(shuffle_buf.pop())
    if batch:
        flush_batch()
    return delivered


def zephon(files: list[Path], tokenizer_path: Path, runner: str, workers: int) -> int:
    """The same job as a zephon_torch pipeline."""
    from tokenizers import Tokenizer

    import zephon_torch as zt

    tok = Tokenizer.from_file(str(tokenizer_path))
    pipe = (
        zt.Pipeline.from_jsonl([str(f) for f in files], num_lanes=1, chunk_size=512,
                               shuffle=False)
        .fetch().decode_text()
        .tokenize(tok, special_tokens="eos")
        .pack_flat(ROW, num_bins=8)
        .shuffle(1024, seed=0)
        .batch(8, drop_last=False)
    )
    delivered = 0
    it = pipe.iter(runner=runner, num_workers=workers)
    for batch in it:
        out = batch.to_training(return_labels=True, return_num_valid_tokens=True)
        delivered += sum(ROW - (r.meta.padding_length or 0) for r in batch)
        del out
    it.close()
    return delivered


def run_child(args: argparse.Namespace) -> None:
    files = [Path(p) for p in args.files.split(",")]
    # Imports are paid before the clock starts: the job is measured, not start-up.
    import tokenizers  # noqa: F401
    import torch  # noqa: F401

    import zephon_torch  # noqa: F401

    start = time.perf_counter()
    if args.child == "handwritten":
        tokens = handwritten(files, Path(args.tokenizer))
    else:
        _, runner, workers = args.child.split("-")
        tokens = zephon(files, Path(args.tokenizer), runner, int(workers))
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens": tokens, "seconds": seconds, "peak_mb": peak_mb}))


def child(name: str, files: list[Path], tokenizer: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--tokenizer", str(tokenizer),
           "--files", ",".join(str(f) for f in files)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0, help="corpus size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-mb", type=float, default=4.0,
                        help="base corpus of the 1x/10x memory comparison")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return

    corpus = make_corpus(args.mb)
    tokenizer = make_tokenizer(corpus)
    files = sorted(corpus.glob("*.jsonl"))
    names = ["handwritten", "zephon-inline-1", "zephon-threads-2", "zephon-process-2"]
    results: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            results[name].append(child(name, files, tokenizer))
    tokens = {n: {r["tokens"] for r in rs} for n, rs in results.items()}
    if len({t for ts in tokens.values() for t in ts}) != 1:
        raise SystemExit(f"contenders delivered different token counts: {tokens}")
    base = statistics.median(r["tokens"] / r["seconds"] for r in results["handwritten"])
    print(f"canonical text job, {args.mb:g} MB JSONL, {next(iter(tokens['handwritten']))} "
          f"non-pad tokens, median (min-max) of {args.rounds} rounds")
    print("| contender | tokens/s | vs handwritten | peak RSS MB |")
    print("| --- | --- | --- | --- |")
    for name, rs in results.items():
        rates = [r["tokens"] / r["seconds"] for r in rs]
        med = statistics.median(rates)
        print(f"| {name} | {med:,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | "
              f"{med / base:.2f}x | {statistics.median(r['peak_mb'] for r in rs):.0f} |")
    print("targets: zephon-inline >= 0.9x handwritten, zephon-process-2 >= 1.0x")

    small = sorted(make_corpus(args.memory_mb, seed=1).glob("*.jsonl"))
    large = sorted(make_corpus(args.memory_mb * 10, seed=2).glob("*.jsonl"))
    one = child("zephon-inline-1", small, tokenizer)["peak_mb"]
    ten = child("zephon-inline-1", large, tokenizer)["peak_mb"]
    print(f"peak RSS, zephon inline: 1x ({args.memory_mb:g} MB) {one:.0f} MB, "
          f"10x {ten:.0f} MB, ratio {ten / one:.2f} (target within 10%)")


if __name__ == "__main__":
    main()
