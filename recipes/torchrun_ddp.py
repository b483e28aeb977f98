"""Data-parallel pretraining under torchrun, with checkpoints that restart on any world size.

Launch: ``torchrun --nproc_per_node=2 recipes/torchrun_ddp.py`` (gloo on CPU,
nccl on GPUs); a restart may use another ``--nproc_per_node``.

What it shows:

1. Each rank reads its own lanes of one packed pipeline through
   ``zephon_torch``'s ``DataLoader``: rank ``r`` of ``W`` owns the lanes
   ``l % W == r``, so no sample reaches two ranks. Rank and world size come
   from ``torch.distributed``; nothing is passed by hand.
2. ``on_uneven="stop"``: the ranks agree at every step that each has a
   batch, so when one runs out they all stop at the same step and no
   gradient all-reduce waits for a rank that has left.
3. A ``DistributedDataParallel`` tiny GPT (``_common.TinyGPT``: position
   embeddings from the packed ``positions``, attention kept inside each
   document by ``cu_seqlens``).
4. A checkpoint holding the model, the optimizer and the loader's state
   *gathered* from every rank (``loader.state_dict(gather=True)``, a
   collective; rank 0 writes the file). The gathered state holds every
   lane, so ``--resume`` works with any number of processes up to the
   pipeline's lanes: each rank takes its own lanes from it.

Run ``--steps 8 --checkpoint ckpt.pt``, then ``--steps 16 --resume ckpt.pt``
(with the same ``--out`` so both see the same corpus and tokenizer): the
second run continues every lane exactly where the first stopped.
``--ids-out FILE`` writes the sample ids each rank received at each step
(JSON), which the tests compare with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

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
    write_jsonl,
)
from torch.nn.parallel import DistributedDataParallel

import zephon_torch as zt
from zephon_torch.torch.loader import DataLoader

_TO_TRAINING = {"return_labels": True, "return_cu_seqlens": True,
                "return_num_valid_tokens": True}


def parser() -> argparse.ArgumentParser:
    """The recipe's options (also used by the tests to rebuild its pipeline)."""
    p = base_parser(__doc__.splitlines()[0], steps=8, seq_len=32, batch_size=4)
    p.set_defaults(num_workers=0, device="auto")
    p.add_argument("--lanes", type=int, default=4,
                   help="pipeline lanes: the largest world size a checkpoint can restart on")
    p.add_argument("--docs", type=int, default=600, help="generated corpus size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint", help="write model, optimizer and data state here at the end")
    p.add_argument("--resume", help="continue from this checkpoint (any world size)")
    p.add_argument("--ids-out", help="write the sample ids each rank received, per step (JSON)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a collective may wait before the job fails instead of hanging")
    return p


def prepare_data(out: Path, args: argparse.Namespace) -> tuple[list[str], str, int, int]:
    """Corpus files, tokenizer path, EOS id and vocabulary size (reused if ``out`` has them).

    Reusing them matters for a restart: the pipeline's fingerprint covers the
    tokenizer, so the resumed job must see the same one.
    """
    if args.data:
        files = expand_paths(args.data)
        texts: list[str] = []
        if args.tokenizer is None:
            texts = [t for t in read_field(files, "text", 5000) if isinstance(t, str)]
    else:
        corpus = out / "corpus"
        files = sorted(str(p) for p in corpus.glob("part-*.jsonl"))
        texts = []
        if not files:
            texts = web_corpus(args.docs, seed=args.seed)
            files = [str(write_jsonl(corpus / f"part-{i}.jsonl",
                                     ({"text": t} for t in texts[i::4]))) for i in range(4)]
    saved = out / "tokenizer.json"
    tokenizer_arg = args.tokenizer or (str(saved) if saved.exists() else None)
    if tokenizer_arg is None and not texts:
        texts = [t for t in read_field(files, "text", 5000) if isinstance(t, str)]
    tokenizer_path, tokenizer = prepare_tokenizer(tokenizer_arg, texts, out)
    return files, tokenizer_path, eos_id_of(tokenizer), tokenizer.get_vocab_size()


def build_pipeline(files: list[str], tokenizer_path: str, eos: int,
                   args: argparse.Namespace) -> zt.Pipeline:
    """Packed rows of ``seq_len + 1`` tokens, shuffled per lane, repeating the corpus."""
    return (
        zt.Pipeline.from_jsonl(files, num_lanes=args.lanes, chunk_size=32, seed=args.seed,
                               passes=None)
        .fetch()
        .decode_text()
        .tokenize(tokenizer_path, special_tokens="eos")
        .pack_flat(args.seq_len + 1, pad_token_id=eos)
        .shuffle(64, seed=args.seed + 1)
        .batch(args.batch_size, drop_last=True)
    )


def _init_distributed(args: argparse.Namespace) -> torch.device:
    """Join torchrun's group (gloo on CPU, nccl on GPUs); a plain ``python`` run is one rank."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    # "auto": one GPU per rank when there are GPUs, else the CPU.
    use_cuda = args.device.startswith("cuda") or (args.device == "auto"
                                                 and torch.cuda.is_available())
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    return device


def _shared_out(args: argparse.Namespace) -> Path:
    """``--out``, or a temporary folder that rank 0 creates and tells the others about.

    Without ``--out`` the ranks must share a file system (one machine).
    """
    if args.out is not None:
        path = Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    name = [tempfile.mkdtemp(prefix="zephon-ddp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return Path(str(name[0]))


def train(args: argparse.Namespace) -> int:
    """One launch: train until ``--steps`` (from scratch or ``--resume``), maybe checkpoint."""
    device = _init_distributed(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = _shared_out(args)
    if rank == 0:  # one rank writes the corpus and trains the tokenizer; the others wait
        prepare_data(out, args)
    dist.barrier()
    files, tokenizer_path, eos, vocab = prepare_data(out, args)
    pipe = build_pipeline(files, tokenizer_path, eos, args)

    torch.manual_seed(args.seed)
    model = TinyGPT(vocab, max_positions=args.seq_len + 1).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                  else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    loader = DataLoader(pipe, num_workers=args.num_workers, to_training=_TO_TRAINING,
                        runner=args.runner if args.num_workers else None, on_uneven="stop",
                        device=device if device.type == "cuda" else None)
    start = 0
    if args.resume:
        # Every rank reads the file; the data state is plain builtins (weights_only is enough).
        saved = torch.load(args.resume, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["data"])  # this rank's lanes, whatever the old world size
        start = int(saved["step"])
    if rank == 0:
        print(f"world size {world_size}, {args.lanes} lanes (rank r reads lanes l % "
              f"{world_size} == r), steps {start}..{args.steps - 1}"
              + (f", resumed from {args.resume}" if args.resume else ""), flush=True)

    log: list[dict[str, Any]] = []
    with loader:
        # zip asks range() first: the loader is not read past the last step.
        for step, batch in zip(range(start, args.steps), loader):
            logits = ddp(batch["input_ids"].to(device), batch["positions"].to(device),
                         batch["cu_seqlens"].to(device))
            loss = lm_loss(logits, batch["labels"].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            log.append({"step": step, "ids": [list(i) for i in batch["ids"]]})
            if rank == 0:
                print(f"  step {step:3d}  loss {mean.item() / world_size:.4f}", flush=True)
        done = start + len(log)
        if args.checkpoint:
            data = loader.state_dict(gather=True)  # collective: every rank calls it
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "data": data, "step": done, "world_size": world_size},
                           args.checkpoint)
                print(f"checkpoint after {done} steps -> {args.checkpoint} (all {args.lanes} "
                      "lanes: restarts on any world size)", flush=True)
    if args.ids_out:
        logs: list[Any] = [None] * world_size
        dist.all_gather_object(logs, log)
        if rank == 0:
            record = {"world_size": world_size, "start": start, "steps": done - start,
                      "ranks": logs}
            Path(args.ids_out).write_text(json.dumps(record))
    dist.barrier()
    if args.out is None and rank == 0:
        shutil.rmtree(out, ignore_errors=True)  # the temporary folder rank 0 made
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.lanes < 1:
        raise SystemExit("--lanes must be >= 1")
    return train(args)


if __name__ == "__main__":
    raise SystemExit(main())
