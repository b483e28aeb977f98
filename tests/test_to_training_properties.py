"""Property tests for ``SampleBatch.to_training`` on random packed rows.

Each row is a ``pack_flat``-style record: segments whose positions restart at
zero, then trailing padding (its own segment, also restarting at zero) whose
length is recorded in ``meta.padding_length``, and optionally a random
``loss_mask``. Expected values are computed here in plain Python from the
reference page's rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.types import PACKING_METADATA_TAG, SampleBatch, SampleMeta, SampleRecord

IGNORE = -100
SETTINGS = settings(max_examples=60, deadline=None)


@dataclass
class Row:
    tokens: list[int]
    positions: list[int]
    mask: list[int]
    padding: int
    segments: list[int]  # segment lengths, padding segment last


@dataclass
class Packed:
    rows: list[Row]
    with_mask: bool
    eos: int | None

    @property
    def batch(self) -> SampleBatch:
        records = []
        for i, row in enumerate(self.rows):
            payload: dict[str, Any] = {
                "input_ids": np.array(row.tokens, dtype=np.int32),
                "positions": np.array(row.positions, dtype=np.int32),
                "text": f"row{i}",
            }
            if self.with_mask:
                payload["loss_mask"] = np.array(row.mask, dtype=np.int32)
            tags = {PACKING_METADATA_TAG: {"padding_length": row.padding}}
            meta = SampleMeta(sample_id=(0, 0, i), lane_id=0, chunk_id=0, chunk_offset=i,
                              tags=tags)
            records.append(SampleRecord(meta, payload))
        return SampleBatch(records)

    def kwargs(self, return_labels: bool = True) -> dict[str, Any]:
        kw: dict[str, Any] = dict(return_labels=return_labels, return_cu_seqlens=True,
                                  return_padding_mask=True)
        if return_labels:
            kw.update(return_loss_mask=True, return_num_valid_tokens=True)
            if self.eos is not None:
                kw.update(eos_mask_loss=True, eos_token_id=self.eos)
        return kw


@st.composite
def packed(draw: st.DrawFn) -> Packed:
    seq_len = draw(st.integers(2, 12))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        padding = draw(st.integers(0, seq_len))
        real = seq_len - padding
        segments: list[int] = []
        if real:
            cuts = sorted(draw(st.sets(st.integers(1, real - 1), max_size=real - 1))
                          if real > 1 else set())
            bounds = [0, *cuts, real]
            segments = [b - a for a, b in pairwise(bounds)]
        if padding:
            segments.append(padding)
        positions = [p for n in segments for p in range(n)]
        tokens = draw(st.lists(st.integers(0, 20), min_size=seq_len, max_size=seq_len))
        mask = draw(st.lists(st.integers(0, 1), min_size=seq_len, max_size=seq_len))
        rows.append(Row(tokens, positions, mask, padding, segments))
    with_mask = draw(st.booleans())
    eos = draw(st.none() | st.integers(0, 20))
    return Packed(rows, with_mask, eos)


def as_list(x: Any) -> Any:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [as_list(v) for v in x]
    return x


def expected_labels(p: Packed, row: Row) -> list[int]:
    n = len(row.tokens)
    out = []
    for j in range(n - 1):
        ignored = (
            (p.with_mask and row.mask[j + 1] == 0)
            or j + 1 >= n - row.padding
            or (p.eos is not None and row.tokens[j] == p.eos)
        )
        out.append(IGNORE if ignored else row.tokens[j + 1])
    return out


def row_boundaries(positions: list[int]) -> list[int]:
    return [k for k, pos in enumerate(positions) if pos == 0] + [len(positions)]


# --------------------------------------------------------------------------- properties


@SETTINGS
@given(p=packed(), return_labels=st.booleans())
def test_cu_seqlens_agree_with_positions(p, return_labels):
    b = p.batch
    rows_out = b.to_training(**p.kwargs(return_labels))
    flat_out = b.to_training(flatten=True, **p.kwargs(return_labels))
    cut = 1 if return_labels else 0

    per_row = []
    for row in p.rows:
        inp_pos = row.positions[: len(row.positions) - cut]
        bounds = row_boundaries(inp_pos)
        segs = list(row.segments)
        if cut:
            segs[-1] -= 1
            if segs[-1] == 0:
                segs.pop()
        assert [b1 - b0 for b0, b1 in pairwise(bounds)] == segs
        per_row.append(bounds)

    width = max(len(bounds) for bounds in per_row)
    padded = [bounds + [bounds[-1]] * (width - len(bounds)) for bounds in per_row]
    maxima = [max(b1 - b0 for b0, b1 in pairwise(bounds)) for bounds in per_row]
    assert as_list(rows_out["cu_seqlens"]) == padded
    assert as_list(rows_out["max_seqlen"]) == maxima
    assert rows_out["cu_seqlens"].dtype == torch.int32
    assert rows_out["max_seqlen"].dtype == torch.int32

    # Flat: the row-wise boundaries offset by each row's start, without repeats.
    flat_expected = [0]
    start = 0
    for bounds in per_row:
        flat_expected.extend(start + x for x in bounds[1:])
        start += bounds[-1]
    assert as_list(flat_out["cu_seqlens"]) == flat_expected
    assert flat_expected[-1] == sum(len(r.tokens) - cut for r in p.rows)
    assert flat_out["cu_seqlens"].dtype == torch.int32
    assert flat_out["max_seqlen"] == max(maxima)
    assert type(flat_out["max_seqlen"]) is int


@SETTINGS
@given(p=packed())
def test_labels_loss_mask_and_valid_count(p):
    out = p.batch.to_training(**p.kwargs())
    labels = [expected_labels(p, row) for row in p.rows]
    assert out["labels"].tolist() == labels
    assert out["input_ids"].tolist() == [row.tokens[:-1] for row in p.rows]
    expected_mask = [[0.0 if x == IGNORE else 1.0 for x in r] for r in labels]
    assert out["loss_mask"].dtype == torch.float32
    assert out["loss_mask"].tolist() == expected_mask
    assert out["num_valid_tokens"] == int(out["loss_mask"].sum().item())
    assert out["num_valid_tokens"] == sum(x != IGNORE for r in labels for x in r)
    assert type(out["num_valid_tokens"]) is int
    n = len(p.rows[0].tokens)
    assert out["padding_mask"].tolist() == [
        [k >= n - row.padding for k in range(n - 1)] for row in p.rows
    ]
    assert out["positions"].tolist() == [row.positions[:-1] for row in p.rows]


@SETTINGS
@given(p=packed(), return_labels=st.booleans(), sequence=st.booleans())
def test_flatten_equals_reshape(p, return_labels, sequence):
    b = p.batch
    mode = "sequence" if sequence else "preserve"
    rows_out = b.to_training(position_mode=mode, **p.kwargs(return_labels))
    flat_out = b.to_training(position_mode=mode, flatten=True, **p.kwargs(return_labels))
    keys = ["input_ids", "positions", "padding_mask"]
    if return_labels:
        keys += ["labels", "loss_mask"]
        assert flat_out["num_valid_tokens"] == rows_out["num_valid_tokens"]
    elif p.with_mask:
        keys.append("loss_mask")  # the raw payload mask
    for key in keys:
        assert flat_out[key].dtype == rows_out[key].dtype, key
        assert flat_out[key].dim() == 1, key
        assert flat_out[key].tolist() == rows_out[key].reshape(-1).tolist(), key
    assert flat_out["ids"] == rows_out["ids"] == [(0, 0, i) for i in range(len(p.rows))]
    assert flat_out["texts"] == rows_out["texts"] == [f"row{i}" for i in range(len(p.rows))]
    if sequence:
        width = len(p.rows[0].tokens) - (1 if return_labels else 0)
        assert rows_out["positions"].tolist() == [list(range(width))] * len(p.rows)


@SETTINGS
@given(p=packed(), data=st.data())
def test_rename_then_exclude(p, data):
    b = p.batch
    base = b.to_training(**p.kwargs())
    keys = sorted(base)
    sources = data.draw(st.lists(st.sampled_from(keys), unique=True), label="sources")
    fresh = [f"new_{i}" for i in range(len(sources))]
    targets = data.draw(st.permutations(sources + fresh), label="targets")[: len(sources)]
    mapping = dict(zip(sources, targets))
    excludes = data.draw(
        st.lists(st.sampled_from([*keys, *fresh, "absent"]), unique=True), label="excludes"
    )
    out = b.to_training(rename_fields=mapping, exclude_fields=excludes, **p.kwargs())

    renamed = {mapping.get(k, k): v for k, v in base.items()}
    expected = {k: v for k, v in renamed.items() if k not in excludes}
    assert set(out) == set(expected)
    for key, value in expected.items():
        assert as_list(out[key]) == as_list(value), key

    # Documented special cases: excluding the new name drops the field,
    # excluding only the old name of a renamed key drops nothing.
    src = data.draw(st.sampled_from(keys), label="src")
    gone = b.to_training(rename_fields={src: "renamed"}, exclude_fields=["renamed"],
                         **p.kwargs())
    assert set(gone) == set(keys) - {src}
    kept = b.to_training(rename_fields={src: "renamed"}, exclude_fields=[src], **p.kwargs())
    assert set(kept) == (set(keys) - {src}) | {"renamed"}
    assert as_list(kept["renamed"]) == as_list(base[src])


@SETTINGS
@given(p=packed(), return_labels=st.booleans(), flatten=st.booleans(),
       sequence=st.booleans())
def test_same_results_across_dtypes(p, return_labels, flatten, sequence):
    b = p.batch
    kw = dict(flatten=flatten, position_mode="sequence" if sequence else "preserve",
              **p.kwargs(return_labels))
    outs = {name: b.to_training(dtype=dtype, **kw)
            for name, dtype in (("auto", "auto"), ("none", None), ("numpy", np.int64))}
    reference = outs["auto"]
    for name, out in outs.items():
        assert set(out) == set(reference), name
        for key in reference:
            assert as_list(out[key]) == as_list(reference[key]), (name, key)
    assert isinstance(outs["auto"]["input_ids"], torch.Tensor)
    assert isinstance(outs["numpy"]["input_ids"], np.ndarray)
    assert type(outs["none"]["input_ids"]) is list
