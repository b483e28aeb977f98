"""Behaviour of ``SampleBatch.to_training``, one documented behaviour per test.

Every expected value below is worked out by hand from the reference page
(``seeds/zephon-types-reference.txt``).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from zephon_torch.types import PACKING_METADATA_TAG, SampleBatch, SampleMeta, SampleRecord

IGNORE = -100
F, T = False, True


# --------------------------------------------------------------------------- helpers


def rec(i: int, payload: Any, padding: int | None = None) -> SampleRecord:
    tags = {} if padding is None else {PACKING_METADATA_TAG: {"padding_length": padding}}
    meta = SampleMeta(sample_id=(0, 0, i), lane_id=0, chunk_id=0, chunk_offset=i, tags=tags)
    return SampleRecord(meta, payload)


def batch(*payloads: Any, paddings: list[int | None] | None = None) -> SampleBatch:
    paddings = [None] * len(payloads) if paddings is None else paddings
    return SampleBatch([rec(i, p, q) for i, (p, q) in enumerate(zip(payloads, paddings))])


def arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def as_list(x: Any) -> Any:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [as_list(v) for v in x]
    return x


def check_tensor(x: Any, expected: list, dtype: torch.dtype = torch.long) -> None:
    assert isinstance(x, torch.Tensor), type(x)
    assert x.dtype == dtype, x.dtype
    assert tuple(x.shape) == np.asarray(expected).shape, tuple(x.shape)
    assert x.tolist() == expected


def check_array(x: Any, expected: list, dtype: Any) -> None:
    assert isinstance(x, np.ndarray), type(x)
    assert x.dtype == np.dtype(dtype), x.dtype
    assert x.shape == np.asarray(expected).shape, x.shape
    assert x.tolist() == expected


def check_list(x: Any, expected: list, elem_type: type | None = None) -> None:
    assert type(x) is list, type(x)
    assert as_list(x) == expected
    if elem_type is not None:
        flat = [v for row in x for v in row] if x and isinstance(x[0], list) else list(x)
        assert all(type(v) is elem_type for v in flat), [type(v) for v in flat]


def two_rows() -> SampleBatch:
    return batch(
        {"input_ids": arr(1, 2, 3, 4), "text": "a"},
        {"input_ids": arr(5, 6, 7, 8), "text": "b"},
    )


# --------------------------------------------------------------------------- basics


def test_default_output_stacks_tokens():
    out = two_rows().to_training()
    assert set(out) == {"ids", "texts", "input_ids"}
    check_tensor(out["input_ids"], [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert out["ids"] == [(0, 0, 0), (0, 0, 1)]
    assert type(out["ids"]) is list
    assert out["texts"] == ["a", "b"]
    assert type(out["texts"]) is list


def test_label_shifting():
    out = two_rows().to_training(return_labels=True)
    assert set(out) == {"ids", "texts", "input_ids", "labels"}
    check_tensor(out["input_ids"], [[1, 2, 3], [5, 6, 7]])
    check_tensor(out["labels"], [[2, 3, 4], [6, 7, 8]])


def test_extra_fields_are_stacked_and_sliced_like_input_ids():
    b = batch(
        {"input_ids": arr(1, 2, 3, 4), "attention_mask": arr(1, 1, 1, 0), "other": arr(9, 9, 9, 9)},
        {"input_ids": arr(5, 6, 7, 8), "attention_mask": arr(1, 1, 0, 0), "other": arr(9, 9, 9, 9)},
    )
    plain = b.to_training(extra_fields=["attention_mask"])
    assert set(plain) == {"ids", "texts", "input_ids", "attention_mask"}  # "other" not listed
    check_tensor(plain["attention_mask"], [[1, 1, 1, 0], [1, 1, 0, 0]])

    shifted = b.to_training(extra_fields=("attention_mask",), return_labels=True)
    assert set(shifted) == {"ids", "texts", "input_ids", "labels", "attention_mask"}
    check_tensor(shifted["attention_mask"], [[1, 1, 1], [1, 1, 0]])
    check_tensor(shifted["input_ids"], [[1, 2, 3], [5, 6, 7]])


@pytest.mark.parametrize("ignore_index", [-100, -1, 12345])
def test_trailing_padding_labels_set_to_ignore_index(ignore_index):
    b = batch(
        {"input_ids": arr(1, 2, 3, 4, 0, 0)},
        {"input_ids": arr(5, 6, 7, 8, 9, 10)},
        {"input_ids": arr(11, 12, 13, 14, 15, 16)},
        {"input_ids": arr(17, 18, 19, 0, 0, 0)},
        paddings=[2, 0, None, 3],
    )
    out = b.to_training(return_labels=True, ignore_index=ignore_index)
    x = ignore_index
    check_tensor(out["input_ids"], [
        [1, 2, 3, 4, 0], [5, 6, 7, 8, 9], [11, 12, 13, 14, 15], [17, 18, 19, 0, 0],
    ])
    check_tensor(out["labels"], [
        [2, 3, 4, x, x], [6, 7, 8, 9, 10], [12, 13, 14, 15, 16], [18, 19, x, x, x],
    ])


def test_padding_does_not_touch_labels_without_return_labels():
    out = batch({"input_ids": arr(1, 2, 0)}, paddings=[1]).to_training()
    assert set(out) == {"ids", "texts", "input_ids"}
    check_tensor(out["input_ids"], [[1, 2, 0]])


# --------------------------------------------------------------------------- loss_mask


def _loss_mask_batch() -> SampleBatch:
    return batch(
        {"input_ids": arr(1, 2, 3, 4, 5, 6), "loss_mask": arr(0, 0, 1, 1, 0, 1)},
        {"input_ids": arr(7, 8, 9, 10, 11, 0), "loss_mask": arr(1, 1, 1, 1, 1, 1)},
        paddings=[None, 1],
    )


def test_loss_mask_is_consumed_with_labels():
    out = _loss_mask_batch().to_training(return_labels=True)
    # mask[:, 1:] == [[0, 1, 1, 0, 1], [1, 1, 1, 1, 1]]; row 1 has one pad token.
    assert set(out) == {"ids", "texts", "input_ids", "labels"}
    check_tensor(out["input_ids"], [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]])
    check_tensor(out["labels"], [[IGNORE, 3, 4, IGNORE, 6], [8, 9, 10, 11, IGNORE]])


def test_return_loss_mask_is_float32_and_matches_labels():
    out = _loss_mask_batch().to_training(return_labels=True, return_loss_mask=True)
    assert set(out) == {"ids", "texts", "input_ids", "labels", "loss_mask"}
    check_tensor(out["loss_mask"], [[0.0, 1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.0]],
                 torch.float32)
    assert out["loss_mask"].tolist() == (out["labels"] != IGNORE).float().tolist()


def test_return_loss_mask_without_payload_mask_reflects_padding():
    b = batch({"input_ids": arr(1, 2, 3, 0, 0)}, {"input_ids": arr(4, 5, 6, 7, 8)},
              paddings=[2, None])
    out = b.to_training(return_labels=True, return_loss_mask=True, ignore_index=-7)
    check_tensor(out["labels"], [[2, 3, -7, -7], [5, 6, 7, 8]])
    check_tensor(out["loss_mask"], [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], torch.float32)


def test_raw_loss_mask_surfaced_unshifted_without_labels():
    out = _loss_mask_batch().to_training()
    assert set(out) == {"ids", "texts", "input_ids", "loss_mask"}
    assert isinstance(out["loss_mask"], torch.Tensor)
    assert tuple(out["loss_mask"].shape) == (2, 6)
    assert out["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]]
    check_tensor(out["input_ids"], [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 0]])


# --------------------------------------------------------------------------- EOS masking

BOS, EOS, A, B = 1, 2, 5, 6


def test_eos_mask_loss_masks_only_eos_to_bos():
    b = batch({"input_ids": arr(BOS, A, EOS, BOS, B, EOS)})
    out = b.to_training(return_labels=True, eos_mask_loss=True, eos_token_id=EOS,
                        return_loss_mask=True, return_num_valid_tokens=True)
    check_tensor(out["input_ids"], [[BOS, A, EOS, BOS, B]])
    # predictions: BOS->A, A->EOS, EOS->BOS (masked), BOS->B, B->EOS
    check_tensor(out["labels"], [[A, EOS, IGNORE, B, EOS]])
    check_tensor(out["loss_mask"], [[1.0, 1.0, 0.0, 1.0, 1.0]], torch.float32)
    assert out["num_valid_tokens"] == 4


def test_eos_transitions_supervised_by_default():
    out = batch({"input_ids": arr(BOS, A, EOS, BOS, B, EOS)}).to_training(return_labels=True)
    check_tensor(out["labels"], [[A, EOS, BOS, B, EOS]])


def test_eos_mask_loss_when_bos_equals_eos_also_masks_after_bos():
    tok = 1  # BOS and EOS share an id
    b = batch({"input_ids": arr(tok, A, tok, tok, B, tok)})
    out = b.to_training(return_labels=True, eos_mask_loss=True, eos_token_id=tok)
    # inputs [1, 5, 1, 1, 6]; every prediction made from token 1 is masked,
    # including BOS -> first content token.
    check_tensor(out["labels"], [[IGNORE, tok, IGNORE, IGNORE, tok]])


def test_eos_masking_combines_with_padding_and_loss_mask():
    b = batch(
        {"input_ids": arr(BOS, A, EOS, BOS, B, EOS, 0, 0),
         "loss_mask": arr(0, 1, 1, 0, 0, 1, 0, 0)},
        paddings=[2],
    )
    out = b.to_training(return_labels=True, eos_mask_loss=True, eos_token_id=EOS,
                        return_loss_mask=True, return_num_valid_tokens=True)
    # labels:   [A, EOS, BOS, B, EOS, 0, 0]
    # mask[1:]: [1, 1,   0,   0, 1,   0, 0] -> ignore 2, 3, 5, 6
    # padding:  labels 5, 6; EOS inputs at 2 and 5.
    check_tensor(out["labels"], [[A, EOS, IGNORE, IGNORE, EOS, IGNORE, IGNORE]])
    check_tensor(out["loss_mask"], [[1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]], torch.float32)
    assert out["num_valid_tokens"] == 3


# --------------------------------------------------------------------------- positions

_POS_ROWS = [
    {"input_ids": arr(10, 11, 12, 13, 14, 15), "positions": arr(0, 1, 2, 0, 1, 2)},
    {"input_ids": arr(20, 21, 22, 23, 24, 25), "positions": arr(0, 1, 0, 1, 0, 1)},
]


def test_position_mode_preserve_forwards_payload_positions():
    out = batch(*_POS_ROWS).to_training()
    check_tensor(out["positions"], [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 0, 1]])
    shifted = batch(*_POS_ROWS).to_training(return_labels=True, position_mode="preserve")
    check_tensor(shifted["positions"], [[0, 1, 2, 0, 1], [0, 1, 0, 1, 0]])


def test_position_mode_preserve_omits_absent_positions():
    out = two_rows().to_training(return_labels=True)
    assert "positions" not in out


def test_position_mode_sequence_numbers_each_row():
    out = batch(*_POS_ROWS).to_training(position_mode="sequence")
    check_tensor(out["positions"], [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    shifted = batch(*_POS_ROWS).to_training(position_mode="sequence", return_labels=True)
    check_tensor(shifted["positions"], [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])


def test_position_mode_sequence_without_payload_positions():
    out = two_rows().to_training(position_mode="sequence", return_labels=True)
    check_tensor(out["positions"], [[0, 1, 2], [0, 1, 2]])


def test_position_mode_sequence_restarts_per_row_when_flattened():
    out = two_rows().to_training(position_mode="sequence", flatten=True)
    check_tensor(out["positions"], [0, 1, 2, 3, 0, 1, 2, 3])
    check_tensor(out["input_ids"], [1, 2, 3, 4, 5, 6, 7, 8])


def test_position_mode_sequence_uses_input_dtype():
    out = two_rows().to_training(position_mode="sequence", dtype=torch.int32)
    check_tensor(out["positions"], [[0, 1, 2, 3], [0, 1, 2, 3]], torch.int32)
    lists = two_rows().to_training(position_mode="sequence", dtype=None)
    check_list(lists["positions"], [[0, 1, 2, 3], [0, 1, 2, 3]], int)


# --------------------------------------------------------------------------- cu_seqlens


def test_cu_seqlens_rows_without_labels():
    out = batch(*_POS_ROWS).to_training(return_cu_seqlens=True)
    # row 0 -> [0, 3, 6]; row 1 -> [0, 2, 4, 6]; K = 4, row 0 padded with its length.
    check_tensor(out["cu_seqlens"], [[0, 3, 6, 6], [0, 2, 4, 6]], torch.int32)
    check_tensor(out["max_seqlen"], [3, 2], torch.int32)
    assert "labels" not in out


def test_cu_seqlens_rows_with_labels():
    out = batch(*_POS_ROWS).to_training(return_cu_seqlens=True, return_labels=True)
    # input-aligned positions [0,1,2,0,1] -> [0,3,5]; [0,1,0,1,0] -> [0,2,4,5]
    check_tensor(out["cu_seqlens"], [[0, 3, 5, 5], [0, 2, 4, 5]], torch.int32)
    check_tensor(out["max_seqlen"], [3, 2], torch.int32)


def test_cu_seqlens_flat_without_labels():
    out = batch(*_POS_ROWS).to_training(return_cu_seqlens=True, flatten=True)
    check_tensor(out["cu_seqlens"], [0, 3, 6, 8, 10, 12], torch.int32)
    assert out["max_seqlen"] == 3
    assert type(out["max_seqlen"]) is int


def test_cu_seqlens_flat_with_labels():
    out = batch(*_POS_ROWS).to_training(return_cu_seqlens=True, flatten=True,
                                        return_labels=True)
    check_tensor(out["cu_seqlens"], [0, 3, 5, 7, 9, 10], torch.int32)
    assert out["max_seqlen"] == 3
    assert type(out["max_seqlen"]) is int
    check_tensor(out["input_ids"], [10, 11, 12, 13, 14, 20, 21, 22, 23, 24])


def test_cu_seqlens_single_segment_rows_and_padding_segment():
    b = batch(
        {"input_ids": arr(1, 2, 3, 4), "positions": arr(0, 1, 2, 3)},
        {"input_ids": arr(5, 6, 0, 0), "positions": arr(0, 1, 0, 1)},
        paddings=[0, 2],
    )
    out = b.to_training(return_cu_seqlens=True)
    check_tensor(out["cu_seqlens"], [[0, 4, 4], [0, 2, 4]], torch.int32)
    check_tensor(out["max_seqlen"], [4, 2], torch.int32)


def test_cu_seqlens_use_payload_positions_in_sequence_mode():
    out = batch(*_POS_ROWS).to_training(return_cu_seqlens=True, position_mode="sequence")
    check_tensor(out["positions"], [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    check_tensor(out["cu_seqlens"], [[0, 3, 6, 6], [0, 2, 4, 6]], torch.int32)
    check_tensor(out["max_seqlen"], [3, 2], torch.int32)


def test_cu_seqlens_rename_and_exclude():
    out = batch(*_POS_ROWS).to_training(
        return_cu_seqlens=True, rename_fields={"cu_seqlens": "cu_seqlens_q"},
        exclude_fields=["max_seqlen"],
    )
    assert set(out) == {"ids", "texts", "input_ids", "positions", "cu_seqlens_q"}
    check_tensor(out["cu_seqlens_q"], [[0, 3, 6, 6], [0, 2, 4, 6]], torch.int32)


# --------------------------------------------------------------------------- padding mask


def _padding_batch() -> SampleBatch:
    return batch(
        {"input_ids": arr(1, 2, 3, 4, 0, 0)},
        {"input_ids": arr(5, 6, 7, 8, 9, 10)},
        {"input_ids": arr(11, 12, 13, 14, 15, 16)},
        {"input_ids": arr(0, 0, 0, 0, 0, 0)},
        paddings=[2, 0, None, 6],
    )


def test_padding_mask_input_aligned():
    out = _padding_batch().to_training(return_padding_mask=True)
    check_tensor(out["padding_mask"], [
        [F, F, F, F, T, T], [F] * 6, [F] * 6, [T] * 6,
    ], torch.bool)


def test_padding_mask_drops_last_with_labels():
    out = _padding_batch().to_training(return_padding_mask=True, return_labels=True)
    check_tensor(out["padding_mask"], [
        [F, F, F, F, T], [F] * 5, [F] * 5, [T] * 5,
    ], torch.bool)
    check_tensor(out["labels"], [
        [2, 3, 4, IGNORE, IGNORE], [6, 7, 8, 9, 10], [12, 13, 14, 15, 16], [IGNORE] * 5,
    ])


def test_padding_mask_ignores_token_ids_and_loss_mask():
    b = batch(
        {"input_ids": arr(0, IGNORE, 0, 0), "loss_mask": arr(0, 0, 0, 0)},
        {"input_ids": arr(3, 4, IGNORE, 0), "loss_mask": arr(1, 0, 0, 0)},
    )
    out = b.to_training(return_padding_mask=True, return_labels=True)
    check_tensor(out["padding_mask"], [[F, F, F], [F, F, F]], torch.bool)


# --------------------------------------------------------------------------- flatten


def test_flatten_equals_reshape():
    b = batch(
        {"input_ids": arr(1, 2, 3, 4, 0), "positions": arr(0, 1, 0, 1, 0),
         "loss_mask": arr(1, 1, 0, 1, 1), "attention_mask": arr(1, 1, 1, 1, 0), "text": "x"},
        {"input_ids": arr(5, 6, 7, 8, 9), "positions": arr(0, 1, 2, 3, 4),
         "loss_mask": arr(1, 1, 1, 1, 1), "attention_mask": arr(1, 1, 1, 1, 1), "text": "y"},
        paddings=[1, 0],
    )
    kw = dict(return_labels=True, return_loss_mask=True, return_padding_mask=True,
              extra_fields=["attention_mask"], return_num_valid_tokens=True)
    rows = b.to_training(**kw)
    flat = b.to_training(flatten=True, **kw)
    assert set(rows) == set(flat)
    for key in ("input_ids", "labels", "positions", "loss_mask", "padding_mask",
                "attention_mask"):
        assert flat[key].dtype == rows[key].dtype, key
        assert tuple(flat[key].shape) == (rows[key].numel(),), key
        assert flat[key].tolist() == rows[key].reshape(-1).tolist(), key
    check_tensor(flat["input_ids"], [1, 2, 3, 4, 5, 6, 7, 8])
    check_tensor(flat["labels"], [2, IGNORE, 4, IGNORE, 6, 7, 8, 9])
    assert flat["ids"] == [(0, 0, 0), (0, 0, 1)]
    assert flat["texts"] == ["x", "y"]
    assert flat["num_valid_tokens"] == rows["num_valid_tokens"] == 6


# --------------------------------------------------------------------------- rename / exclude


def test_rename_fields():
    out = two_rows().to_training(return_labels=True,
                                 rename_fields={"input_ids": "input", "labels": "target"})
    assert set(out) == {"ids", "texts", "input", "target"}
    check_tensor(out["input"], [[1, 2, 3], [5, 6, 7]])
    check_tensor(out["target"], [[2, 3, 4], [6, 7, 8]])


def test_rename_ids_and_texts():
    out = two_rows().to_training(rename_fields={"ids": "sample_ids", "texts": "raw"})
    assert set(out) == {"sample_ids", "raw", "input_ids"}
    assert out["sample_ids"] == [(0, 0, 0), (0, 0, 1)]
    assert out["raw"] == ["a", "b"]


def test_rename_swap():
    out = two_rows().to_training(return_labels=True,
                                 rename_fields={"input_ids": "labels", "labels": "input_ids"})
    assert set(out) == {"ids", "texts", "input_ids", "labels"}
    check_tensor(out["labels"], [[1, 2, 3], [5, 6, 7]])
    check_tensor(out["input_ids"], [[2, 3, 4], [6, 7, 8]])


def test_rename_applies_before_exclude():
    b = two_rows()
    gone = b.to_training(rename_fields={"input_ids": "inp"}, exclude_fields=["inp"])
    assert set(gone) == {"ids", "texts"}
    kept = b.to_training(rename_fields={"input_ids": "inp"}, exclude_fields=["input_ids"])
    assert set(kept) == {"ids", "texts", "inp"}
    check_tensor(kept["inp"], [[1, 2, 3, 4], [5, 6, 7, 8]])
    swapped = b.to_training(return_labels=True, exclude_fields=("labels",),
                            rename_fields={"input_ids": "labels", "labels": "input_ids"})
    assert set(swapped) == {"ids", "texts", "input_ids"}
    check_tensor(swapped["input_ids"], [[2, 3, 4], [6, 7, 8]])


def test_exclude_fields():
    b = two_rows()
    out = b.to_training(exclude_fields=("ids", "texts"))
    assert set(out) == {"input_ids"}
    check_tensor(out["input_ids"], [[1, 2, 3, 4], [5, 6, 7, 8]])
    out = b.to_training(return_labels=True, exclude_fields=["input_ids", "not_there"])
    assert set(out) == {"ids", "texts", "labels"}


def test_generated_masks_follow_rename_and_exclude():
    out = _loss_mask_batch().to_training(
        return_labels=True, return_loss_mask=True, return_padding_mask=True, flatten=True,
        rename_fields={"loss_mask": "weights", "padding_mask": "is_pad"},
        exclude_fields=["is_pad", "ids"],
    )
    assert set(out) == {"texts", "input_ids", "labels", "weights"}
    check_tensor(out["weights"], [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
                 torch.float32)
    kept = _loss_mask_batch().to_training(
        return_labels=True, return_padding_mask=True, rename_fields={"padding_mask": "is_pad"},
        exclude_fields=["padding_mask"],
    )
    assert set(kept) == {"ids", "texts", "input_ids", "labels", "is_pad"}
    check_tensor(kept["is_pad"], [[F, F, F, F, F], [F, F, F, F, F]], torch.bool)


# --------------------------------------------------------------------------- num_valid_tokens


def test_num_valid_tokens_is_python_int():
    out = _loss_mask_batch().to_training(return_labels=True, return_num_valid_tokens=True)
    # labels [[I, 3, 4, I, 6], [8, 9, 10, 11, I]]
    assert out["num_valid_tokens"] == 7
    assert type(out["num_valid_tokens"]) is int
    for dtype in (None, np.int64):
        other = _loss_mask_batch().to_training(return_labels=True, return_num_valid_tokens=True,
                                               dtype=dtype)
        assert other["num_valid_tokens"] == 7
        assert type(other["num_valid_tokens"]) is int


# --------------------------------------------------------------------------- tokens_field

_TOK = {"input_ids": [1, 2, 3], "tokens": [4, 5, 6], "token_ids": [7, 8, 9], "ids": [10, 11, 12]}


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (("input_ids", "tokens", "token_ids", "ids"), "input_ids"),
        (("ids", "token_ids", "tokens"), "tokens"),
        (("ids", "token_ids"), "token_ids"),
        (("ids",), "ids"),
    ],
)
def test_tokens_field_auto_detection_order(keys, expected):
    payload = {k: np.array(_TOK[k], dtype=np.int32) for k in keys}
    out = batch(payload, dict(payload)).to_training()
    assert set(out) == {"ids", "texts", "input_ids"}
    check_tensor(out["input_ids"], [_TOK[expected], _TOK[expected]])
    assert out["ids"] == [(0, 0, 0), (0, 0, 1)]  # sample ids, not the "ids" token field


def test_tokens_field_explicit_takes_precedence():
    payload = {k: np.array(v, dtype=np.int32) for k, v in _TOK.items()}
    out = batch(payload).to_training(tokens_field="token_ids", return_labels=True)
    assert set(out) == {"ids", "texts", "input_ids", "labels"}
    check_tensor(out["input_ids"], [[7, 8]])
    check_tensor(out["labels"], [[8, 9]])


def test_tokens_field_custom_name_output_key_before_rename():
    b = batch({"my_tokens": arr(4, 5, 6)})
    out = b.to_training(tokens_field="my_tokens")
    assert set(out) == {"ids", "texts", "input_ids"}
    check_tensor(out["input_ids"], [[4, 5, 6]])
    renamed = b.to_training(tokens_field="my_tokens", rename_fields={"input_ids": "x"})
    assert set(renamed) == {"ids", "texts", "x"}
    check_tensor(renamed["x"], [[4, 5, 6]])


# --------------------------------------------------------------------------- payload forms


@pytest.mark.parametrize(
    "make",
    [
        lambda v: np.array(v, dtype=np.int32),
        lambda v: np.array(v, dtype=np.int64),
        lambda v: list(v),
        lambda v: torch.tensor(v, dtype=torch.int32),
        lambda v: torch.tensor(v, dtype=torch.long),
    ],
    ids=["numpy32", "numpy64", "list", "torch32", "torch64"],
)
def test_bare_array_payloads(make):
    b = batch(make([1, 2, 3, 4]), make([5, 6, 7, 8]))
    out = b.to_training(return_labels=True)
    assert set(out) == {"ids", "texts", "input_ids", "labels"}
    check_tensor(out["input_ids"], [[1, 2, 3], [5, 6, 7]])
    check_tensor(out["labels"], [[2, 3, 4], [6, 7, 8]])
    assert out["texts"] == ["", ""]
    assert out["ids"] == [(0, 0, 0), (0, 0, 1)]


def test_texts_and_ids():
    b = SampleBatch([
        SampleRecord(SampleMeta((3, 1, 4), 0, 0), {"input_ids": arr(1, 2), "text": "hello"}),
        SampleRecord(SampleMeta((3, 1, 5), 0, 0, lineage=(0,)), {"input_ids": arr(3, 4)}),
    ])
    out = b.to_training()
    assert out["texts"] == ["hello", ""]
    assert out["ids"] == [(3, 1, 4), (3, 1, 5)]


# --------------------------------------------------------------------------- dtypes


def _full_batch() -> SampleBatch:
    return batch(
        {"input_ids": arr(1, 2, 3, 4, 0), "positions": arr(0, 1, 0, 1, 0),
         "loss_mask": arr(1, 1, 0, 1, 1)},
        {"input_ids": arr(5, 6, 7, 8, 9), "positions": arr(0, 1, 2, 3, 4),
         "loss_mask": arr(1, 1, 1, 1, 1)},
        paddings=[1, 0],
    )


_FULL_KW = dict(return_labels=True, return_loss_mask=True, return_padding_mask=True,
                return_cu_seqlens=True, return_num_valid_tokens=True)
_EXPECTED_ROWS = {
    "input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]],
    "labels": [[2, IGNORE, 4, IGNORE], [6, 7, 8, 9]],
    "positions": [[0, 1, 0, 1], [0, 1, 2, 3]],
    "loss_mask": [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]],
    "padding_mask": [[F, F, F, F], [F, F, F, F]],
    "cu_seqlens": [[0, 2, 4], [0, 4, 4]],
    "max_seqlen": [2, 4],
    "num_valid_tokens": 6,
}


def test_full_batch_expected_values():
    # Row 0: padding 1 -> input [1,2,3,4] is not padding (the pad token 0 is only a label).
    out = _full_batch().to_training(**_FULL_KW)
    assert set(out) == {"ids", "texts", *_EXPECTED_ROWS}
    for key, expected in _EXPECTED_ROWS.items():
        assert as_list(out[key]) == expected, key


@pytest.mark.parametrize("dtype", ["auto", torch.long, torch.int32])
def test_dtype_torch(dtype):
    out = _full_batch().to_training(dtype=dtype, **_FULL_KW)
    tok = torch.long if dtype == "auto" else dtype
    e = _EXPECTED_ROWS
    check_tensor(out["input_ids"], e["input_ids"], tok)
    check_tensor(out["labels"], e["labels"], tok)
    check_tensor(out["positions"], e["positions"], tok)
    check_tensor(out["loss_mask"], e["loss_mask"], torch.float32)
    check_tensor(out["padding_mask"], e["padding_mask"], torch.bool)
    check_tensor(out["cu_seqlens"], e["cu_seqlens"], torch.int32)
    check_tensor(out["max_seqlen"], e["max_seqlen"], torch.int32)
    assert type(out["num_valid_tokens"]) is int
    assert out["num_valid_tokens"] == 6


def test_dtype_none_returns_lists():
    out = _full_batch().to_training(dtype=None, **_FULL_KW)
    e = _EXPECTED_ROWS
    check_list(out["input_ids"], e["input_ids"])
    check_list(out["labels"], e["labels"])
    check_list(out["positions"], e["positions"])
    check_list(out["loss_mask"], e["loss_mask"], float)
    check_list(out["padding_mask"], e["padding_mask"], bool)
    check_list(out["cu_seqlens"], e["cu_seqlens"], int)
    check_list(out["max_seqlen"], e["max_seqlen"], int)
    assert all(type(row) is list for row in out["input_ids"])
    assert type(out["num_valid_tokens"]) is int
    assert out["num_valid_tokens"] == 6


@pytest.mark.parametrize("dtype", [np.int64, np.dtype("int64")])
def test_dtype_numpy_returns_arrays(dtype):
    out = _full_batch().to_training(dtype=dtype, **_FULL_KW)
    e = _EXPECTED_ROWS
    check_array(out["input_ids"], e["input_ids"], np.int64)
    check_array(out["labels"], e["labels"], np.int64)
    check_array(out["positions"], e["positions"], np.int64)
    check_array(out["loss_mask"], e["loss_mask"], np.float32)
    check_array(out["padding_mask"], e["padding_mask"], np.bool_)
    check_array(out["cu_seqlens"], e["cu_seqlens"], np.int32)
    check_array(out["max_seqlen"], e["max_seqlen"], np.int32)
    assert type(out["num_valid_tokens"]) is int
    assert out["num_valid_tokens"] == 6


@pytest.mark.parametrize("dtype", ["auto", None, np.int64, torch.int32])
def test_flat_max_seqlen_is_python_int_for_every_dtype(dtype):
    out = _full_batch().to_training(dtype=dtype, flatten=True, **_FULL_KW)
    assert out["max_seqlen"] == 4
    assert type(out["max_seqlen"]) is int
    assert as_list(out["cu_seqlens"]) == [0, 2, 4, 8]
    assert as_list(out["input_ids"]) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert as_list(out["loss_mask"]) == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    if dtype is None:
        check_list(out["cu_seqlens"], [0, 2, 4, 8], int)
        check_list(out["loss_mask"], [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], float)
    elif dtype is np.int64:
        check_array(out["cu_seqlens"], [0, 2, 4, 8], np.int32)
    else:
        check_tensor(out["cu_seqlens"], [0, 2, 4, 8], torch.int32)


_NO_TORCH_SCRIPT = """
import sys
sys.modules["torch"] = None  # `import torch` now fails, as if it were not installed
import numpy as np
from zephon_torch.types import PACKING_METADATA_TAG, SampleBatch, SampleMeta, SampleRecord
tags = {PACKING_METADATA_TAG: {"padding_length": 1}}
meta = SampleMeta(sample_id=(0, 0, 0), lane_id=0, chunk_id=0, tags=tags)
record = SampleRecord(meta, {"input_ids": np.array([1, 2, 3, 0], dtype=np.int32),
                             "positions": np.array([0, 1, 0, 1], dtype=np.int32)})
out = SampleBatch([record]).to_training(return_labels=True, return_loss_mask=True,
                                        return_cu_seqlens=True)
for key in ("input_ids", "labels", "loss_mask", "cu_seqlens"):
    print(key, type(out[key]).__name__, out[key].dtype, out[key].tolist())
"""


def test_dtype_auto_falls_back_to_numpy_without_torch():
    # "auto" prefers torch.long if available, else np.int64.
    result = subprocess.run([sys.executable, "-c", _NO_TORCH_SCRIPT], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "input_ids ndarray int64 [[1, 2, 3]]",
        "labels ndarray int64 [[2, 3, -100]]",
        "loss_mask ndarray float32 [[1.0, 1.0, 0.0]]",
        "cu_seqlens ndarray int32 [[0, 2, 3]]",
    ]


def test_device_cpu():
    out = _full_batch().to_training(device="cpu", **_FULL_KW)
    for key in ("input_ids", "labels", "positions", "loss_mask", "padding_mask",
                "cu_seqlens", "max_seqlen"):
        assert isinstance(out[key], torch.Tensor), key
        assert out[key].device.type == "cpu", key
        assert as_list(out[key]) == _EXPECTED_ROWS[key], key
    on_device = _full_batch().to_training(device=torch.device("cpu"), position_mode="sequence")
    assert on_device["positions"].device.type == "cpu"
    check_tensor(on_device["positions"], [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])


# --------------------------------------------------------------------------- empty batches


def _check_empty(out: dict, expected: dict) -> None:
    assert set(out) == set(expected)
    for key, value in expected.items():
        assert type(out[key]) is type(value), (key, type(out[key]))
        assert out[key] == value, key


def test_empty_batch_default():
    _check_empty(SampleBatch([]).to_training(), {"ids": [], "texts": []})
    _check_empty(SampleBatch([]).to_training(return_labels=True), {"ids": [], "texts": []})


@pytest.mark.parametrize("dtype", ["auto", None, np.int64])
def test_empty_batch_requested_forms(dtype):
    out = SampleBatch([]).to_training(
        dtype=dtype, position_mode="sequence", **_FULL_KW,
    )
    _check_empty(out, {
        "ids": [], "texts": [], "num_valid_tokens": 0, "loss_mask": [], "padding_mask": [],
        "cu_seqlens": [], "max_seqlen": [], "positions": [],
    })


def test_empty_batch_flattened_cu_seqlens():
    out = SampleBatch([]).to_training(return_cu_seqlens=True, flatten=True)
    _check_empty(out, {"ids": [], "texts": [], "cu_seqlens": [0], "max_seqlen": 0})


def test_empty_batch_renames_and_exclusions():
    out = SampleBatch([]).to_training(
        return_labels=True, return_loss_mask=True, return_num_valid_tokens=True,
        rename_fields={"ids": "sample_ids", "labels": "y", "input_ids": "x", "loss_mask": "lm"},
        exclude_fields=["texts"],
    )
    _check_empty(out, {"sample_ids": [], "lm": [], "num_valid_tokens": 0})


# --------------------------------------------------------------------------- ragged rows


def _ragged() -> SampleBatch:
    return batch(
        {"input_ids": arr(1, 2, 3), "positions": arr(0, 1, 2)},
        {"input_ids": arr(4, 5, 6, 7, 8), "positions": arr(0, 1, 0, 1, 2)},
    )


def test_ragged_rows_as_lists():
    out = _ragged().to_training(dtype=None, return_labels=True, return_cu_seqlens=True)
    check_list(out["input_ids"], [[1, 2], [4, 5, 6, 7]])
    check_list(out["labels"], [[2, 3], [5, 6, 7, 8]])
    check_list(out["positions"], [[0, 1], [0, 1, 0, 1]])
    # [0, 2] padded with the row length 2; [0, 2, 4]
    check_list(out["cu_seqlens"], [[0, 2, 2], [0, 2, 4]], int)
    check_list(out["max_seqlen"], [2, 2], int)


def test_ragged_rows_tensor_output_raises():
    with pytest.raises(ValueError, match=r"(?i)length|ragged|shape|size|same|stack"):
        _ragged().to_training()


@pytest.mark.parametrize("dtype", ["auto", np.int64])
def test_ragged_rows_flattened_are_concatenated(dtype):
    out = _ragged().to_training(dtype=dtype, flatten=True, return_labels=True,
                                return_cu_seqlens=True)
    assert as_list(out["input_ids"]) == [1, 2, 4, 5, 6, 7]
    assert as_list(out["labels"]) == [2, 3, 5, 6, 7, 8]
    assert as_list(out["positions"]) == [0, 1, 0, 1, 0, 1]
    assert as_list(out["cu_seqlens"]) == [0, 2, 4, 6]
    assert out["max_seqlen"] == 2
    if dtype == "auto":
        check_tensor(out["input_ids"], [1, 2, 4, 5, 6, 7])
    else:
        check_array(out["input_ids"], [1, 2, 4, 5, 6, 7], np.int64)
