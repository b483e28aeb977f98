"""``zephon-torch demo``: a generated corpus through the canonical pipeline, checkpointed
mid-way and resumed exactly (see ``cli.py`` for the whole story).

Part of the ``zephon-torch`` command (``cli.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from zephon_torch._cli_show import _canonical, _show_batch
from zephon_torch.pipeline import Pipeline
from zephon_torch.types import SampleBatch

_SHARDS = 4
_NUM_LANES = 4


# --------------------------------------------------------------------------- progress


class _Progress:
    """Batches, samples and tokens per second: a tqdm bar on a terminal, plain lines otherwise.

    Plain mode prints a line every ``every`` seconds (none for a short run);
    the caller prints the final summary in both modes from :meth:`close`.
    """

    def __init__(self, label: str, *, total: int | None = None, enabled: bool = True,
                 out: TextIO | None = None, every: float = 5.0) -> None:
        self.label = label
        self.out = out or sys.stdout
        self.every = every
        self.batches = self.samples = self.tokens = 0
        self.started = self._shown = time.perf_counter()
        self._bar: Any = None
        if enabled and self.out.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # the plain lines will do
                pass
            else:
                # tqdm glues the unit to the count ("333batch"): the space is ours.
                self._bar = tqdm(total=total, desc=f"  {label}", unit=" batches",
                                 file=self.out, dynamic_ncols=True, leave=True)

    def rates(self) -> tuple[float, float, float]:
        """Elapsed seconds, samples/s, tokens/s."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return elapsed, self.samples / elapsed, self.tokens / elapsed

    def update(self, samples: int, tokens: int) -> None:
        """Count one batch of ``samples`` rows holding ``tokens`` non-pad tokens."""
        self.batches += 1
        self.samples += samples
        self.tokens += tokens
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(1)
            if now - self._shown >= 0.2:  # formatting every batch would cost more than it shows
                _, per_sample, per_token = self.rates()
                self._bar.set_postfix_str(f"{per_sample:,.0f} samples/s, "
                                          f"{per_token:,.0f} tokens/s", refresh=False)
                self._shown = now
        elif now - self._shown >= self.every:
            _, per_sample, per_token = self.rates()
            print(f"  {self.label}: {self.batches} batches, {per_sample:,.0f} samples/s, "
                  f"{per_token:,.0f} tokens/s", file=self.out, flush=True)
            self._shown = now

    def close(self) -> tuple[float, float, float]:
        """Stop the bar; return :meth:`rates`."""
        result = self.rates()
        if self._bar is not None:
            _, per_sample, per_token = result
            self._bar.set_postfix_str(f"{per_sample:,.0f} samples/s, {per_token:,.0f} tokens/s")
            self._bar.close()
        return result


# --------------------------------------------------------------------------- helpers


def _row_tokens(batch: SampleBatch) -> int:
    """Non-pad tokens of a packed batch."""
    return sum(len(r.payload["input_ids"]) - (r.meta.padding_length or 0) for r in batch)


def _digest(batch: SampleBatch) -> str:
    """What makes two batches the same: sample ids, tokens and positions of every row."""
    h = hashlib.sha256()
    for record in batch:
        h.update(repr(record.meta.sample_id).encode())
        for key in ("input_ids", "positions"):
            h.update(np.ascontiguousarray(record.payload[key]).tobytes())
    return h.hexdigest()


def _consume(it: Iterator[SampleBatch], progress: _Progress, *,
             limit: int | None = None) -> tuple[list[str], SampleBatch | None]:
    """Take batches as a training loop would (``to_training`` included in the timing).

    Returns the digest of every batch taken (at most ``limit``) and the first batch.
    """
    digests: list[str] = []
    first = None
    for batch in it:
        batch.to_training(return_labels=True, return_cu_seqlens=True)
        digests.append(_digest(batch))
        if first is None:
            first = batch
        progress.update(len(batch), _row_tokens(batch))
        if limit is not None and len(digests) >= limit:
            break
    return digests, first


@contextmanager
def _workdir(out: str | None) -> Iterator[Path]:
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="zephon-demo-") as tmp:
            yield Path(tmp)


# --------------------------------------------------------------------------- demo


def _write_corpus(folder: Path, texts: Sequence[str]) -> list[str]:
    """JSONL shards, documents dealt round-robin; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(_SHARDS):
        path = folder / f"part-{shard:05d}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for i in range(shard, len(texts), _SHARDS):
                f.write(json.dumps({"id": i, "text": texts[i]}) + "\n")
        paths.append(str(path))
    return paths


def _demo_inputs(out: Path, args: argparse.Namespace) -> tuple[Any, Path, int]:
    """Write the corpus, train and save the tokenizer; returns it, its path, the EOS id."""
    from zephon_torch.demo import EOS, default_corpus, train_tokenizer

    texts = default_corpus(args.docs, seed=args.seed)
    paths = _write_corpus(out / "corpus", texts)
    words = np.array([len(t.split()) for t in texts])
    size = sum(os.path.getsize(p) for p in paths)
    print(f"corpus:    {len(texts):,} documents in {_SHARDS} JSONL shards, "
          f"{size / 1e6:.1f} MB, {int(np.median(words))} words median, "
          f"{int(words.max()):,} max -> {out / 'corpus'}")
    started = time.perf_counter()
    tokenizer = train_tokenizer(texts)
    tokenizer_path = out / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    eos = tokenizer.token_to_id(EOS)
    print(f"tokenizer: byte-level BPE, {tokenizer.get_vocab_size()} ids, trained in "
          f"{time.perf_counter() - started:.1f} s, EOS {EOS} = {eos} -> {tokenizer_path}")
    return tokenizer, tokenizer_path, eos


def _accounting(stats: dict[str, Any]) -> str:
    reasons: dict[str, int] = {}
    for lane in stats["lanes"].values():
        for reason, count in lane["tombstoned"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    because = f" {reasons}" if reasons else ""
    return (f"{stats['read']:,} documents read = {stats['delivered']:,} delivered + "
            f"{stats['tombstoned']:,} tombstoned{because}")


def _demo(args: argparse.Namespace) -> int:
    if args.docs < 1 or args.seq_len < 2 or args.batch_size < 1:
        raise SystemExit("--docs and --batch-size must be >= 1 and --seq-len >= 2")
    show = not args.no_progress
    run = {"runner": args.runner, "num_workers": args.num_workers}
    print("zephon-torch demo: the canonical pipeline on a generated corpus, checkpointed "
          "mid-way and resumed exactly")
    with _workdir(args.out) as out:
        tokenizer, tokenizer_path, eos = _demo_inputs(out, args)

        def build() -> Pipeline:
            # Built from the files each time: a restarted job has its config, not our objects.
            source = Pipeline.from_jsonl(str(out / "corpus" / "*.jsonl"), num_lanes=_NUM_LANES,
                                         chunk_size=64, seed=args.seed)
            return _canonical(source, str(tokenizer_path), seq_len=args.seq_len,
                              batch_size=args.batch_size, pad_id=eos, seed=args.seed)

        pipe = build()
        print(f"pipeline:  {pipe}: rows of {args.seq_len + 1} tokens ({args.seq_len} inputs "
              f"+ labels), batches of {args.batch_size}, {_NUM_LANES} lanes, "
              f"runner={args.runner} x{args.num_workers}")
        import torch  # noqa: F401  (to_training needs it: imported before the clock starts)

        print("\n[1/3] uninterrupted run")
        progress = _Progress("uninterrupted", enabled=show)
        with pipe.iter(**run) as it:
            reference, first = _consume(it, progress)
            stats = it.stats()
        elapsed, per_sample, per_token = progress.close()
        print(f"  {progress.batches} batches, {progress.samples:,} samples (packed rows), "
              f"{progress.tokens:,} tokens in {elapsed:.2f} s: {per_sample:,.0f} samples/s, "
              f"{per_token:,.0f} tokens/s")
        print(f"  accounting: {_accounting(stats)}")
        if first is None or len(reference) < 2:
            print("error: fewer than 2 batches; use more --docs or a smaller --seq-len")
            return 1
        print("\nsample batch (the first one):")
        _show_batch(first, tokenizer)

        cut = len(reference) // 2
        checkpoint = out / "checkpoint.json"
        print(f"\n[2/3] interrupted run: stop after {cut} of {len(reference)} batches, save "
              f"state_dict()")
        progress = _Progress("to checkpoint", total=cut, enabled=show)
        with pipe.iter(**run) as it:
            before, _ = _consume(it, progress, limit=cut)
            checkpoint.write_text(json.dumps(it.state_dict()))
        progress.close()
        print(f"  {len(before)} batches; state -> {checkpoint} "
              f"({checkpoint.stat().st_size / 1024:.1f} KiB of JSON)")

        print(f"\n[3/3] resumed run: a fresh pipeline and iterator, load_state_dict() from "
              f"{checkpoint.name}")
        progress = _Progress("resumed", total=len(reference) - cut, enabled=show)
        with build().iter(**run) as it:
            it.load_state_dict(json.loads(checkpoint.read_text()))
            after, _ = _consume(it, progress)
        elapsed, _, _ = progress.close()
        print(f"  {len(after)} batches in {elapsed:.2f} s")

    if before == reference[:cut] and after == reference[cut:]:
        print(f"\nresume: identical ({len(after)} batches compared)")
        return 0
    expected = reference[cut:]
    mismatch = next((i for i, (a, b) in enumerate(zip(after, expected)) if a != b),
                    min(len(after), len(expected)))
    print(f"\nresume: DIFFERENT: {len(after)} batches after the checkpoint, {len(expected)} "
          f"expected; first difference at batch {cut + mismatch}")
    return 1
