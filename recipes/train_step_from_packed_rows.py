"""Packed rows -> ``to_training`` -> a few optimizer steps of a tiny causal LM.

The rows come from the demo pipeline (``zephon_torch.demo``: tokenize with
EOS, ``pack_flat`` with positions restarting per document, shuffle, batch).
The model is a one-block ``TinyGPT`` (``recipes/_common.py``, shared with
the other recipes) whose attention mask is built from ``cu_seqlens``, so a
token never attends across documents, and whose loss ignores padding
through the labels' ``ignore_index``.

Run: ``.venv/bin/python recipes/train_step_from_packed_rows.py``
"""

from __future__ import annotations

import torch
from _common import TinyGPT, lm_loss

from zephon_torch.demo import demo_pipeline


def main() -> None:
    torch.manual_seed(0)
    batch = next(iter(demo_pipeline(row_length=97).iter(runner="inline")))
    data = batch.to_training(return_labels=True, return_cu_seqlens=True,
                             return_num_valid_tokens=True, eos_mask_loss=True,
                             eos_token_id=0)  # the demo tokenizer's EOS
    model = TinyGPT(512, layers=1, max_positions=512)  # the demo tokenizer's 512 ids
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(5):
        logits = model(data["input_ids"], data["positions"], data["cu_seqlens"])
        loss = lm_loss(logits, data["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.3f} over {data['num_valid_tokens']} tokens")


if __name__ == "__main__":
    main()
