"""zephon_torch.DataLoader against torch.utils.data.DataLoader, side by side.

Two jobs (``--job``), the same for both loaders:

* ``text`` (the default): JSONL -> tokenize with EOS (the byte-level BPE of
  ``bench_pipeline.py``, trained on the fly once) -> first-fit packing into
  flat 2049-token rows (8 open bins) -> batches of 8 -> ``input_ids``,
  ``labels`` (padding ignored) and ``positions`` tensors;
* ``token``: the same from pre-tokenized Parquet (``_compare_data.py``'s
  token corpus in its many-row-group layout: shards of 4,608 documents in
  row groups of 1,024, EOS appended), without tokenization.

The contenders:

* ``zephon``: ``zephon_torch.DataLoader(pipe, num_workers=N,
  to_training={"return_labels": True})``: N lane workers, each running the
  whole pipeline and ``to_training`` for its share of the lanes (``0``: the
  pipeline in the training process, on the loader's prefetch thread). The
  pipeline has ``--lanes`` lanes (default ``max(1, N)``);
* ``torch``: ``torch.utils.data.DataLoader(PackedBatches(...),
  batch_size=None, num_workers=N)`` over a hand-written ``IterableDataset``
  whose worker ``k`` of ``N`` takes every N-th chunk of 512 lines (text) or
  row group (token), tokenizes with ``encode_batch_fast`` (``encode_batch``
  on old ``tokenizers``), as zephon does, and packs and batches in numpy,
  as a careful user would write it, its workers returning tensors;
* ``zephon-process`` (``--runners lanes,process``): ``runner="process"``,
  the stage-parallel pool of N workers in an engine process; with few lanes
  (``--lanes 1``) and heavy stages it is the one that scales;
* ``torch-np`` (token job): the same, its workers returning numpy arrays that
  the training loop turns into tensors (``torch.from_numpy``): a worker that
  returns tensors hands them over through torch's shared-memory file
  descriptors, slow for batches this cheap to make. The zephon/torch ratio
  of the token job is against the faster of the two.

Two measurements, each contender in a child process of its own, round-robin
over several rounds (median reported):

1. **throughput**: batches/s over the whole run, from ``iter()`` to the last
   batch, start-up (spawning processes, importing) included; the time to the
   first batch is also shown. A rate counted from the first batch would
   flatter the loader that works furthest ahead before handing over its
   first batch (on a small corpus, most of the work). The ratio
   zephon/torch is printed (target >= 1.0x), and the peak PSS of the
   loader's whole process tree during the run (workers included, sampled
   every 50 ms as ``compare.py`` does; target <= 1.2x torch's);
2. **data wait**: a training loop whose step is ``time.sleep(0.05)``; once
   warm (after the first ``--warm`` steps) the mean time ``next()`` blocks,
   as % of the step time (target < 1%).

``--base TREE`` adds ``zephon-base``: the same zephon contender run from
another checkout of the package (``TREE`` holds its ``zephon_torch``; for
example a worktree of the commit before a change), so that a change is
measured before and after in one run, round-robin with the others.

``--shuffle ROWS`` adds a shuffle buffer of ``ROWS`` packed rows in all to
both loaders (zephon: ``.shuffle(ROWS)`` after packing; torch: ``ROWS /
num_workers`` rows in each worker), for the time to the first batch with a
buffer of the same total size.

Run: ``.venv/bin/python benchmarks/bench_loader.py [--job text --mb 60 --workers 0,2
--rounds 3 --shuffle 0]``. The corpora and the tokenizers are generated under
``benchmarks/.data`` once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_pipeline import EOS_TOKEN, ROW, make_corpus, make_tokenizer  # noqa: E402

BATCH = 8
BINS = 8
CHUNK_LINES = 512
STEP_SECONDS = 0.05


# ---------------------------------------------------------------- the torch contender


class _FirstFit:
    """First-fit packing into rows of ``ROW`` tokens with ``BINS`` open bins."""

    def __init__(self) -> None:
        self.bins: list[list[np.ndarray]] = []
        self.room: list[int] = []

    def add(self, doc: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        for start in range(0, len(doc), ROW):
            piece = doc[start:start + ROW]
            for i, room in enumerate(self.room):
                if len(piece) <= room:
                    self.bins[i].append(piece)
                    self.room[i] -= len(piece)
                    if self.room[i] == 0:
                        self.room.pop(i)
                        yield _row(self.bins.pop(i))
                    break
            else:
                if len(self.bins) == BINS:
                    fullest = int(np.argmin(self.room))
                    self.room.pop(fullest)
                    yield _row(self.bins.pop(fullest))
                self.bins.append([piece])
                self.room.append(ROW - len(piece))

    def flush(self) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        while self.bins:
            self.room.pop(0)
            yield _row(self.bins.pop(0))


def _row(pieces: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    used = sum(len(p) for p in pieces)
    tokens = np.zeros(ROW, dtype=np.int32)
    tokens[:used] = np.concatenate(pieces)
    positions = np.concatenate([np.arange(len(p), dtype=np.int32) for p in pieces]
                               + [np.arange(ROW - used, dtype=np.int32)])
    return tokens, positions, used


def _collate(rows: list[tuple[np.ndarray, np.ndarray, int]], tensors: bool = True
             ) -> dict[str, Any]:
    tokens = np.stack([r[0] for r in rows]).astype(np.int64)
    positions = np.ascontiguousarray(np.stack([r[1] for r in rows])[:, :-1].astype(np.int64))
    labels = tokens[:, 1:].copy()
    for i, (_, _, used) in enumerate(rows):
        labels[i, used - 1:] = -100  # labels that fall in the trailing padding
    batch = {"input_ids": np.ascontiguousarray(tokens[:, :-1]), "labels": labels,
             "positions": positions}
    if not tensors:
        return batch
    import torch

    return {key: torch.from_numpy(value) for key, value in batch.items()}


def _text_docs(files: list[str], tokenizer_path: str, worker: int, workers: int
               ) -> Iterator[np.ndarray]:
    """Worker ``worker``'s chunks of 512 lines, tokenized with EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    eos = tok.token_to_id(EOS_TOKEN)
    # The call zephon's tokenize makes: without character offsets when available.
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    for index, lines in enumerate(_chunks(files)):
        if index % workers != worker:
            continue
        texts = [json.loads(line)["text"] for line in lines]
        for enc in encode(texts, add_special_tokens=False):
            yield np.array([*enc.ids, eos], dtype=np.int32)


def _token_docs(files: list[str], worker: int, workers: int) -> Iterator[np.ndarray]:
    """Worker ``worker``'s row groups of the Parquet shards, document by document."""
    from _compare_contenders import read_row_group, row_groups

    for path, group in row_groups(files, worker, workers):
        yield from read_row_group(path, group)


def _shuffled(rows: Iterator[Any], size: int, seed: int) -> Iterator[Any]:
    """A shuffle buffer of ``size`` rows, as a user writes one (0: no shuffle)."""
    if size <= 0:
        yield from rows
        return
    rng = np.random.default_rng(seed)
    buffer: list[Any] = []
    for row in rows:
        if len(buffer) < size:
            buffer.append(row)
            continue
        i = int(rng.integers(size))
        buffer[i], row = row, buffer[i]
        yield row
    rng.shuffle(buffer)
    yield from buffer


def packed_batches_dataset(files: list[str], tokenizer_path: str, job: str = "text",
                           tensors: bool = True, shuffle: int = 0) -> Any:
    """The hand-written ``IterableDataset`` (built here so torch is imported lazily).

    ``shuffle`` is the total shuffle buffer in rows, split over the workers.
    """
    import torch.utils.data

    class PackedBatches(torch.utils.data.IterableDataset):
        """Worker ``k`` of ``N``: chunks (row groups) ``k, k+N, ...``, packed and batched."""

        def __iter__(self) -> Iterator[dict[str, Any]]:
            info = torch.utils.data.get_worker_info()
            worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
            docs = (_text_docs(files, tokenizer_path, worker, workers) if job == "text"
                    else _token_docs(files, worker, workers))
            packer = _FirstFit()

            def packed() -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
                for doc in docs:
                    yield from packer.add(doc)
                yield from packer.flush()

            rows: list[tuple[np.ndarray, np.ndarray, int]] = []
            for row in _shuffled(packed(), -(-shuffle // workers), seed=worker):
                rows.append(row)
                if len(rows) == BATCH:
                    yield _collate(rows, tensors)
                    rows = []
            if rows:
                yield _collate(rows, tensors)

    return PackedBatches()


def _as_is(batch: Any) -> Any:
    return batch


class _TensorsHere:
    """A torch loader whose workers return numpy arrays, made tensors in this process."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        for batch in self.loader:
            yield {key: torch.from_numpy(value) for key, value in batch.items()}


def _chunks(files: list[str]) -> Iterator[list[bytes]]:
    chunk: list[bytes] = []
    for path in files:
        with open(path, "rb") as fh:
            for line in fh:
                chunk.append(line)
                if len(chunk) == CHUNK_LINES:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


# ---------------------------------------------------------------- the loaders


def make_loader(name: str, files: list[str], tokenizer_path: str, workers: int,
                job: str = "text", lanes: int | None = None, shuffle: int = 0) -> Any:
    if name in ("torch", "torch-np"):
        import torch.utils.data

        tensors = name == "torch"
        # torch-np: no collate_fn of torch's (its default turns arrays into tensors).
        loader = torch.utils.data.DataLoader(
            packed_batches_dataset(files, tokenizer_path, job, tensors=tensors,
                                   shuffle=shuffle),
            batch_size=None, num_workers=workers, collate_fn=None if tensors else _as_is)
        return loader if tensors else _TensorsHere(loader)
    import zephon_torch as zt
    from zephon_torch.torch.loader import DataLoader

    # zephon-base: the same contender, from the checkout on PYTHONPATH (see child()).
    runner = "process" if name == "zephon-process" else None
    source = {"num_lanes": lanes or max(1, workers), "chunk_size": CHUNK_LINES,
              "shuffle": False}
    if job == "text":
        from tokenizers import Tokenizer

        pipe = (zt.Pipeline.from_jsonl(files, **source).fetch().decode_text()
                .tokenize(Tokenizer.from_file(tokenizer_path), special_tokens="eos"))
    else:
        pipe = zt.Pipeline.from_parquet(files, columns=["input_ids"], **source).fetch()
    pipe = pipe.pack_flat(ROW, num_bins=BINS)
    if shuffle:
        pipe = pipe.shuffle(shuffle, seed=0)
    pipe = pipe.batch(BATCH, drop_last=False)
    return DataLoader(pipe, num_workers=workers, runner=runner,
                      to_training={"return_labels": True})


def throughput(loader: Any) -> dict[str, Any]:
    start = time.perf_counter()
    it = iter(loader)
    batches = 0
    tokens = 0
    first = None
    for batch in it:
        if first is None:
            first = time.perf_counter()
        batches += 1
        tokens += int((batch["labels"] != -100).sum())
    end = time.perf_counter()
    if first is None:
        raise SystemExit("the loader produced no batch")
    # The whole run, start-up included: a rate counted from the first batch
    # would flatter a loader that works further ahead before handing it over.
    return {"batches": batches, "tokens": tokens, "first_batch_s": first - start,
            "batches_per_s": batches / (end - start)}


def data_wait(loader: Any, steps: int, warm: int) -> dict[str, Any]:
    it = iter(loader)
    waits = []
    for step in range(warm + steps):
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        if step >= warm:
            waits.append(time.perf_counter() - t0)
        time.sleep(STEP_SECONDS)  # the simulated training step, holding its batch
        del batch  # freed by the step, as in a training loop, not while waiting
    close = getattr(it, "close", None) or getattr(loader, "close", None)
    if close is not None:
        close()
    del it
    if not waits:
        raise SystemExit("the corpus is too small for the data-wait measurement")
    return {"steps": len(waits), "mean_ms": 1e3 * statistics.fmean(waits),
            "p99_ms": 1e3 * float(np.percentile(waits, 99)), "max_ms": 1e3 * max(waits)}


def run_child(args: argparse.Namespace) -> None:
    files = args.files.split(",")
    # Imports are paid before any clock starts.
    import tokenizers  # noqa: F401
    import torch  # noqa: F401

    import zephon_torch.torch.loader  # noqa: F401

    loader = make_loader(args.child, files, args.tokenizer, int(args.workers), args.job,
                         args.lanes, args.shuffle)
    if args.measure == "throughput":
        from compare import _TreeMemory  # the peak PSS of this process and its workers

        with _TreeMemory() as memory:
            result = throughput(loader)
            close = getattr(loader, "close", None)
            if close is not None:
                close()
        result["peak_pss_mb"] = memory.peak
    else:
        result = data_wait(loader, args.steps, args.warm)
    print(json.dumps(result))


def child(name: str, workers: int, measure: str, files: list[Path], tokenizer: Path,
          args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", name, "--measure", measure,
           "--tokenizer", str(tokenizer), "--files", ",".join(str(f) for f in files),
           "--workers", str(workers), "--steps", str(args.steps), "--warm", str(args.warm),
           "--job", args.job, "--shuffle", str(args.shuffle)]
    if args.lanes:
        cmd += ["--lanes", str(args.lanes)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if name == "zephon-base":  # the package of the other checkout, first on the path
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(args.base).resolve()), env.get("PYTHONPATH")) if p)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{name} {measure} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=("text", "token"), default="text",
                        help="text: JSONL, tokenized; token: pre-tokenized Parquet")
    parser.add_argument("--mb", type=float, default=60.0, help="corpus size (of the text "
                        "the token corpus is made from, for --job token)")
    parser.add_argument("--doc-words", type=int, default=None,
                        help="text job: documents of about this many words each (600 makes "
                        "them about 3.6 KB) instead of the heavy-tailed mix")
    parser.add_argument("--lanes", type=int, default=None,
                        help="zephon's num_lanes (default: max(1, num_workers))")
    parser.add_argument("--shuffle", type=int, default=0,
                        help="a shuffle buffer of this many packed rows in all (zephon: "
                        ".shuffle(n) after packing; torch: n / num_workers rows per worker)")
    parser.add_argument("--runners", default="lanes",
                        help="zephon's runners: lanes (the default) and/or process")
    parser.add_argument("--base", default=None,
                        help="also run zephon from this checkout (its zephon_torch), as "
                        "zephon-base: a change before and after in one run")
    parser.add_argument("--workers", default="0,2",
                        help="comma-separated num_workers values, the same for both loaders")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="measured steps (data wait)")
    parser.add_argument("--warm", type=int, default=10, help="steps before measuring")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return

    files, tokenizer = job_data(args.job, args.mb, args.doc_words)
    counts = [int(w) for w in str(args.workers).split(",")]
    torch_names = ("torch",) if args.job == "text" else ("torch", "torch-np")
    extra = [r for r in str(args.runners).split(",") if r != "lanes"]
    zephons = ("zephon", *(f"zephon-{r}" for r in extra))  # lane workers, always
    if args.base:
        if not (Path(args.base) / "zephon_torch" / "__init__.py").is_file():
            raise SystemExit(f"--base {args.base!r} holds no zephon_torch package: give the "
                             "root of a checkout of this repository")
        zephons = (*zephons, "zephon-base")
    names = (*zephons, *torch_names)
    contenders = [(name, w) for w in counts for name in names]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in contenders}
    for _ in range(args.rounds):
        for name, w in contenders:
            runs[(name, w)].append(child(name, w, "throughput", files, tokenizer, args))
    what = ("JSONL, tokenize" if args.job == "text" and not args.doc_words else
            f"JSONL of ~{args.doc_words}-word documents, tokenize" if args.job == "text" else
            "(as text) pre-tokenized Parquet, several row groups a shard,")
    shuffled = f" + shuffle {args.shuffle} rows" if args.shuffle else ""
    print(f"loader benchmark ({args.job} job): {args.mb:g} MB {what} + pack {ROW}{shuffled} + "
          f"batch {BATCH}, {os.cpu_count()} CPUs, median of {args.rounds} rounds")
    print("| loader | num_workers | batches | non-pad tokens | batches/s over the whole run, "
          "start-up included (min-max) | first batch s | peak PSS MB, all processes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rate = {}
    for (name, w), rs in runs.items():
        rates = [r["batches_per_s"] for r in rs]
        rate[(name, w)] = statistics.median(rates)
        print(f"| {name} | {w} | {rs[0]['batches']} | {rs[0]['tokens']:,} | "
              f"{rate[(name, w)]:.1f} ({min(rates):.1f}-{max(rates):.1f}) | "
              f"{statistics.median(r['first_batch_s'] for r in rs):.2f} | "
              f"{statistics.median(r['peak_pss_mb'] for r in rs):.0f} |")
    for w in counts:
        best = max(torch_names, key=lambda name: rate[(name, w)])
        print(f"num_workers={w}: zephon/torch {rate[('zephon', w)] / rate[(best, w)]:.2f}x "
              f"(against {best})")
    best_zephon = max(counts, key=lambda w: rate[("zephon", w)])
    best_torch = max(((name, w) for name in torch_names for w in counts), key=rate.__getitem__)
    print(f"best: zephon at num_workers={best_zephon} / {best_torch[0]} at num_workers="
          f"{best_torch[1]}: {rate[('zephon', best_zephon)] / rate[best_torch]:.2f}x")
    if 0 in counts and 2 in counts:
        print(f"zephon at 2 workers / at 0: {rate[('zephon', 2)] / rate[('zephon', 0)]:.2f}x")
    if "zephon-base" in zephons:
        for w in counts:
            print(f"num_workers={w}: zephon/zephon-base "
                  f"{rate[('zephon', w)] / rate[('zephon-base', w)]:.2f}x")
    if "zephon-process" in zephons:
        for w in counts:
            print(f"num_workers={w}: lanes/process "
                  f"{rate[('zephon', w)] / rate[('zephon-process', w)]:.2f}x")
    first = {key: statistics.median(r["first_batch_s"] for r in rs) for key, rs in runs.items()}
    for w in counts:
        best = min(torch_names, key=lambda name: first[(name, w)])
        print(f"num_workers={w}: first batch zephon/{best} "
              f"{first[('zephon', w)] / first[(best, w)]:.2f}x")
    pss = {key: statistics.median(r["peak_pss_mb"] for r in rs) for key, rs in runs.items()}
    for w in counts:
        best = min(torch_names, key=lambda name: pss[(name, w)])
        print(f"num_workers={w}: peak PSS zephon/{best} "
              f"{pss[('zephon', w)] / pss[(best, w)]:.2f}x")
    print("targets: >= 1.0x; first batch <= 2x; peak PSS <= 1.2x")

    top = max(counts)
    print(f"data wait with a simulated {STEP_SECONDS * 1e3:.0f} ms step, num_workers={top}, "
          f"after {args.warm} warm-up steps, {args.steps} steps measured")
    print("| loader | mean wait ms | % of step | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        w = child(name, top, "wait", files, tokenizer, args)
        print(f"| {name} | {w['mean_ms']:.3f} | {w['mean_ms'] / (STEP_SECONDS * 1e3):.2%} | "
              f"{w['p99_ms']:.3f} | {w['max_ms']:.3f} |")
    print("target: zephon mean wait < 1% of the step")


def job_data(job: str, mb: float, words: int | None = None) -> tuple[list[Path], Path]:
    """The files of ``job`` and the tokenizer (generated once under ``benchmarks/.data``)."""
    if job == "text":
        corpus = make_corpus(mb, words=words)
        return sorted(corpus.glob("*.jsonl")), make_tokenizer(make_corpus(mb))
    from _compare_data import make_corpus as make_compare_corpus
    from _compare_data import make_token_shards_rg, parquet_files
    from _compare_data import make_tokenizer as make_compare_tokenizer

    tokenizer = make_compare_tokenizer()
    shards = make_token_shards_rg(make_compare_corpus(mb), tokenizer)
    return parquet_files(shards), tokenizer


if __name__ == "__main__":
    main()
