"""Supervised fine-tuning on chat samples: the loss falls on assistant tokens only.

What it shows:

1. ``tokenize_chat`` renders each conversation (a list of ``{"role",
   "content"}`` messages) with the default template ``<|{role}|>\\n{content}\\n``
   and writes a ``loss_mask`` next to ``input_ids``: 1 on assistant content and
   on the EOS closing each assistant turn, 0 on system and user turns and on
   the role headers.
2. ``pack_flat`` packs several conversations into one row and carries the
   mask along (0 on the trailing padding).
3. ``to_training(return_labels=True, return_loss_mask=True)`` shifts tokens
   into labels and sets every unsupervised label to -100; the label-aligned
   ``loss_mask`` it returns weighs the per-token loss.
4. A check, independent of ``to_training``, that every label whose token the
   payload mask leaves unsupervised is -100 and every supervised label is the
   next token; then a few training steps of a tiny GPT on those labels.

Run: ``.venv/bin/python recipes/sft_loss_mask.py [--steps 30]``; on real data:
``--data 'chats/*.jsonl'`` (one ``{"messages": [...]}`` per line) ``--tokenizer
tokenizer.json``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from _common import (
    TinyGPT,
    base_parser,
    conversations,
    eos_id_of,
    expand_paths,
    lm_loss,
    prepare_tokenizer,
    read_field,
    workdir,
    write_jsonl,
)
from tokenizers import Tokenizer

import zephon_torch as zt
from zephon_torch.ops.chat_templates import DEFAULT_CHAT_TEMPLATE


def parse_json_line(raw: bytes) -> dict:
    """One JSONL line (the bytes ``fetch`` read) as a dict payload."""
    return json.loads(raw)


def build_pipeline(files: list[str], tokenizer_path: str, eos: int,
                   args: argparse.Namespace) -> zt.Pipeline:
    """Chat JSONL -> tokenize_chat -> pack_flat -> shuffle -> batch."""
    return (
        zt.Pipeline.from_jsonl(files, num_lanes=2, chunk_size=64, seed=args.seed, passes=None)
        .fetch()
        # decode_text wants a string field; a chat row's "messages" is a list,
        # so the raw line is parsed by a plain function instead.
        .map_transform(parse_json_line)
        .tokenize_chat(tokenizer_path, special_tokens="eos")
        .pack_flat(args.seq_len + 1, pad_token_id=eos)
        .shuffle(128, seed=args.seed + 1)
        .batch(args.batch_size, drop_last=True)
    )


def check_labels(batch: zt.SampleBatch, labels: np.ndarray) -> tuple[int, int, int]:
    """Compare ``to_training``'s labels with the packed payloads' own masks.

    Label ``j`` of a row is token ``j + 1``, supervised where the payload's
    ``loss_mask[j + 1]`` is 1. Returns (label slots, supervised, non-pad
    slots); exits with an error on the first mismatch.
    """
    slots = supervised = real = 0
    for row, record in enumerate(batch):
        tokens = np.asarray(record.payload["input_ids"])
        wanted = np.asarray(record.payload["loss_mask"])[1:] == 1
        got = labels[row]
        if not (got[~wanted] == -100).all():
            raise SystemExit(f"row {row}: an unsupervised position has a label other than -100")
        if not (got[wanted] == tokens[1:][wanted]).all():
            raise SystemExit(f"row {row}: a supervised label is not the next token")
        slots += len(got)
        supervised += int(wanted.sum())
        real += len(got) - (record.meta.padding_length or 0)
    return slots, supervised, real


def show_supervision(tokenizer: Tokenizer, tokens: np.ndarray, labels: np.ndarray,
                     positions: np.ndarray, width: int = 480) -> str:
    """A row's text with supervised spans in [[...]] and documents separated by " | ".

    Label ``j`` is token ``j + 1``; runs of equally supervised tokens are
    decoded together (a BPE token may hold part of a character).
    """
    spans: list[tuple[int, int, bool]] = [(0, 1, False)]  # token 0 is never a label
    for j, supervised in enumerate((labels != -100).tolist(), start=1):
        starts_doc = positions[j] == 0 if j < len(positions) else False
        last = spans[-1]
        if last[2] == supervised and not starts_doc:
            spans[-1] = (last[0], j + 1, supervised)
        else:
            spans.append((j, j + 1, supervised))
    pieces = []
    for start, stop, supervised in spans:
        if start and start < len(positions) and positions[start] == 0:
            pieces.append(" | ")
        text = tokenizer.decode(tokens[start:stop].tolist(), skip_special_tokens=False)
        pieces.append(f"[[{text}]]" if supervised else text)
    return "".join(pieces)[:width].replace("\n", "\u23ce")


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0], steps=30)
    parser.add_argument("--docs", type=int, default=2000, help="generated conversations")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args(argv)

    print(__doc__.split("\n\n")[0])
    with workdir(args.out) as out:
        if args.data:
            files = expand_paths(args.data)
            chats = [c for c in read_field(files, "messages", 2000) if isinstance(c, list)]
        else:
            chats = conversations(args.docs, seed=args.seed)
            files = [str(write_jsonl(out / "chats.jsonl", ({"messages": c} for c in chats)))]
        rendered = ["".join(DEFAULT_CHAT_TEMPLATE.format(role=m["role"], content=m["content"])
                            for m in chat) for chat in chats]
        tokenizer_path, tokenizer = prepare_tokenizer(args.tokenizer, rendered, out)
        eos = eos_id_of(tokenizer)
        pipe = build_pipeline(files, tokenizer_path, eos, args)
        print(f"pipeline: {pipe}; rows of {args.seq_len + 1} tokens, "
              f"batches of {args.batch_size}")

        torch.manual_seed(args.seed)
        device = torch.device(args.device)
        model = TinyGPT(tokenizer.get_vocab_size(), max_positions=args.seq_len + 1).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        totals = np.zeros(3, dtype=np.int64)
        losses = []
        started = time.perf_counter()
        with pipe.iter(runner=args.runner or "threads", num_workers=args.num_workers) as it:
            for step in range(args.steps):
                batch = next(it)
                data = batch.to_training(return_labels=True, return_loss_mask=True,
                                         return_cu_seqlens=True)
                labels = data["labels"].numpy()
                totals += check_labels(batch, labels)
                if step == 0:
                    print("\nrow 0 of the first batch: supervised labels in [[...]], "
                          "conversations separated by |, \u23ce a newline:")
                    row = batch[0].payload
                    print("  " + show_supervision(tokenizer, row["input_ids"], labels[0],
                                                  row["positions"]))
                    print()
                data = {k: v.to(device) for k, v in data.items() if isinstance(v, torch.Tensor)}
                logits = model(data["input_ids"], data["positions"], data["cu_seqlens"])
                loss = lm_loss(logits, data["labels"], weights=data["loss_mask"])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                if step % args.log_every == 0 or step == args.steps - 1:
                    print(f"  step {step:3d}  loss {loss.item():.4f} over "
                          f"{int(data['loss_mask'].sum())} supervised tokens")
    slots, supervised, real = totals.tolist()
    print(f"\nsupervised tokens: {supervised} of {real} non-pad label positions "
          f"({supervised / real:.1%}); {supervised / slots:.1%} of all {slots}")
    print(f"check: all {slots - supervised} unsupervised positions have label -100, all "
          f"{supervised} supervised labels are the next token")
    print(f"loss: {losses[0]:.4f} at step 0 -> {losses[-1]:.4f} at step {len(losses) - 1} "
          f"({time.perf_counter() - started:.1f} s)")
    return 0 if np.isfinite(losses).all() else 1


if __name__ == "__main__":
    raise SystemExit(main())
