"""The demo behind the README's first command: ``python -m zephon_torch.demo``.

It runs the canonical pipeline on a small built-in corpus: generated
documents of heavy-tailed lengths, a byte-level BPE tokenizer trained on the
spot (nothing is downloaded), then tokenize with EOS -> pack into flat rows
with per-document positions -> shuffle -> batch -> ``to_training``. It
prints the first batch's tensors, the accounting, and shows that the
runner and worker count do not change a byte.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from zephon_torch.pipeline import Pipeline

EOS = "<|endoftext|>"
_WORDS = (
    "data flows in lanes every stateful decision lives in a per lane accumulator flush "
    "sentinels make replay exact the same bytes whatever the number of workers resume "
    "exactly after a crash tokens pack into rows shuffle batch train model river stone"
).split()


def default_corpus(count: int = 400, seed: int = 0) -> list[str]:
    """Generated documents whose lengths are heavy-tailed (a few long ones)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        length = max(1, int(rng.lognormvariate(3.0, 1.0)))
        docs.append(" ".join(rng.choice(_WORDS) for _ in range(length)))
    return docs


def train_tokenizer(texts: list[str], vocab_size: int = 512) -> Any:
    """A small byte-level BPE trained on ``texts`` (EOS is id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def demo_pipeline(row_length: int = 129, *, docs: int = 400) -> Pipeline:
    """The demo pipeline: tokenize -> pack_flat -> shuffle -> batch."""
    texts = default_corpus(docs)
    tokenizer = train_tokenizer(texts)
    return (
        Pipeline.from_items(texts, num_lanes=4, chunk_size=32, seed=0)
        .tokenize(tokenizer, special_tokens="eos")
        .pack_flat(row_length, num_bins=4)
        .shuffle(32, seed=1)
        .batch(4, drop_last=True)
    )


def main(argv: list[str] | None = None) -> None:
    """Run the demo and print what a training loop would receive."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row-length", type=int, default=129,
                        help="tokens per packed row (model length + 1)")
    parser.add_argument("--runner", default="threads", choices=["inline", "threads", "process"])
    parser.add_argument("--num-workers", type=int, default=2)
    args = parser.parse_args(argv)

    pipe = demo_pipeline(args.row_length)
    print(f"pipeline: {pipe}")
    it = pipe.iter(runner=args.runner, num_workers=args.num_workers)
    batches = list(it)
    first = batches[0]
    print(f"{len(batches)} batches of {len(first)} rows; first batch from lane "
          f"{first.lane_ids[0]}, documents per row "
          f"{[len(r.meta.contributors) for r in first]}")
    out = first.to_training(return_labels=True, return_cu_seqlens=True,
                            return_num_valid_tokens=True)
    for key, value in out.items():
        if hasattr(value, "shape"):
            row = value[0].tolist() if value.dim() else value.item()
            preview = f"{row[:12]} ..." if isinstance(row, list) and len(row) > 12 else row
            print(f"{key:>16}: {tuple(value.shape)} {value.dtype}, row 0: {preview}")
        elif key != "texts":
            print(f"{key:>16}: {value!r}"[:110])
    stats = it.stats()
    print(f"accounting: {stats['read']} documents read = {stats['delivered']} delivered "
          f"+ {stats['tombstoned']} tombstoned (dropped by batch(drop_last=True) or empty)")
    inline = list(pipe.iter(runner="inline"))
    same = len(inline) == len(batches) and all(a == b for a, b in zip(inline, batches))
    print(f"runner={args.runner} x{args.num_workers} vs inline: "
          f"{'identical' if same else 'DIFFERENT'} output")


if __name__ == "__main__":
    main()
