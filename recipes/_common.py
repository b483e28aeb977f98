"""Shared pieces of the recipes: generated corpora, the tokenizer, a tiny GPT.

Every recipe runs out of the box on data it generates (so nothing is
downloaded) and on a real corpus with ``--data``/``--tokenizer``. This module
holds what they have in common:

* corpora: web-style prose (``zephon_torch.demo``'s heavy-tailed documents),
  code-style documents, and chat conversations, written as JSONL;
* the tokenizer: a ``tokenizer.json`` given by the user, or a small
  byte-level BPE trained on the spot (``zephon_torch.demo.train_tokenizer``);
* :class:`TinyGPT`: a few pre-norm transformer blocks whose attention is
  causal *and* stays inside each packed document. The mask comes from the
  ``cu_seqlens`` that ``to_training`` returns, and the position embeddings
  from the per-document ``positions`` that ``pack_flat`` writes, so a packed
  row of three documents trains like three separate sequences::

      positions   0 1 2 3 0 1 2 0 1      cu_seqlens [0, 4, 7, 9]
      document    a a a a b b b c c      token 5 (b, position 1) sees tokens 4..5

Recipes import it as ``from _common import ...``: running ``python
recipes/X.py`` puts ``recipes/`` first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import random
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from zephon_torch.demo import EOS, default_corpus, train_tokenizer
from zephon_torch.ops.tokenizer_loading import EOS_TOKEN_CANDIDATES

__all__ = [
    "EOS",
    "TinyGPT",
    "base_parser",
    "code_corpus",
    "conversations",
    "document_mask",
    "eos_id_of",
    "expand_paths",
    "lm_loss",
    "prepare_tokenizer",
    "read_field",
    "web_corpus",
    "workdir",
    "write_jsonl",
]

_IDENTIFIERS = ("lane", "chunk", "batch", "token", "cursor", "state", "shard", "row", "seed",
                "buffer", "offset", "count")
_THINGS = ("sky", "grass", "sun", "sea", "snow", "coal", "rose", "lemon", "plum", "ash",
           "leaf", "sand")
_COLOURS = ("blue", "green", "yellow", "blue", "white", "black", "red", "yellow", "purple",
            "grey", "green", "brown")


# --------------------------------------------------------------------------- corpora


def web_corpus(count: int, seed: int = 0) -> list[str]:
    """Prose documents of heavy-tailed lengths (the demo's generator)."""
    return default_corpus(count, seed=seed)


def code_corpus(count: int, seed: int = 1) -> list[str]:
    """Python-looking documents: a few small functions each, longer than a web page."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        lines = []
        for _ in range(rng.randint(1, 4)):
            a, b = rng.sample(_IDENTIFIERS, 2)
            lines.append(f"def {a}_{b}({a}, {b}):")
            for _ in range(rng.randint(1, 5)):
                x, y = rng.sample(_IDENTIFIERS, 2)
                lines.append(f"    {x} = {y} + {rng.randint(0, 99)}")
            lines.append(f"    return {a}\n")
        docs.append("\n".join(lines))
    return docs


def conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat samples: 1-3 question/answer turns, sometimes after a system message.

    The answers are a fixed function of the questions (each thing has one
    colour), so a tiny model can learn them and its SFT loss visibly falls.
    """
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "Answer in one short sentence."})
        for _ in range(rng.randint(1, 3)):
            k = rng.randrange(len(_THINGS))
            messages.append({"role": "user", "content": f"What colour is the {_THINGS[k]}?"})
            messages.append({"role": "assistant",
                             "content": f"The {_THINGS[k]} is {_COLOURS[k]}."})
        samples.append(messages)
    return samples


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write one JSON object per line; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def expand_paths(pattern: str) -> list[str]:
    """The files a glob names, sorted; a clear error when there are none."""
    paths = sorted(glob.glob(pattern, recursive=True))
    if not paths:
        raise SystemExit(f"--data {pattern!r} matches no file")
    return paths


def read_field(paths: Sequence[str], field: str, limit: int) -> list[Any]:
    """Up to ``limit`` values of ``field`` from JSONL files (to train a tokenizer)."""
    values: list[Any] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    values.append(json.loads(line).get(field))
                if len(values) >= limit:
                    return values
    return values


# --------------------------------------------------------------------------- tokenizer


def prepare_tokenizer(path: str | None, texts: Sequence[str], out: Path,
                      vocab_size: int = 512) -> tuple[str, Tokenizer]:
    """The user's ``tokenizer.json``, or a BPE trained on ``texts`` and saved in ``out``.

    Returns the file's path (what the pipeline is given: it pickles as a
    string and hashes into the fingerprint) and the loaded tokenizer.
    """
    if path is not None:
        return path, Tokenizer.from_file(path)
    tokenizer = train_tokenizer(list(texts), vocab_size=vocab_size)
    saved = out / "tokenizer.json"
    tokenizer.save(str(saved))
    return str(saved), tokenizer


def eos_id_of(tokenizer: Tokenizer) -> int:
    """The end-of-text id, found the way ``tokenize`` finds it."""
    for token in EOS_TOKEN_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise SystemExit(
        f"the tokenizer has none of the end-of-text tokens {list(EOS_TOKEN_CANDIDATES)}; "
        "use one that does"
    )


# --------------------------------------------------------------------------- the model


def document_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean ``[B, S, S]`` mask (True: may attend): causal, and only within a document.

    ``cu_seqlens`` is ``to_training``'s ``[B, K]`` form: each row's segment
    starts followed by the row length, padded with the row length.
    """
    positions = torch.arange(length, device=cu_seqlens.device)
    # The segment of a position is the number of segment ends at or before it.
    segment = (positions[None, :, None] >= cu_seqlens[:, None, 1:]).sum(-1)
    same_doc = segment[:, :, None] == segment[:, None, :]
    causal = positions[:, None] >= positions[None, :]
    return same_doc & causal


class _Block(nn.Module):
    """Pre-norm attention and MLP, with residuals."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        batch, length, width = h.shape
        q, k, v = (self.qkv(self.norm1(h))
                   .view(batch, length, 3, self.heads, width // self.heads)
                   .permute(2, 0, 3, 1, 4))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        h = h + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return h + self.mlp(self.norm2(h))


class TinyGPT(nn.Module):
    """A GPT-style LM for packed rows: token + position embeddings, blocks, a head.

    Args:
        vocab_size: Tokenizer vocabulary size.
        width: Model width (divisible by ``heads``).
        layers: Number of transformer blocks.
        heads: Attention heads per block.
        max_positions: Largest position + 1 (``pack_flat`` positions restart
            at 0 for every document, so the row length is enough).
    """

    def __init__(self, vocab_size: int, *, width: int = 64, layers: int = 2, heads: int = 4,
                 max_positions: int = 1024) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(max_positions, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, S, vocab]`` for a packed batch from ``to_training``."""
        allowed = document_mask(cu_seqlens, input_ids.shape[1])
        h = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            h = block(h, allowed)
        return self.head(self.norm(h))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy over supervised labels.

    Labels equal to -100 (padding, masked turns) contribute nothing; with
    ``weights`` (``to_training``'s label-aligned ``loss_mask``) each token's
    loss is weighted and the sum divided by the total weight.
    """
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                ignore_index=-100, reduction="none")
    if weights is None:
        weights = (labels.flatten() != -100).float()
    else:
        weights = weights.flatten().float()
    return (per_token * weights).sum() / weights.sum().clamp(min=1.0)


# --------------------------------------------------------------------------- command line


def base_parser(description: str, *, steps: int, seq_len: int = 128, batch_size: int = 8,
                data_help: str = "JSONL glob of a real corpus (default: generated)",
                data_action: str = "store") -> argparse.ArgumentParser:
    """The options every recipe shares (``data_action="append"``: one glob per source)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", action=data_action, help=data_help)
    parser.add_argument("--tokenizer", help="tokenizer.json (default: a BPE trained on the data)")
    parser.add_argument("--steps", type=int, default=steps, help="training steps")
    parser.add_argument("--seq-len", type=int, default=seq_len,
                        help="model sequence length (rows are one longer, for the labels)")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="rows per batch")
    parser.add_argument("--runner", choices=["inline", "threads", "process", "lanes"],
                        help="default: lane workers for zephon_torch.DataLoader (with "
                        "--num-workers > 0), threads for pipe.iter()")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1 ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="keep generated files here (default: a temporary folder)")
    return parser


@contextlib.contextmanager
def workdir(out: str | None) -> Iterator[Path]:
    """``out`` (created if needed), or a temporary folder removed afterwards."""
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="zephon-recipe-") as tmp:
        yield Path(tmp)
