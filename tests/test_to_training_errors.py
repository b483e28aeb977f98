"""Every documented error and warning of ``SampleBatch.to_training``.

Each test checks the exception type and that the message names the offending
field or value.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from zephon_torch.types import PACKING_METADATA_TAG, SampleBatch, SampleMeta, SampleRecord


def rec(i: int, payload: Any, padding: int | None = None) -> SampleRecord:
    tags = {} if padding is None else {PACKING_METADATA_TAG: {"padding_length": padding}}
    meta = SampleMeta(sample_id=(0, 0, i), lane_id=0, chunk_id=0, chunk_offset=i, tags=tags)
    return SampleRecord(meta, payload)


def batch(*payloads: Any, paddings: list[int | None] | None = None) -> SampleBatch:
    paddings = [None] * len(payloads) if paddings is None else paddings
    return SampleBatch([rec(i, p, q) for i, (p, q) in enumerate(zip(payloads, paddings))])


def arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def simple() -> SampleBatch:
    return batch({"input_ids": arr(1, 2, 3, 4)}, {"input_ids": arr(5, 6, 7, 8)})


def positioned(*positions: np.ndarray | None) -> SampleBatch:
    payloads = []
    for i, pos in enumerate(positions):
        payload: dict[str, Any] = {"input_ids": np.arange(10 * i, 10 * i + 4, dtype=np.int32)}
        if pos is not None:
            payload["positions"] = pos
        payloads.append(payload)
    return batch(*payloads)


# --------------------------------------------------------------------------- TypeError


@pytest.mark.parametrize(
    ("payload", "type_name"),
    [(3.5, "float"), ("some text", "str"), (None, "None"), ({1, 2}, "set")],
)
def test_payload_neither_dict_nor_array(payload, type_name):
    b = SampleBatch([rec(0, {"input_ids": arr(1, 2)}), rec(1, payload)])
    with pytest.raises(TypeError, match=rf"(?i)payload|{type_name}"):
        b.to_training()


@pytest.mark.parametrize("array", [arr(4, 5, 6), [4, 5, 6], torch.tensor([4, 5, 6])],
                         ids=["numpy", "list", "tensor"])
@pytest.mark.parametrize("dict_first", [True, False])
def test_a_batch_mixing_dict_and_array_payloads_is_a_type_error(array, dict_first):
    payloads = [{"input_ids": arr(1, 2, 3)}, array]
    b = batch(*(payloads if dict_first else payloads[::-1]))
    with pytest.raises(TypeError, match=r"neither all dicts nor all arrays: record \(0, 0, 0\) "
                                        r"holds a (dict|\w+ \(an array\)) and record \(0, 0, 1\)"):
        b.to_training(dtype=None)


def test_exclude_fields_as_string():
    with pytest.raises(TypeError, match="exclude_fields"):
        simple().to_training(exclude_fields="ids")


# --------------------------------------------------------------------------- tokens_field


def test_tokens_field_not_detectable():
    b = batch({"foo": arr(1, 2, 3)}, {"foo": arr(4, 5, 6)})
    with pytest.raises(ValueError, match=r"tokens_field|input_ids"):
        b.to_training()


def test_tokens_field_explicit_missing():
    with pytest.raises(ValueError, match="my_tokens"):
        simple().to_training(tokens_field="my_tokens")


# --------------------------------------------------------------------------- loss_mask


@pytest.mark.parametrize("return_labels", [True, False])
def test_loss_mask_in_only_some_payloads(return_labels):
    b = batch({"input_ids": arr(1, 2, 3), "loss_mask": arr(1, 1, 0)},
              {"input_ids": arr(4, 5, 6)})
    with pytest.raises(ValueError, match="loss_mask"):
        b.to_training(return_labels=return_labels)


@pytest.mark.parametrize("return_labels", [True, False])
@pytest.mark.parametrize("mask", [(1, 1), (1, 1, 1, 1)], ids=["short", "long"])
def test_loss_mask_misaligned_with_tokens(return_labels, mask):
    b = batch({"input_ids": arr(1, 2, 3), "loss_mask": arr(*mask)},
              {"input_ids": arr(4, 5, 6), "loss_mask": arr(*mask)})
    with pytest.raises(ValueError, match="loss_mask"):
        b.to_training(return_labels=return_labels, dtype=None)


def test_loss_mask_in_extra_fields_with_labels():
    b = batch({"input_ids": arr(1, 2, 3), "loss_mask": arr(1, 1, 0)})
    with pytest.raises(ValueError, match="loss_mask"):
        b.to_training(return_labels=True, extra_fields=["loss_mask"])


# --------------------------------------------------------------------------- rename / extras


def test_rename_missing_source_in_nonempty_batch():
    with pytest.raises(ValueError, match="labels"):
        simple().to_training(rename_fields={"labels": "target"})


def test_rename_collision_with_existing_output():
    with pytest.raises(ValueError, match="labels"):
        simple().to_training(return_labels=True, rename_fields={"input_ids": "labels"})


def test_rename_collision_between_targets():
    with pytest.raises(ValueError, match="tgt"):
        simple().to_training(return_labels=True,
                             rename_fields={"input_ids": "tgt", "labels": "tgt"})


def test_num_valid_tokens_without_labels():
    with pytest.raises(ValueError, match=r"num_valid_tokens"):
        simple().to_training(return_num_valid_tokens=True)


def test_loss_mask_without_labels():
    with pytest.raises(ValueError, match=r"loss_mask"):
        simple().to_training(return_loss_mask=True)


@pytest.mark.parametrize("field", ["labels", "input_ids", "ids"])
def test_extra_field_overwriting_generated_output(field):
    b = batch({"input_ids": arr(1, 2, 3), "labels": arr(7, 7, 7), "ids": arr(8, 8, 8)})
    with pytest.raises(ValueError, match=field):
        b.to_training(return_labels=True, extra_fields=[field])


# Each output name with the options under which this call generates it.
_GENERATING = [
    ("ids", {}, "always generated"),
    ("texts", {}, "always generated"),
    ("input_ids", {}, "always generated"),
    ("labels", {"return_labels": True}, "return_labels=True"),
    ("num_valid_tokens", {"return_labels": True, "return_num_valid_tokens": True},
     "return_num_valid_tokens=True"),
    ("cu_seqlens", {"return_cu_seqlens": True}, "return_cu_seqlens=True"),
    ("max_seqlen", {"return_cu_seqlens": True}, "return_cu_seqlens=True"),
    ("padding_mask", {"return_padding_mask": True}, "return_padding_mask=True"),
]


def _with_field(name: str) -> SampleBatch:
    """Two rows of four tokens whose payloads also carry ``name`` (and positions)."""
    return batch(*({"input_ids": arr(1, 2, 3, 4) + 10 * i, "positions": arr(0, 1, 0, 1),
                    name: arr(5, 6, 7, 8) + 10 * i} for i in range(2)))


@pytest.mark.parametrize("empty", [False, True])
@pytest.mark.parametrize(("field", "kwargs", "why"), _GENERATING, ids=[g[0] for g in _GENERATING])
def test_an_extra_field_may_not_overwrite_an_output_this_call_generates(field, kwargs, why,
                                                                        empty):
    b = SampleBatch([]) if empty else _with_field(field)
    with pytest.raises(ValueError, match=rf"extra field '{field}' would overwrite the generated "
                                         rf"output field '{field}' \(.*{why}"):
        b.to_training(extra_fields=(field,), **kwargs)


@pytest.mark.parametrize("payload_positions", [True, False])
@pytest.mark.parametrize("return_labels", [False, True])
@pytest.mark.parametrize("dtype", ["auto", None])
def test_positions_listed_with_position_mode_sequence_come_out_once_per_row(
        payload_positions, return_labels, dtype):
    # The reference accepts this: the field is not duplicated and the positions are the
    # generated per-row numbering, not the payload's.
    rows = [{"input_ids": arr(1, 2, 3, 4) + 10 * i} for i in range(2)]
    if payload_positions:
        for row in rows:
            row["positions"] = arr(0, 1, 0, 1)
    out = batch(*rows).to_training(extra_fields=("positions",), position_mode="sequence",
                                   return_labels=return_labels, dtype=dtype)
    width = 3 if return_labels else 4
    positions = out["positions"] if dtype is None else out["positions"].tolist()
    assert positions == [list(range(width))] * 2
    assert list(out).count("positions") == 1
    assert set(out) == {"ids", "texts", "input_ids", "positions",
                        *(("labels",) if return_labels else ())}


def test_positions_listed_with_position_mode_sequence_on_an_empty_batch():
    out = SampleBatch([]).to_training(extra_fields=("positions",), position_mode="sequence")
    assert out == {"ids": [], "texts": [], "positions": []}


@pytest.mark.parametrize(
    ("field", "return_labels"),
    [("labels", False), *((name, labels) for name in
                          ("num_valid_tokens", "cu_seqlens", "max_seqlen", "padding_mask")
                          for labels in (False, True))],
)
def test_an_extra_field_named_like_an_output_this_call_does_not_generate_is_stacked(
        field, return_labels):
    out = _with_field(field).to_training(extra_fields=(field,), return_labels=return_labels,
                                         dtype=None)
    # Sliced like input_ids when labels are made.
    expected = [[5, 6, 7, 8], [15, 16, 17, 18]]
    assert out[field] == ([row[:-1] for row in expected] if return_labels else expected)
    assert out["input_ids"] == ([[1, 2, 3], [11, 12, 13]] if return_labels
                                else [[1, 2, 3, 4], [11, 12, 13, 14]])


def test_positions_listed_in_extra_fields_in_preserve_mode_are_the_payload_positions():
    out = _with_field("x").to_training(extra_fields=("positions",), dtype=None)
    assert out["positions"] == [[0, 1, 0, 1], [0, 1, 0, 1]]


# --------------------------------------------------------------------------- padding mask


@pytest.mark.parametrize("padding", [-1, 5, 100])
@pytest.mark.parametrize("return_labels", [True, False])
def test_padding_length_outside_row(padding, return_labels):
    b = batch({"input_ids": arr(1, 2, 3, 4)}, {"input_ids": arr(5, 6, 7, 8)},
              paddings=[0, padding])
    with pytest.raises(ValueError, match=r"padding"):
        b.to_training(return_padding_mask=True, return_labels=return_labels)


def test_padding_mask_requires_2d_tokens_for_tensor_output():
    tokens = np.arange(8, dtype=np.int32).reshape(4, 2)  # per-token vectors: [B, S, 2]
    b = batch({"input_ids": tokens}, {"input_ids": tokens + 10})
    with pytest.raises(ValueError, match=r"(?i)padding|2-?D|1-?D|dim|shape"):
        b.to_training(return_padding_mask=True)


# --------------------------------------------------------------------------- cu_seqlens


@pytest.mark.parametrize("return_labels", [True, False])
def test_cu_seqlens_positions_missing_everywhere(return_labels):
    with pytest.raises(ValueError, match="positions"):
        simple().to_training(return_cu_seqlens=True, return_labels=return_labels)


def test_cu_seqlens_positions_missing_in_one_payload():
    b = positioned(arr(0, 1, 2, 3), None)
    with pytest.raises(ValueError, match="positions"):
        b.to_training(return_cu_seqlens=True)


def test_cu_seqlens_positions_still_required_in_sequence_mode():
    with pytest.raises(ValueError, match="positions"):
        simple().to_training(return_cu_seqlens=True, position_mode="sequence")


@pytest.mark.parametrize("bad", [arr(0, 1, 2), arr(0, 1, 2, 3, 4)], ids=["short", "long"])
def test_cu_seqlens_positions_misaligned(bad):
    b = positioned(arr(0, 1, 2, 3), bad)
    with pytest.raises(ValueError, match="positions"):
        b.to_training(return_cu_seqlens=True, dtype=None)


@pytest.mark.parametrize("shape", [(4, 1), (4, 2), (1, 4)])
@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("positions", {}),  # forwarded ("preserve")
        ("positions", {"return_cu_seqlens": True}),
        ("positions", {"return_cu_seqlens": True, "position_mode": "sequence"}),
        ("positions", {"return_labels": True, "return_cu_seqlens": True, "flatten": True}),
        ("loss_mask", {}),  # surfaced raw
        ("loss_mask", {"return_labels": True}),  # applied to the labels
    ],
)
def test_positions_or_loss_mask_of_the_wrong_shape_name_the_expected_shape(field, kwargs,
                                                                           shape):
    values = np.zeros(shape, dtype=np.int32)
    b = batch({"input_ids": arr(1, 2, 3, 4), field: values},
              {"input_ids": arr(5, 6, 7, 8), field: values})
    with pytest.raises(ValueError, match=rf"record \(0, 0, 0\): field '{field}' has shape "
                                         rf"\({shape[0]}, {shape[1]}\), misaligned with the token "
                                         r"field 'input_ids' .* must have shape \(4,\)"):
        b.to_training(**kwargs)


@pytest.mark.parametrize("return_labels", [True, False])
@pytest.mark.parametrize("flatten", [True, False])
def test_cu_seqlens_positions_not_starting_at_zero(return_labels, flatten):
    b = positioned(arr(0, 1, 2, 3), arr(1, 2, 0, 1))
    with pytest.raises(ValueError, match="positions"):
        b.to_training(return_cu_seqlens=True, return_labels=return_labels, flatten=flatten)


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("mode", ["bogus", "continuous", ""])
def test_unknown_position_mode(mode):
    with pytest.raises(ValueError, match=rf"position_mode|'{mode}'"):
        simple().to_training(position_mode=mode)


@pytest.mark.parametrize("eos", [-1, 2.5, "2"])
@pytest.mark.parametrize("eos_mask_loss", [True, False])
def test_eos_token_id_not_a_nonnegative_integer(eos, eos_mask_loss):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ValueError, match="eos_token_id"):
            simple().to_training(return_labels=True, eos_mask_loss=eos_mask_loss,
                                 eos_token_id=eos)


def test_eos_mask_loss_without_labels():
    with pytest.raises(ValueError, match=r"eos_mask_loss|return_labels"):
        simple().to_training(eos_mask_loss=True, eos_token_id=2)


def test_eos_mask_loss_without_eos_token_id():
    with pytest.raises(ValueError, match="eos_token_id"):
        simple().to_training(return_labels=True, eos_mask_loss=True)


# --------------------------------------------------------------------------- warnings


@pytest.mark.parametrize("return_labels", [True, False])
def test_eos_token_id_without_masking_warns(return_labels):
    with pytest.warns(UserWarning, match="eos_token_id"):
        out = simple().to_training(return_labels=return_labels, eos_token_id=2)
    # Supplying the id alone does not enable masking.
    assert out["input_ids"].tolist() == (
        [[1, 2, 3], [5, 6, 7]] if return_labels else [[1, 2, 3, 4], [5, 6, 7, 8]]
    )
    if return_labels:
        assert out["labels"].tolist() == [[2, 3, 4], [6, 7, 8]]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"return_labels": True},
        {"return_labels": True, "eos_mask_loss": True, "eos_token_id": 2},
        {"return_labels": True, "eos_mask_loss": True, "eos_token_id": 0},
    ],
)
def test_no_warning_otherwise(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = simple().to_training(**kwargs)
    assert isinstance(out["input_ids"], torch.Tensor)
    if kwargs.get("eos_mask_loss"):
        eos = kwargs["eos_token_id"]
        expected = [[2, 3, 4], [6, 7, 8]] if eos == 0 else [[2, -100, 4], [6, 7, 8]]
        assert out["labels"].tolist() == expected


# --------------------------------------------------------------------------- empty batches


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"exclude_fields": "ids"}, TypeError, "exclude_fields"),
        ({"return_num_valid_tokens": True}, ValueError, "num_valid_tokens"),
        ({"return_loss_mask": True}, ValueError, "loss_mask"),
        ({"position_mode": "bogus"}, ValueError, "position_mode|bogus"),
        ({"return_labels": True, "eos_mask_loss": True}, ValueError, "eos_token_id"),
        ({"eos_mask_loss": True, "eos_token_id": 2}, ValueError, "eos_mask_loss|return_labels"),
        ({"return_labels": True, "eos_token_id": -3, "eos_mask_loss": True}, ValueError,
         "eos_token_id"),
        ({"rename_fields": {"ids": "texts"}}, ValueError, "texts"),
    ],
)
def test_option_errors_also_for_empty_batches(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        SampleBatch([]).to_training(**kwargs)


def test_eos_token_id_warns_for_empty_batches():
    with pytest.warns(UserWarning, match="eos_token_id"):
        out = SampleBatch([]).to_training(eos_token_id=2)
    assert out == {"ids": [], "texts": []}


# --------------------------------------------------------------------------- no quiet casts
# Each of these was once accepted and quietly turned into something else.


@pytest.mark.parametrize(
    ("values", "dtype_name"),
    [(np.array([0, 0.5, 1.7, 2.2]), "float64"),  # were truncated to [0, 0, 1, 2]
     (np.array([0.0, 1.0, 2.0, 3.0], dtype=np.float32), "float32"),  # whole, still floats
     ([0, 0.5, 1.7, 2.2], "float64"),
     (np.array([True, False, True, True]), "bool"),  # were read as 1, 0, 1, 1
     (torch.tensor([0.0, 1.0, 2.0, 3.0]), "float32")],
    ids=["float", "whole-floats", "list", "bool", "tensor"],
)
@pytest.mark.parametrize("kwargs", [{}, {"return_cu_seqlens": True},
                                    {"return_labels": True, "return_cu_seqlens": True,
                                     "flatten": True, "dtype": None}],
                         ids=["forwarded", "cu_seqlens", "flat-lists"])
def test_positions_that_are_not_integers_are_refused_not_truncated(values, dtype_name, kwargs):
    b = positioned(arr(0, 1, 2, 3), values)
    with pytest.raises(ValueError, match=rf"record \(0, 0, 1\): field 'positions' holds "
                                         rf"{dtype_name} values \(\[.*\]\); positions must be "
                                         r"integers"):
        b.to_training(**kwargs)


def test_positions_are_not_checked_when_sequence_mode_does_not_read_them():
    b = positioned(arr(0, 1, 2, 3), np.array([0, 0.5, 1.7, 2.2]))
    out = b.to_training(position_mode="sequence", dtype=None)
    assert out["positions"] == [[0, 1, 2, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize("padding", [1.5, 1.0, True, "1"], ids=["float", "whole", "bool", "str"])
@pytest.mark.parametrize("kwargs", [{"return_labels": True}, {"return_padding_mask": True}])
def test_a_padding_length_that_is_not_an_integer_is_refused_not_rounded(padding, kwargs):
    b = batch({"input_ids": arr(1, 2, 3, 4)}, {"input_ids": arr(5, 6, 7, 8)},
              paddings=[0, padding])
    with pytest.raises(ValueError, match=rf"record \(0, 0, 1\): padding_length {padding!r} "
                                         rf"\({type(padding).__name__}\) in its packing "
                                         r"metadata .* is not an integer"):
        b.to_training(**kwargs)


def test_a_numpy_integer_padding_length_counts_like_an_int():
    def labels(pad: Any) -> list[list[int]]:
        b = batch({"input_ids": arr(1, 2, 3, 4)}, {"input_ids": arr(5, 6, 7, 8)},
                  paddings=[0, pad])
        return b.to_training(return_labels=True, dtype=None)["labels"]

    assert labels(np.int64(2)) == labels(2) == [[2, 3, 4], [6, -100, -100]]


@pytest.mark.parametrize("ignore_index", [-100.5, -100.0, True, np.bool_(False), "-100", None],
                         ids=["float", "whole-float", "bool", "numpy-bool", "str", "none"])
@pytest.mark.parametrize("empty", [False, True])
def test_ignore_index_that_is_not_an_int_is_a_type_error(ignore_index, empty):
    b = SampleBatch([]) if empty else batch({"input_ids": arr(1, 2, 3)}, paddings=[1])
    with pytest.raises(TypeError, match=rf"ignore_index must be an int .*, got "
                                        rf"{re.escape(repr(ignore_index))} "
                                        rf"\({type(ignore_index).__name__}\)"):
        b.to_training(return_labels=True, ignore_index=ignore_index)


def test_a_numpy_integer_ignore_index_is_an_int():
    b = batch({"input_ids": arr(1, 2, 3)}, paddings=[1])
    out = b.to_training(return_labels=True, ignore_index=np.int32(-7), dtype=None)
    assert out["labels"] == [[2, -7]]


@pytest.mark.parametrize(
    ("payload", "source"),
    [({"input_ids": np.array([True, False, True])}, "token field 'input_ids'"),
     ({"input_ids": [True, False, True]}, "token field 'input_ids'"),
     ({"input_ids": torch.tensor([True, False, True])}, "token field 'input_ids'"),
     (np.array([True, False, True]), "token array"),
     (torch.tensor([True, False, True]), "token array")],
    ids=["numpy", "list", "tensor", "bare-numpy", "bare-tensor"],
)
def test_bool_token_rows_are_refused_not_read_as_ids_0_and_1(payload, source):
    first = payload if isinstance(payload, dict) else np.array([1, 2, 3])
    b = batch({"input_ids": arr(1, 2, 3)} if isinstance(payload, dict) else first, payload)
    with pytest.raises(ValueError, match=rf"record \(0, 0, 1\): {source} holds bool values "
                                         r"\(\[True, False, True\]\); token ids must be "
                                         r"integers"):
        b.to_training(dtype=None)


@pytest.mark.parametrize("payloads", [[arr(1, 2, 3), arr(4, 5, 6)], [[1, 2, 3], [4, 5, 6]],
                                      [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])]],
                         ids=["numpy", "list", "tensor"])
def test_an_explicit_tokens_field_over_bare_arrays_is_ignored_as_the_reference_does(payloads):
    # A bare array has no fields: it is the token row whatever tokens_field names (the
    # reference implementation's behaviour; the types page does not decide it).
    b = batch(*payloads)
    expected = b.to_training(dtype=None)
    for name in ("input_ids", "tokens", "any_name"):
        assert b.to_training(tokens_field=name, dtype=None) == expected
    assert expected["input_ids"] == [[1, 2, 3], [4, 5, 6]]
    labelled = b.to_training(tokens_field="input_ids", return_labels=True)
    assert labelled["input_ids"].tolist() == [[1, 2], [4, 5]]
    assert labelled["labels"].tolist() == [[2, 3], [5, 6]]


def test_an_explicit_tokens_field_over_mixed_payloads_is_still_the_mixing_type_error():
    b = batch(arr(1, 2, 3), {"input_ids": arr(4, 5, 6)})
    with pytest.raises(TypeError, match="neither all dicts nor all arrays"):
        b.to_training(tokens_field="input_ids")


@pytest.mark.parametrize("option", ["exclude_fields", "extra_fields"])
@pytest.mark.parametrize("value", [None, 5], ids=["none", "int"])
@pytest.mark.parametrize("empty", [False, True])
def test_field_name_options_that_are_not_sequences_are_a_clear_type_error(option, value, empty):
    b = SampleBatch([]) if empty else simple()
    with pytest.raises(TypeError, match=rf"{option} must be a sequence of field names, not "
                                        rf"{value!r} \({type(value).__name__}\); write "
                                        rf"{option}=\(\) for none"):
        b.to_training(**{option: value})


@pytest.mark.parametrize("text", [[5], 5, b"bytes", {"en": "hi"}], ids=["list", "int", "bytes",
                                                                       "dict"])
def test_a_text_that_is_not_a_string_is_refused_not_returned_as_a_text(text):
    b = batch({"input_ids": arr(1, 2, 3), "text": "fine"}, {"input_ids": arr(4, 5, 6),
                                                             "text": text})
    with pytest.raises(ValueError, match=rf"record \(0, 0, 1\): its 'text' field holds a "
                                         rf"{type(text).__name__} \(.*\), not a str; .* "
                                         r"exclude_fields=\('texts',\)"):
        b.to_training()
    # Where texts are not returned, nobody reads them: the batch is fine.
    assert "texts" not in b.to_training(exclude_fields=("texts",))
    renamed = b.to_training(rename_fields={"texts": "raw"}, exclude_fields=("raw",))
    assert "raw" not in renamed and "texts" not in renamed
    with pytest.raises(ValueError, match=r"exclude_fields=\('raw',\)"):
        b.to_training(rename_fields={"texts": "raw"})


def test_texts_are_strings_or_empty_where_a_payload_has_none():
    b = batch({"input_ids": arr(1, 2), "text": "a"}, {"input_ids": arr(3, 4), "text": None},
              {"input_ids": arr(5, 6)}, {"input_ids": arr(7, 8), "text": np.str_("b")})
    assert b.to_training()["texts"] == ["a", "", "", "b"]
    assert batch(arr(1, 2), arr(3, 4)).to_training()["texts"] == ["", ""]
