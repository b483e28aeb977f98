"""``SampleBatch.to_training(format="hf")``: exactly what a transformers causal LM takes.

A transformers causal LM shifts ``labels`` itself, so the preset's labels are
the input tokens at the same positions (with -100 where no loss is wanted),
never the next tokens. These tests check the arrays by hand; a real model is
run in ``test_huggingface.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import zephon_torch as zt
from zephon_torch.types import PACKING_METADATA_TAG, SampleBatch, SampleMeta, SampleRecord

A, B, C, D, EOS, PAD = 5, 6, 7, 8, 2, 0
X = -100  # ignored label


def rec(i: int, payload: Any, padding: int | None = None) -> SampleRecord:
    tags = {} if padding is None else {PACKING_METADATA_TAG: {"padding_length": padding}}
    meta = SampleMeta(sample_id=(0, 0, i), lane_id=0, chunk_id=0, chunk_offset=i, tags=tags)
    return SampleRecord(meta, payload)


def arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def hf(*records: SampleRecord, **options: Any) -> dict[str, Any]:
    out = SampleBatch(list(records)).to_training(format="hf", **options)
    for value in out.values():
        assert isinstance(value, torch.Tensor) and value.dtype == torch.long
    return {k: v.tolist() for k, v in out.items()}


PACKED = {"input_ids": arr(A, B, EOS, C, D, EOS, PAD, PAD),
          "positions": arr(0, 1, 2, 0, 1, 2, 0, 1), "text": "not a model input"}


def test_labels_are_the_input_tokens_at_the_same_positions_not_the_next_ones():
    out = hf(rec(0, PACKED, padding=2))
    assert list(out) == ["input_ids", "labels", "position_ids"]  # tensors only: no ids, texts
    assert out["input_ids"] == [[A, B, EOS, C, D, EOS, PAD, PAD]]
    # The first token of each document and the padding are ignored; the model
    # predicts label j from inputs up to j - 1 (it shifts them itself).
    assert out["labels"] == [[X, B, EOS, X, D, EOS, X, X]]
    assert out["position_ids"] == [[0, 1, 2, 0, 1, 2, 0, 1]]
    shifted = SampleBatch([rec(0, PACKED, padding=2)]).to_training(return_labels=True)
    assert shifted["labels"].tolist() == [[B, EOS, C, D, EOS, X, X]]  # for your own loss


def test_rows_without_positions_get_an_attention_mask():
    row = {"input_ids": arr(A, B, EOS, C, D, EOS, PAD, PAD)}
    out = hf(rec(0, row, padding=2), rec(1, {"input_ids": arr(C, D, EOS, A, B, C, D, EOS)}))
    assert list(out) == ["input_ids", "labels", "attention_mask"]
    assert out["labels"] == [[A, B, EOS, C, D, EOS, X, X], [C, D, EOS, A, B, C, D, EOS]]
    assert out["attention_mask"] == [[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8]


def test_a_loss_mask_ignores_labels_at_its_own_positions():
    chat = {"input_ids": arr(3, 4, 9, 7, 8, EOS), "loss_mask": arr(0, 0, 0, 1, 1, 1)}
    assert hf(rec(0, chat))["labels"] == [[X, X, X, 7, 8, EOS]]
    # return_labels shifts the same mask by one, with the labels.
    shifted = SampleBatch([rec(0, chat)]).to_training(return_labels=True)["labels"]
    assert shifted.tolist() == [[X, X, 7, 8, EOS]]


def test_rows_of_different_lengths_are_padded_on_the_right_with_an_attention_mask():
    out = hf(rec(0, arr(A, B, C)), rec(1, arr(D, EOS)))
    assert out == {"input_ids": [[A, B, C], [D, EOS, 0]], "labels": [[A, B, C], [D, EOS, X]],
                   "attention_mask": [[1, 1, 1], [1, 1, 0]]}


def test_rows_of_different_lengths_with_positions_are_refused():
    rows = [rec(0, {"input_ids": arr(A, B), "positions": arr(0, 1)}),
            rec(1, {"input_ids": arr(C), "positions": arr(0)})]
    with pytest.raises(ValueError, match=r"token rows have different lengths \(2, 1\) and carry "
                                         r"positions; format='hf' pads rows"):
        SampleBatch(rows).to_training(format="hf")


def test_flatten_gives_one_row_with_positions_restarting_in_every_row_or_document():
    plain = {"input_ids": arr(A, B, EOS)}
    out = hf(rec(0, plain), rec(1, plain, padding=1), flatten=True)
    assert out == {"input_ids": [[A, B, EOS, A, B, EOS]], "labels": [[A, B, EOS, A, B, X]],
                   "position_ids": [[0, 1, 2, 0, 1, 2]]}
    out = hf(rec(0, PACKED, padding=2), rec(1, PACKED, padding=2), flatten=True)
    assert out["position_ids"] == [[0, 1, 2, 0, 1, 2, 0, 1] * 2]
    assert out["labels"] == [[X, B, EOS, X, D, EOS, X, X] * 2]


def test_eos_mask_loss_ignores_the_label_after_each_eos():
    row = {"input_ids": arr(A, EOS, B, EOS, C)}
    assert hf(rec(0, row), eos_mask_loss=True, eos_token_id=EOS)["labels"] == [[A, EOS, X, EOS, X]]
    with pytest.raises(ValueError, match="eos_mask_loss=True needs a known EOS id"):
        SampleBatch([rec(0, row)]).to_training(format="hf", eos_mask_loss=True)


@pytest.mark.parametrize(("option", "value"), [
    ("return_labels", True), ("return_loss_mask", True), ("return_num_valid_tokens", True),
    ("return_cu_seqlens", True), ("return_padding_mask", True), ("position_mode", "sequence"),
    ("dtype", None), ("dtype", np.int64), ("dtype", torch.int32), ("ignore_index", -1),
])
def test_options_the_preset_decides_itself_are_refused(option, value):
    with pytest.raises(ValueError, match=rf"^format='hf' does not take {option}="):
        SampleBatch([rec(0, PACKED)]).to_training(format="hf", **{option: value})


def test_the_return_labels_refusal_says_why():
    with pytest.raises(ValueError) as err:
        SampleBatch([rec(0, PACKED)]).to_training(format="hf", return_labels=True)
    assert str(err.value) == (
        "format='hf' does not take return_labels=True: labels are always returned with "
        "format='hf', at the same positions as input_ids (a transformers model shifts them "
        "itself); return_labels=True gives next-token labels for a loss of your own, without "
        "format='hf'")


def test_unknown_format_and_int64_dtype():
    with pytest.raises(ValueError, match=r"^unknown format 'transformers'; use None"):
        SampleBatch([rec(0, PACKED)]).to_training(format="transformers")
    assert hf(rec(0, PACKED), dtype=torch.int64) == hf(rec(0, PACKED))


def test_extra_fields_rename_and_exclude():
    row = {**PACKED, "token_type_ids": arr(0, 0, 0, 1, 1, 1, 1, 1)}
    out = hf(rec(0, row), extra_fields=("token_type_ids",), exclude_fields=("position_ids",),
             rename_fields={"labels": "targets"})
    assert list(out) == ["input_ids", "targets", "token_type_ids"]
    assert out["token_type_ids"] == [[0, 0, 0, 1, 1, 1, 1, 1]]
    for name in ("positions", "loss_mask", "labels"):
        with pytest.raises(ValueError, match=rf"extra field '{name}' is made by format='hf'"):
            SampleBatch([rec(0, {**row, "loss_mask": arr(*[1] * 8), "labels": arr(*[1] * 8)})]
                        ).to_training(format="hf", extra_fields=(name,))


def test_an_empty_batch_gives_empty_tensors():
    out = SampleBatch([]).to_training(format="hf")
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "input_ids": (0, 0), "labels": (0, 0), "attention_mask": (0, 0)}


def _packed_pipeline(tokenizer: Any) -> zt.Pipeline:
    texts = [f"the lane {i} " + "kazo phelin " * (i % 7) for i in range(40)]
    return (zt.Pipeline.from_items(texts, num_lanes=2, chunk_size=8)
            .tokenize(tokenizer).pack_flat(24).batch(4))


def test_batches_from_a_pipeline_read_from_columns_like_records(tokenizer):
    batches = list(_packed_pipeline(tokenizer).iter(runner="inline"))
    assert batches
    for b in batches:
        fast = b.to_training(format="hf")
        slow = SampleBatch(list(b.records)).to_training(format="hf")
        assert fast.keys() == slow.keys() == {"input_ids", "labels", "position_ids"}
        for key in fast:
            assert torch.equal(fast[key], slow[key]), key


def test_the_loader_yields_the_preset(tokenizer):
    loader = zt.DataLoader(_packed_pipeline(tokenizer), to_training={"format": "hf"},
                           in_process=True)
    first = next(iter(loader))
    assert sorted(first) == ["input_ids", "labels", "position_ids"]
    assert all(isinstance(v, torch.Tensor) and v.shape == (4, 24) for v in first.values())
