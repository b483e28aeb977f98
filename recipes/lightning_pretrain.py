"""Pretraining with Lightning: a ZephonDataModule whose checkpoints carry the data position.

What it shows:

1. ``zephon_torch.lightning.ZephonDataModule`` over a packed training
   pipeline (repeating the corpus, so any ``--steps`` works) and a held-out
   validation pipeline, both read by ``zephon_torch``'s ``DataLoader``.
2. A tiny GPT-style ``LightningModule`` (``_common.TinyGPT``: position
   embeddings from the packed ``positions``, attention kept inside each
   document by ``cu_seqlens``).
3. A ``ModelCheckpoint`` every ``--checkpoint-at`` steps: Lightning writes
   the data module's ``state_dict()`` into the checkpoint beside the model
   and the optimizer. That state is the position after the last batch the
   training step received, not after the batch Lightning has already
   prefetched.
4. ``Trainer.fit(..., ckpt_path=...)`` in a new Trainer, model and data
   module: its batches are exactly the uninterrupted run's batches from the
   checkpoint on, and the loss continues.

With ``--bare-loader`` the same fits get ``zephon_torch.DataLoader`` objects
(``Trainer.fit(train_dataloaders=..., val_dataloaders=...)``) instead of the
data module: Lightning then saves the train loader's own ``state_dict()``
(under ``loops`` -> ``fit_loop`` in the checkpoint), gathered from every
rank under DDP.

Run: ``.venv/bin/python recipes/lightning_pretrain.py [--steps 24 --checkpoint-at 12]``;
on a real corpus: ``--data 'corpus/*.jsonl' --tokenizer tokenizer.json``. Data
parallel: ``torchrun --nproc_per_node=2 recipes/lightning_pretrain.py --devices 2
--out DIR`` (Lightning's DDP strategy in the processes torchrun started).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
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
from lightning.pytorch.callbacks import ModelCheckpoint

import zephon_torch as zt
from zephon_torch.lightning import ZephonDataModule

_TO_TRAINING = {"return_labels": True, "return_cu_seqlens": True}


class PackedLM(pl.LightningModule):
    """The tiny GPT as a LightningModule; remembers the sample ids of every training batch."""

    def __init__(self, vocab_size: int, seq_len: int, lr: float) -> None:
        super().__init__()
        self.model = TinyGPT(vocab_size, max_positions=seq_len + 1)
        self.lr = lr
        self.seen: list[dict[str, Any]] = []

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        logits = self.model(batch["input_ids"], batch["positions"], batch["cu_seqlens"])
        return lm_loss(logits, batch["labels"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.seen.append({"step": self.global_step, "ids": [list(i) for i in batch["ids"]],
                          "loss": loss.item()})
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["ids"]))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True, batch_size=len(batch["ids"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def build_pipelines(files: list[str], tokenizer_path: str, eos: int,
                    args: argparse.Namespace) -> tuple[zt.Pipeline, zt.Pipeline]:
    """Training (all files but the last, repeating) and validation (the last file, once)."""
    def packed(paths: list[str], passes: int | None, num_lanes: int) -> zt.Pipeline:
        return (
            zt.Pipeline.from_jsonl(paths, num_lanes=num_lanes, chunk_size=32, seed=args.seed,
                                   passes=passes)
            .fetch()
            .decode_text()
            .tokenize(tokenizer_path, special_tokens="eos")
            .pack_flat(args.seq_len + 1, pad_token_id=eos)
        )

    train = (packed(files[:-1] or files, None, 4)
             .shuffle(128, seed=args.seed + 1)
             .batch(args.batch_size, drop_last=True))
    val = packed(files[-1:], 1, max(2, args.devices)).batch(args.batch_size, drop_last=False)
    return train, val


def fit(data: ZephonDataModule | tuple[zt.DataLoader, zt.DataLoader], vocab: int,
        args: argparse.Namespace, root: Path, *, ckpt_path: str | None) -> PackedLM:
    """One Trainer.fit to ``--steps``: from scratch (saving checkpoints) or from ``ckpt_path``.

    ``data``: a data module, or (``--bare-loader``) the train and validation loaders.
    """
    torch.manual_seed(args.seed)
    model = PackedLM(vocab, args.seq_len, args.lr)
    # The same callback in both runs, as Lightning asks when resuming with ckpt_path.
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", filename="{step}",
                                  every_n_train_steps=args.checkpoint_at, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="gpu" if args.device.startswith("cuda") else "cpu",
        devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps, val_check_interval=args.val_every,
        check_val_every_n_epoch=None, limit_val_batches=args.val_batches,
        num_sanity_val_steps=0, callbacks=[checkpoints], logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )
    if isinstance(data, ZephonDataModule):
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return model
    train, val = data
    try:
        trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    finally:
        train.close()
        val.close()
    return model


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _prepare(out: Path, args: argparse.Namespace) -> tuple[list[str], str, int, int]:
    """Corpus files, tokenizer path, EOS id and vocabulary size (reused if ``out`` has them).

    Under DDP every rank must use the same tokenizer file (the pipeline's
    fingerprint covers it): rank 0 writes it, the others read it.
    """
    if args.data:
        files = expand_paths(args.data)
    else:
        files = sorted(str(p) for p in (out / "corpus").glob("part-*.jsonl"))
        if not files:
            texts = web_corpus(args.docs, seed=args.seed)
            files = [str(write_jsonl(out / "corpus" / f"part-{i}.jsonl",
                                     ({"text": t} for t in texts[i::5]))) for i in range(5)]
    saved = out / "tokenizer.json"
    tokenizer_arg = args.tokenizer or (str(saved) if saved.exists() else None)
    texts = [] if tokenizer_arg else [t for t in read_field(files, "text", 5000)
                                      if isinstance(t, str)]
    tokenizer_path, tokenizer = prepare_tokenizer(tokenizer_arg, texts, out)
    return files, tokenizer_path, eos_id_of(tokenizer), tokenizer.get_vocab_size()


def run(args: argparse.Namespace, out: Path) -> int:
    """Prepare the data, fit uninterrupted, fit again from the mid-way checkpoint, compare."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Started by torchrun: join its group now (Lightning uses an initialized group as
        # it is), so that rank 0 alone writes the corpus and trains the tokenizer.
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(seconds=120))
    if _rank() == 0:
        _prepare(out, args)
    if dist.is_initialized():
        dist.barrier()
    files, tokenizer_path, eos, vocab = _prepare(out, args)
    if _rank() == 0:
        print(f"data: {len(files)} JSONL file(s) (the last for validation); tokenizer: "
              f"{vocab} tokens, EOS id {eos}; rows of {args.seq_len + 1} tokens, batches of "
              f"{args.batch_size}, {args.devices} device(s)", flush=True)

    def data() -> ZephonDataModule | tuple[zt.DataLoader, zt.DataLoader]:
        train, val = build_pipelines(files, tokenizer_path, eos, args)
        kwargs: dict[str, Any] = {"to_training": _TO_TRAINING, "num_workers": args.num_workers,
                                  "in_process": args.in_process}
        if args.num_workers:
            kwargs["runner"] = args.runner
        if args.bare_loader:
            # Lightning saves and restores the train loader itself (its fit loop's
            # "combined_loader" state), gathered from every rank under DDP.
            return zt.DataLoader(train, **kwargs), zt.DataLoader(val, **kwargs)
        return ZephonDataModule(train=train, val=val, loader_kwargs=kwargs)

    started = time.perf_counter()
    full = fit(data(), vocab, args, out, ckpt_path=None)
    ckpt = out / "checkpoints" / f"step={args.checkpoint_at}.ckpt"
    resumed = fit(data(), vocab, args, out, ckpt_path=str(ckpt))
    elapsed = time.perf_counter() - started

    tail = full.seen[args.checkpoint_at:]
    same_data = [e["ids"] for e in tail] == [e["ids"] for e in resumed.seen]
    diff = max((abs(a["loss"] - b["loss"]) for a, b in zip(tail, resumed.seen)), default=0.0)
    verdict = torch.tensor([int(same_data and diff < 1e-3)])
    if dist.is_initialized():  # every rank's data must match
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    if _rank() == 0:
        first = resumed.seen[0]["step"] if resumed.seen else "-"
        print(f"uninterrupted: {len(full.seen)} steps; checkpoint {ckpt.name}; resumed: "
              f"{len(resumed.seen)} steps from step {first}")
        print(f"resume: data {'identical' if same_data else 'DIFFERENT'} ({len(tail)} batches "
              f"compared by sample ids{', on every rank' if dist.is_initialized() else ''})")
        print(f"resume: loss continues: max |diff| over {len(tail)} steps {diff:.2e}")
        print(f"loss: {full.seen[0]['loss']:.4f} at step 0 -> {full.seen[-1]['loss']:.4f} at "
              f"step {full.seen[-1]['step']} ({elapsed:.1f} s for both fits)")
    return 0 if bool(verdict.item()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0], steps=24, seq_len=64, batch_size=4)
    parser.set_defaults(num_workers=0)
    parser.add_argument("--checkpoint-at", type=int, help="ModelCheckpoint every this many "
                        "steps; the resume starts from the first (default: half of --steps)")
    parser.add_argument("--devices", type=int, default=1,
                        help="processes for Lightning's DDP (launch with torchrun, same count)")
    parser.add_argument("--val-every", type=int, default=10, help="validate every N steps")
    parser.add_argument("--val-batches", type=int, default=4, help="batches per validation")
    parser.add_argument("--docs", type=int, default=1500, help="generated corpus size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--in-process", action="store_true",
                        help="run the pipelines in the training process (debugging)")
    parser.add_argument("--bare-loader", action="store_true",
                        help="pass zephon DataLoaders to Trainer.fit instead of a "
                             "ZephonDataModule (Lightning checkpoints the train loader)")
    args = parser.parse_args(argv)
    if args.checkpoint_at is None:
        args.checkpoint_at = args.steps // 2
    if not 0 < args.checkpoint_at < args.steps:
        parser.error(f"--checkpoint-at must be in 1..{args.steps - 1}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.devices != world and args.devices > 1:
        parser.error(f"--devices {args.devices}: launch with torchrun --nproc_per_node="
                     f"{args.devices} (this process is one of {world})")
    if world > 1 and args.out is None:
        parser.error("under torchrun, pass --out DIR (a folder every rank can read)")
    with workdir(args.out) as out:
        try:
            return run(args, out)
        finally:
            # Leave the process group before exit: torn down at interpreter exit, gloo
            # threads can abort the process after a successful run.
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
