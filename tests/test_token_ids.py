"""Token ids are never wrapped: exact end to end, or a clear error naming the value and sample.

``pack_flat`` writes int32 rows, so an id of ``2**31`` or more (or a negative
one) is refused, naming the sample, its file and row; ``pack_sequences`` keeps
each document's own array (int64 stays int64) and refuses negative ids only;
``to_training`` keeps int64 under ``dtype="auto"`` and refuses an id that an
explicitly narrower output dtype cannot hold. Negative ids are a packer error
(no vocabulary has one; -100 is the labels' ignore index) and pass through
``to_training`` untouched, as the reference implementation does.

The module runs once with the compiled kernels and once with their numpy
twins (``ZEPHON_NATIVE``), the way a user switches them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import zephon_torch as zt
from zephon_torch.block import Block
from zephon_torch.block_views import BlockBatch
from zephon_torch.ops._binpack import native_available
from zephon_torch.ops.pack_engine import PackFlatAccumulator, PackSequencesAccumulator
from zephon_torch.types import SampleBatch, SampleMeta, SampleRecord


@pytest.fixture(scope="module", params=["native", "twin"], autouse=True)
def kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "native":
        if os.environ.get("ZEPHON_NATIVE", "").strip().lower() in ("0", "false", "no", "off"):
            pytest.skip("the compiled kernels are disabled by ZEPHON_NATIVE")
        if not native_available():
            pytest.skip("the compiled kernels are not built")
    from zephon_torch import _training_native

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZEPHON_NATIVE", "1" if request.param == "native" else "0")
        patch.setattr(_training_native, "_enabled", None)  # decided again from the variable
        yield request.param


DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def _docs(bad: int, at: int = 1) -> list[np.ndarray]:
    """Three int64 documents; document ``at`` holds ``bad`` at position 1."""
    docs = [np.array(d, dtype=np.int64) for d in DOCS]
    docs[at][1] = bad
    return docs


def _source(kind: str, docs: list[np.ndarray], tmp_path: Path) -> zt.Pipeline:
    if kind == "items":
        return zt.Pipeline.from_items([{"input_ids": d} for d in docs])
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int64()))}), path)
    return zt.Pipeline.from_parquet(str(path), shuffle=False).fetch()


def _run(pipe: zt.Pipeline, **kwargs: Any) -> list[dict[str, Any]]:
    with pipe.iter(runner="inline") as it:
        return [batch.to_training(**kwargs) for batch in it]


@pytest.mark.parametrize("kind", ["items", "parquet"])
@pytest.mark.parametrize("bad", [2**40 + 7, 2**31, 2**63 - 1])
def test_pack_flat_refuses_an_id_its_int32_rows_cannot_hold(kind, bad, tmp_path):
    where = r"items\[1\]" if kind == "items" else "ids.parquet row 1"
    pipe = _source(kind, _docs(bad), tmp_path).pack_flat(16).batch(1, drop_last=False)
    with pytest.raises(ValueError, match=rf"pack_flat: sample \(0, 0, 1\) \(.*{where}\): token "
                                         rf"id {bad} at position 1 is outside 0\.\.2147483647; "
                                         r"pack_flat rows are int32, and a token id is never "
                                         r"wrapped; fix the data"):
        _run(pipe)


@pytest.mark.parametrize("kind", ["items", "parquet"])
@pytest.mark.parametrize("op", ["pack_flat", "pack_sequences"])
def test_the_packers_refuse_negative_ids(kind, op, tmp_path):
    pipe = getattr(_source(kind, _docs(-3, at=2), tmp_path), op)(16).batch(1, drop_last=False)
    with pytest.raises(ValueError, match=rf"{op}: sample \(0, 0, 2\) .*token id -3 at position "
                                         r"1 is .*0.*no vocabulary has a negative id"):
        _run(pipe, dtype=None) if op == "pack_flat" else list(pipe.iter(runner="inline"))


@pytest.mark.parametrize("kind", ["items", "parquet"])
def test_pack_flat_keeps_the_largest_int32_id_and_to_training_widens_it_exactly(kind,
                                                                               tmp_path):
    top = 2**31 - 1
    pipe = _source(kind, _docs(top), tmp_path).pack_flat(16).batch(1, drop_last=False)
    (out,) = _run(pipe)
    assert out["input_ids"].dtype == torch.int64
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, top, 6, 7, 8, 9] + [0] * 7]


@pytest.mark.parametrize("kind", ["items", "parquet"])
def test_pack_sequences_keeps_int64_ids_exact_end_to_end(kind, tmp_path):
    big = 2**40 + 7
    pipe = _source(kind, _docs(big), tmp_path).pack_sequences(16)
    with pipe.iter(runner="inline") as it:
        (row,) = list(it)
    pieces = [p["input_ids"] for p in row.payload["packed_samples"]]
    assert [p.tolist() for p in pieces] == [[1, 2, 3], [4, big], [6, 7, 8, 9]]
    batch = SampleBatch([SampleRecord(row.meta, pieces[1])])
    assert batch.to_training()["input_ids"].tolist() == [[4, big]]


@pytest.mark.parametrize("tokens", [[1, 2**40 + 7], np.array([1, 2**40 + 7]),
                                    torch.tensor([1, 2**40 + 7])],
                         ids=["list", "numpy", "tensor"])
@pytest.mark.parametrize("acc_type", [PackFlatAccumulator, PackSequencesAccumulator])
def test_the_record_path_checks_lists_and_tensors_too(tokens, acc_type):
    # Lists and tensors take the packers' general path (no ragged column).
    acc = acc_type(8)
    record = SampleRecord(SampleMeta((0, 0, 5), 0, 0, 5), {"input_ids": tokens})
    if acc_type is PackSequencesAccumulator:  # keeps the document's own ids
        out = [r for group in acc.push_many([record]) + acc.flush() for r in group]
        assert out[0].payload["packed_samples"][0]["input_ids"] is tokens
        return
    with pytest.raises(ValueError, match=r"pack_flat: sample \(0, 0, 5\): token id "
                                         r"1099511627783 at position 1"):
        acc.push_many([record])


def _records(rows: list[Any]) -> SampleBatch:
    return SampleBatch([SampleRecord(SampleMeta((0, 0, i), 0, 0, i), {"input_ids": r})
                        for i, r in enumerate(rows)])


def _block_batch(rows: list[list[int]]) -> BlockBatch:
    """A pipeline's batch of rows of one length: ``[B, S]`` columns (the kernel's case)."""
    ids = np.zeros((len(rows), 5), dtype=np.int64)
    ids[:, 2] = np.arange(len(rows))
    block = Block(0, ids, fields={"input_ids": np.array(rows, dtype=np.int64)},
                  component=np.zeros(len(rows), dtype=np.int64),
                  packing=[{"padding_length": 0}] * len(rows))
    return BlockBatch(block)


@pytest.mark.parametrize("make", ["records", "block"])
@pytest.mark.parametrize("dtype", [torch.int32, np.int32, "int32"])
@pytest.mark.parametrize("return_labels", [False, True])
def test_to_training_refuses_an_id_an_explicit_int32_output_cannot_hold(make, dtype,
                                                                       return_labels):
    rows = [[1, 2, 3], [4, 2**31, 6]]
    batch = (_records([np.array(r, dtype=np.int64) for r in rows]) if make == "records"
             else _block_batch(rows))
    with pytest.raises(ValueError, match=r"to_training: record \(0, 0, 1\): token id "
                                         r"2147483648 at position 1 is outside "
                                         r"-2147483648\.\.2147483647; the output dtype int32 "
                                         r"cannot hold it, and a token id is never wrapped"):
        batch.to_training(dtype=dtype, return_labels=return_labels)
    # "auto" is int64: the ids come out exact.
    assert batch.to_training()["input_ids"].tolist() == rows


def test_to_training_refuses_uint64_ids_beyond_int64():
    batch = _records([np.array([1, 2**63 + 5], dtype=np.uint64)])
    with pytest.raises(ValueError, match=r"token id 9223372036854775813 at position 1 .*"
                                         r"output dtype int64 cannot hold it"):
        batch.to_training()
    with pytest.raises(ValueError, match=r"token id 9223372036854775813 at position 1"):
        batch.to_training(format="hf")


@pytest.mark.parametrize("make", ["records", "block"])
def test_to_training_passes_negative_ids_through_untouched(make):
    rows = [[1, -5, 3], [4, -100, 6]]
    batch = (_records([np.array(r, dtype=np.int64) for r in rows]) if make == "records"
             else _block_batch(rows))
    assert batch.to_training()["input_ids"].tolist() == rows
    assert batch.to_training(dtype=torch.int32)["input_ids"].tolist() == rows


@pytest.mark.parametrize("bad", [2**31, 2**64 + 3, -7])
def test_list_payloads_are_checked_whatever_the_size_of_the_id(bad):
    # Lists of Python ints take the packers' general path; an id beyond int64 stays a
    # Python int there.
    pipe = (zt.Pipeline.from_items([{"input_ids": [1, 2, 3]}, {"input_ids": [4, bad, 6]}])
            .pack_flat(8).batch(1, drop_last=False))
    with pytest.raises(ValueError, match=rf"pack_flat: sample \(0, 0, 1\) \(items\[1\]\): "
                                         rf"token id {bad} at position 1"):
        _run(pipe)
