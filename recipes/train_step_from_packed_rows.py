"""Packed rows -> ``to_training`` -> a few optimizer steps of a tiny causal LM.

The rows come from the demo pipeline (``zephon_torch.demo``: tokenize with
EOS, ``pack_flat`` with positions restarting per document, shuffle, batch).
The model is a one-layer transformer whose attention mask is
built from ``cu_seqlens``, so a token never attends across documents, and
whose loss ignores padding through the labels' ``ignore_index``.

Run: ``.venv/bin/python recipes/train_step_from_packed_rows.py``
"""

from __future__ import annotations

import torch
from torch import nn

from zephon_torch.demo import demo_pipeline


def document_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean ``[B, S, S]`` mask: causal, and only within a document."""
    positions = torch.arange(length)
    # segment id of every position: how many boundaries are <= it, per row
    seg = (positions[None, :, None] >= cu_seqlens[:, None, 1:]).sum(-1)
    same_doc = seg[:, :, None] == seg[:, None, :]
    causal = positions[None, :, None] >= positions[None, None, :]
    return same_doc & causal


class TinyLM(nn.Module):
    """Embedding, one self-attention block, output head."""

    def __init__(self, vocab: int = 512, width: int = 64, max_len: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        self.attn = nn.MultiheadAttention(width, num_heads=4, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos(positions)
        blocked = ~allowed.repeat_interleave(self.attn.num_heads, dim=0)
        out, _ = self.attn(h, h, h, attn_mask=blocked)
        return self.head(h + out)


def main() -> None:
    torch.manual_seed(0)
    batch = next(iter(demo_pipeline(row_length=97).iter(runner="inline")))
    data = batch.to_training(return_labels=True, return_cu_seqlens=True,
                             return_num_valid_tokens=True, eos_mask_loss=True,
                             eos_token_id=0)  # the demo tokenizer's EOS
    allowed = document_mask(data["cu_seqlens"], data["input_ids"].shape[1])
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100, reduction="sum")
    for step in range(5):
        logits = model(data["input_ids"], data["positions"], allowed)
        loss = loss_fn(logits.flatten(0, 1), data["labels"].flatten()) / data["num_valid_tokens"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.3f} over {data['num_valid_tokens']} tokens")


if __name__ == "__main__":
    main()
