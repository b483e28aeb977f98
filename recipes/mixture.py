"""Two sources mixed 70/30 by tokens: achieved against target ratios, per lane and overall.

What it shows:

1. ``Pipeline.from_sources`` over two JSONL datasets, "web" (component 0,
   short prose) and "code" (component 1, longer documents), with
   ``weights={0: 0.7, 1: 0.3}``, then ``tokenize`` -> ``ensure_mixture(
   weight_by="tokens")`` -> ``pack_flat`` -> ``batch``.
2. How to read the result. Source weights deal *documents*: the stream holds
   70% web documents, but a code document is about twice as long, so by
   tokens web gets only about half. ``ensure_mixture`` reorders each lane
   toward the token target (smooth weighted round-robin over per-component
   queues, holding back what is ahead), so the first steps do see 70/30 by
   tokens. But it never drops a document: at the end of each flush epoch (8
   chunks per lane) the held-back code comes out in a burst, steps with no
   web at all, and over whole epochs the token shares are what the sources
   deliver. The per-window range printed below makes the bursts visible.
3. The fix for a token target: weigh the sources by target share divided by
   the mean document length (measured on a sample), and give
   ``ensure_mixture`` the token target (``mixture=``). Then the token shares
   hold over the first steps and over the whole run.

Ratios are read from the packed rows' metadata (``component_token_counts``
and ``component_sample_counts``, which ``pack_flat`` fills per component), so
a row holding both sources counts for each by its part.

Run: ``.venv/bin/python recipes/mixture.py [--steps 40]``; on real data:
``--data 'web/*.jsonl' --data 'code/*.jsonl' --weights 0.7 0.3 --tokenizer tokenizer.json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from _common import (
    base_parser,
    code_corpus,
    eos_id_of,
    expand_paths,
    prepare_tokenizer,
    read_field,
    web_corpus,
    workdir,
    write_jsonl,
)
from tokenizers import Tokenizer

import zephon_torch as zt

NUM_LANES = 4


class Tally:
    """Tokens and documents delivered per component: per lane, and per window of steps."""

    def __init__(self, components: int, window: int) -> None:
        self.components = components
        self.window = window
        self.tokens: dict[int, np.ndarray] = {}
        self.samples: dict[int, np.ndarray] = {}
        self.windows: list[np.ndarray] = []
        self._steps = 0

    def add(self, batch: zt.SampleBatch) -> None:
        """Count every row of ``batch`` (one lane's rows)."""
        if self._steps % self.window == 0:
            self.windows.append(np.zeros(self.components))
        self._steps += 1
        for record in batch:
            meta = record.meta
            lane = meta.lane_id
            tokens = self.tokens.setdefault(lane, np.zeros(self.components))
            samples = self.samples.setdefault(lane, np.zeros(self.components))
            for component, count in (meta.component_token_counts or {}).items():
                tokens[component] += count
                self.windows[-1][component] += count
            for component, count in meta.component_sample_counts.items():
                samples[component] += count

    def shares(self, lane: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(token shares, sample shares) of one lane, or of all lanes."""
        lanes = sorted(self.tokens) if lane is None else [lane]
        tokens = sum(self.tokens[k] for k in lanes)
        samples = sum(self.samples[k] for k in lanes)
        return tokens / max(tokens.sum(), 1), samples / max(samples.sum(), 1)

    def window_range(self, component: int) -> tuple[float, float]:
        """Lowest and highest token share of ``component`` over full windows."""
        full = self.windows[:-1] if self._steps % self.window else self.windows
        shares = [w[component] / w.sum() for w in full if w.sum()]
        return (min(shares), max(shares)) if shares else (float("nan"), float("nan"))


def build_pipeline(paths: Sequence[Sequence[str]], names: Sequence[str],
                   weights: Mapping[int, float], tokenizer_path: str, eos: int,
                   args: argparse.Namespace, mixture: Mapping[int, float] | None = None
                   ) -> zt.Pipeline:
    """Sources with their weights -> tokenize -> ensure_mixture(tokens) -> pack -> batch."""
    sources = [zt.sources.jsonl(list(p), component_id=c, name=name)
               for c, (p, name) in enumerate(zip(paths, names))]
    return (
        zt.Pipeline.from_sources(sources, weights=dict(weights), num_lanes=NUM_LANES,
                                 chunk_size=64, seed=args.seed)
        .fetch()
        .decode_text()
        .tokenize(tokenizer_path, special_tokens="eos")
        .ensure_mixture(weight_by="tokens", mixture=mixture)
        .pack_flat(args.seq_len + 1, pad_token_id=eos)
        .batch(args.batch_size, drop_last=True)
    )


def run(pipe: zt.Pipeline, steps: int, args: argparse.Namespace,
        components: int) -> tuple[Tally, Tally, int]:
    """Tallies of the first ``steps`` batches and of the whole pass, and its length."""
    prefix, whole = Tally(components, args.window), Tally(components, args.window)
    count = 0
    with pipe.iter(runner=args.runner or "threads", num_workers=args.num_workers) as it:
        for count, batch in enumerate(it, start=1):
            whole.add(batch)
            if count <= steps:
                prefix.add(batch)
    return prefix, whole, count


def report(title: str, names: Sequence[str], target: np.ndarray, prefix: Tally,
           whole: Tally, steps: int, total: int) -> dict[str, Any]:
    """Print a table of achieved shares; return the overall token and sample shares."""
    def cells(shares: np.ndarray) -> str:
        return " ".join(f"{s:6.3f}" for s in shares)

    span = 7 * len(names) - 1
    head = " ".join(f"{n[:6]:>6}" for n in names)
    print(title)
    print(f"  {'':24} {'by tokens':^{span}}   {'by samples':^{span}}")
    print(f"  {'':24} {head}   {head}")
    print(f"  {'target':24} {cells(target)}")
    for label, tally in ((f"first {min(steps, total)} steps", prefix),
                         (f"whole pass, {total} steps", whole)):
        print(f"  {label}:")
        for lane in sorted(tally.tokens):
            tokens, samples = tally.shares(lane)
            print(f"  {f'  lane {lane}':24} {cells(tokens)}   {cells(samples)}")
        tokens, samples = tally.shares()
        print(f"  {'  overall':24} {cells(tokens)}   {cells(samples)}")
    low, high = whole.window_range(0)
    print(f"  {names[0]} token share per window of {whole.window} steps: {low:.3f} to "
          f"{high:.3f} (target {target[0]:.3f})")
    return {"prefix": prefix.shares(), "whole": whole.shares(), "window": (low, high)}


def mean_tokens(tokenizer: Tokenizer, texts: Sequence[str]) -> float:
    """Average tokens per document, EOS included (what ``tokenize`` will produce)."""
    encoded = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return float(np.mean([len(e.ids) + 1 for e in encoded]))


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0], steps=40, data_help="one JSONL glob per "
                         "source (repeat the option; default: generated web and code)",
                         data_action="append")
    parser.add_argument("--names", nargs="+", help="source names (default: web code)")
    parser.add_argument("--weights", nargs="+", type=float, default=[0.7, 0.3],
                        help="target token share of each source")
    parser.add_argument("--window", type=int, default=10,
                        help="steps per window of the token-share range")
    parser.add_argument("--docs", type=int, default=2400, help="generated web documents "
                        "(a third as many code documents)")
    args = parser.parse_args(argv)

    print(__doc__.split("\n\n")[0])
    with workdir(args.out) as out:
        if args.data:
            paths = [expand_paths(pattern) for pattern in args.data]
            texts = [[t for t in read_field(p, "text", 2000) if isinstance(t, str)]
                     for p in paths]
        else:
            texts = [web_corpus(args.docs, seed=args.seed),
                     code_corpus(args.docs // 3, seed=args.seed + 1)]
            paths = [[str(write_jsonl(out / f"{name}.jsonl", ({"text": t} for t in docs)))]
                     for name, docs in zip(("web", "code"), texts)]
        names = args.names or (["web", "code"] if not args.data else
                               [f"source{c}" for c in range(len(paths))])
        if not len(paths) == len(names) == len(args.weights) >= 2:
            parser.error(f"need as many --data ({len(paths)}), --names ({len(names)}) and "
                         f"--weights ({len(args.weights)}), at least two")
        # Up to 1000 documents of each source, so the larger does not own the merges.
        sample = [t for docs in texts for t in docs[:1000]]
        tokenizer_path, tokenizer = prepare_tokenizer(args.tokenizer, sample, out)
        eos = eos_id_of(tokenizer)
        components = len(paths)
        target = np.array(args.weights) / sum(args.weights)
        lengths = np.array([mean_tokens(tokenizer, docs[:1000]) for docs in texts])
        print("sources: " + ", ".join(
            f"{n} (component {c}, {len(paths[c])} file(s), "
            f"{lengths[c]:.1f} tokens per document)" for c, n in enumerate(names)))

        weights = dict(enumerate(target.tolist()))
        pipe = build_pipeline(paths, names, weights, tokenizer_path, eos, args)
        print(f"\npipeline: {pipe}, weights={weights}, weight_by='tokens', "
              f"{NUM_LANES} lanes")
        prefix, whole, total = run(pipe, args.steps, args, components)
        naive = report("\n1) source weights = the token targets (they count documents)",
                       names, target, prefix, whole, args.steps, total)

        # Documents per token target: share / mean length, normalised.
        per_doc = target / lengths
        calibrated = dict(enumerate((per_doc / per_doc.sum()).round(4).tolist()))
        pipe = build_pipeline(paths, names, calibrated, tokenizer_path, eos, args,
                              mixture=dict(enumerate(target.tolist())))
        prefix, whole, total = run(pipe, args.steps, args, components)
        fixed = report(f"\n2) source weights = target / mean document length = {calibrated}, "
                       f"ensure_mixture(weight_by='tokens', mixture={weights})", names,
                       target, prefix, whole, args.steps, total)

    def gap(shares: np.ndarray) -> float:
        return float(np.abs(shares - target).max())

    print(f"\nsummary, |achieved - target| by tokens: first steps {gap(naive['prefix'][0]):.3f}, "
          f"whole pass {gap(naive['whole'][0]):.3f} with document weights; "
          f"{gap(fixed['prefix'][0]):.3f} and {gap(fixed['whole'][0]):.3f} with calibrated "
          f"weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
