"""Pretraining on packed rows, with a checkpoint that carries the data position.

What it shows:

1. The canonical packed pipeline: JSONL -> fetch -> decode_text ->
   tokenize (EOS after each document) -> ``pack_flat`` (rows of
   ``seq_len + 1`` tokens, positions restarting per document) -> shuffle ->
   batch, repeating the corpus (``passes=None``) so any ``--steps`` works.
2. A tiny GPT (``_common.TinyGPT``) that uses ``to_training``'s ``positions``
   for its position embeddings and ``cu_seqlens`` for a document-aware causal
   mask, so no token attends across a document boundary.
3. One checkpoint file holding the model, the optimizer *and* the pipeline
   iterator's ``state_dict()`` (JSON-able builtins), saved mid-way.
4. A resume from that file into a new pipeline object, iterator, model and
   optimizer (what a restarted job does): its batches are exactly the
   uninterrupted run's batches from the checkpoint on, and its loss
   continues the same curve.

Run: ``.venv/bin/python recipes/pretrain_packed.py [--steps 40 --checkpoint-at 20]``;
on a real corpus: ``--data 'corpus/*.jsonl' --tokenizer tokenizer.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    TinyGPT,
    base_parser,
    eos_id_of,
    expand_paths,
    lm_loss,
    prepare_tokenizer,
    read_field,
    web_corpus,
    workdir,
    write_jsonl,
)

import zephon_torch as zt


def build_pipeline(files: list[str], tokenizer_path: str, eos: int,
                   args: argparse.Namespace) -> zt.Pipeline:
    """The packed pretraining pipeline (a pure description: built twice, equal)."""
    return (
        zt.Pipeline.from_jsonl(files, num_lanes=4, chunk_size=64, seed=args.seed, passes=None)
        .fetch()
        .decode_text()
        .tokenize(tokenizer_path, special_tokens="eos")
        .pack_flat(args.seq_len + 1, pad_token_id=eos)
        .shuffle(256, seed=args.seed + 1)
        .batch(args.batch_size, drop_last=True)
    )


def train(pipe: zt.Pipeline, vocab_size: int, args: argparse.Namespace, *,
          checkpoint: Path, resume: bool) -> list[dict[str, Any]]:
    """Train until ``args.steps``: from scratch (saving ``checkpoint`` mid-way) or resumed.

    Returns one entry per step taken: the batch's identity (sample ids and a
    digest of its tokens) and the loss.
    """
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = TinyGPT(vocab_size, max_positions=args.seq_len + 1).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    it = pipe.iter(runner=args.runner or "threads", num_workers=args.num_workers)
    start = 0
    if resume:
        # weights_only loading is enough: the data state is plain builtins.
        saved = torch.load(checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        it.load_state_dict(saved["data"])
        start = saved["step"]
    log = []
    with it:
        for step in range(start, args.steps):
            batch = next(it)
            data = batch.to_training(return_labels=True, return_cu_seqlens=True,
                                     return_num_valid_tokens=True, device=device)
            logits = model(data["input_ids"], data["positions"], data["cu_seqlens"])
            loss = lm_loss(logits, data["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            digest = hashlib.sha256(data["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
            log.append({"step": step, "ids": batch.ids, "tokens": digest, "loss": loss.item(),
                        "valid": data["num_valid_tokens"],
                        "segments": int((data["cu_seqlens"][:, 1:] > data["cu_seqlens"][:, :-1])
                                    .sum())})
            if step % args.log_every == 0 or step == args.steps - 1:
                print(f"  step {step:3d}  loss {loss.item():.4f}  {data['num_valid_tokens']} "
                      f"label tokens, {log[-1]['segments']} segments")
            if not resume and step + 1 == args.checkpoint_at:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "data": it.state_dict(), "step": step + 1}, checkpoint)
                print(f"  checkpoint after step {step}: model + optimizer + data position "
                      f"-> {checkpoint.name} ({checkpoint.stat().st_size / 1024:.0f} KiB)")
    return log


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0], steps=40)
    parser.add_argument("--checkpoint-at", type=int, help="step of the checkpoint "
                        "(default: half of --steps)")
    parser.add_argument("--docs", type=int, default=3000, help="generated corpus size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args(argv)
    if args.checkpoint_at is None:
        args.checkpoint_at = args.steps // 2
    if not 0 < args.checkpoint_at < args.steps:
        parser.error(f"--checkpoint-at must be in 1..{args.steps - 1}")

    print(__doc__.split("\n\n")[0])
    with workdir(args.out) as out:
        if args.data:
            files = expand_paths(args.data)
            texts = [t for t in read_field(files, "text", 5000) if isinstance(t, str)]
        else:
            texts = web_corpus(args.docs, seed=args.seed)
            files = [str(write_jsonl(out / "corpus" / f"part-{i}.jsonl",
                                     ({"text": t} for t in texts[i::4]))) for i in range(4)]
        tokenizer_path, tokenizer = prepare_tokenizer(args.tokenizer, texts, out)
        eos = eos_id_of(tokenizer)
        vocab = tokenizer.get_vocab_size()
        print(f"data: {len(files)} JSONL file(s); tokenizer: {vocab} tokens, EOS id {eos}; "
              f"rows of {args.seq_len + 1} tokens, batches of {args.batch_size}")
        checkpoint = out / "checkpoint.pt"

        started = time.perf_counter()
        print(f"\nuninterrupted run: {args.steps} steps, checkpoint after step "
              f"{args.checkpoint_at - 1}")
        full = train(build_pipeline(files, tokenizer_path, eos, args), vocab, args,
                     checkpoint=checkpoint, resume=False)
        print(f"\nresumed run: a new pipeline, iterator, model and optimizer from "
              f"{checkpoint.name}")
        resumed = train(build_pipeline(files, tokenizer_path, eos, args), vocab, args,
                        checkpoint=checkpoint, resume=True)
        elapsed = time.perf_counter() - started

    tail = full[args.checkpoint_at:]
    same_data = [(e["ids"], e["tokens"]) for e in tail] == [
        (e["ids"], e["tokens"]) for e in resumed]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(tail, resumed))
    print(f"\nresume: data {'identical' if same_data else 'DIFFERENT'} "
          f"({len(resumed)} batches compared by sample ids and tokens)")
    first = resumed[0]
    print(f"resume: loss continues: step {first['step']} loss {first['loss']:.4f} resumed vs "
          f"{tail[0]['loss']:.4f} uninterrupted; max |diff| over {len(resumed)} steps "
          f"{diff:.2e}")
    print(f"loss: {full[0]['loss']:.4f} at step 0 -> {full[-1]['loss']:.4f} at step "
          f"{full[-1]['step']} ({elapsed:.1f} s in all)")
    return 0 if same_data and diff < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
