"""Small transformers causal LMs, built from a config (no download), train on zephon batches.

``to_training(format="hf")`` is checked against the model itself: ``model(**batch)``
runs, its loss equals the loss computed by hand from the logits, an optimizer
step lowers it, packed rows give every document the loss it has on its own, and
a chat (SFT) pipeline supervises only the assistant's tokens.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zephon_torch as zt
from zephon_torch.ops.tokenize import Tokenize
from zephon_torch.types import SampleBatch

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def llama(vocab_size: int, attention: str = "eager") -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        use_cache=False)
    config._attn_implementation = attention
    return transformers.LlamaForCausalLM(config)


def gpt2(vocab_size: int, attention: str = "eager") -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=256,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    config._attn_implementation = attention
    return transformers.GPT2LMHeadModel(config)


def texts(n: int = 48) -> list[str]:
    return [f"the lane {i} " + "kazo phelin tra " * (i % 9) + "the end." for i in range(n)]


def packed_batch(tokenizer: Any, row: int = 48, rows: int = 4) -> SampleBatch:
    pipe = (zt.Pipeline.from_items(texts(), num_lanes=1, chunk_size=16)
            .tokenize(tokenizer).pack_flat(row).batch(rows))
    return next(iter(pipe.iter(runner="inline")))


def hand_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of label j given inputs up to j - 1, ignoring -100."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    labels = batch["labels"]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
        ignore_index=-100)


@pytest.mark.parametrize("build", [llama, gpt2])
def test_a_causal_lm_trains_on_the_preset(tokenizer, build):
    batch = packed_batch(tokenizer).to_training(format="hf")
    assert sorted(batch) == ["input_ids", "labels", "position_ids"]
    model = build(tokenizer.get_vocab_size())
    loss = model(**batch).loss
    torch.testing.assert_close(loss, hand_loss(model, batch))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    assert model(**batch).loss < loss  # one step on this batch lowers its loss


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("flatten", [False, True])
def test_packed_rows_give_each_document_the_loss_it_has_alone(tokenizer, attention, flatten):
    packed = packed_batch(tokenizer)
    batch = packed.to_training(format="hf", flatten=flatten)
    model = llama(tokenizer.get_vocab_size(), attention).eval()
    counted = int((batch["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        total = model(**batch).loss * counted
        alone, documents = torch.zeros(()), 0
        for record in packed:
            ids = torch.as_tensor(record.payload["input_ids"], dtype=torch.long)
            positions = record.payload["positions"]
            real = len(ids) - record.meta.padding_length
            starts = [*np.flatnonzero(positions[:real] == 0).tolist(), real]
            for a, b in itertools.pairwise(starts):
                doc = ids[a:b][None]
                if doc.shape[1] > 1:
                    alone += model(input_ids=doc, labels=doc).loss * (doc.shape[1] - 1)
                    documents += 1
    assert documents > len(packed)  # rows really hold several documents
    torch.testing.assert_close(total, alone, rtol=1e-5, atol=1e-4)


def test_an_sft_pipeline_supervises_only_the_assistant(tmp_path: Path, tokenizer):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.eos_token, tok.pad_token, tok.chat_template = "<|im_end|>", "<pad>", CHATML
    tok.save_pretrained(str(tmp_path / "tok"))
    chats = [{"messages": [{"role": "user", "content": f"question {i} kazo?"},
                           {"role": "assistant", "content": f"answer {i} " + "tra " * (i % 5)}]}
             for i in range(24)]
    pipe = (zt.Pipeline.from_items(chats, num_lanes=1, chunk_size=8)
            .tokenize_chat(str(tmp_path / "tok")).pack_flat(64).batch(2))
    packed = next(iter(pipe.iter(runner="inline")))
    batch = packed.to_training(format="hf")
    mask = torch.as_tensor(np.stack([r.payload["loss_mask"] for r in packed]))
    starts = batch["position_ids"] == 0
    assert torch.equal(batch["labels"] != -100, (mask == 1) & ~starts)
    supervised = tok.decode(batch["labels"][batch["labels"] != -100].tolist())
    assert "answer" in supervised and "<|im_end|>" in supervised
    assert "question" not in supervised and "user" not in supervised
    model = llama(len(tok))
    loss = model(**batch).loss
    torch.testing.assert_close(loss, hand_loss(model, batch))
    loss.backward()


def test_the_saved_directory_is_what_transformers_reads(tmp_path: Path, tokenizer):
    # tokenize reads a save_pretrained directory as transformers does.
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>",
                                               bos_token="<s>")
    tok.save_pretrained(str(tmp_path / "tok"))
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "</s>"
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    op = Tokenize(str(tmp_path / "tok"), special_tokens="bos_eos")
    assert (op.bos_token_id, op.eos_token_id) == (back.bos_token_id, back.eos_token_id)
