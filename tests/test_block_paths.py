"""Every built-in block path against its operator's record path.

A stage before ``batch`` runs on blocks when its operator has a block path;
the records a block view then gives must equal, field for field, what the
record path (``process_many``, ``push_many``) gives for the same records, on
any cut of the stream into micro-batches and with tombstones among them.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zephon_torch as zt
from zephon_torch.block import Block, blocks_from_elements
from zephon_torch.ops.base import OpContext, tombstone
from zephon_torch.ops.io import DecodeText, Fetch
from zephon_torch.ops.tokenize import Tokenize
from zephon_torch.ops.transform import Filter, MapTransform
from zephon_torch.types import SampleRecord


def _source_records(pipe: zt.Pipeline) -> list[SampleRecord]:
    """The records the source emits for lane 0 (pointers, raw items...), in order."""
    from zephon_torch.sources.emitter import SourceEmitter
    from zephon_torch.sources.schedule import WorkSchedule

    src = pipe.source
    schedule = WorkSchedule(src.datasets, chunk_size=src.chunk_size, num_lanes=src.num_lanes,
                            seed=src.seed, passes=src.passes, shuffle=src.shuffle)
    emitter = SourceEmitter(schedule, src.datasets, lanes=[0])
    return [r for units in emitter for unit in units if isinstance(unit, Block)
            for r in unit.records()]


def _ctx(pipe: zt.Pipeline) -> OpContext:
    datasets = dict(enumerate(pipe.source.datasets))
    return OpContext(plan={"datasets": datasets})


def _cuts(n: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + int(rng.integers(1, 40))))
    return list(itertools.pairwise(bounds))


def _both(op: Any, records: list[SampleRecord], seed: int = 0) -> None:
    """The op's block path on every micro-batch equals its record path."""
    for a, b in _cuts(len(records), seed):
        part = records[a:b]
        expected = op.process_many(part)
        got = [r for block in blocks_from_elements(part) for r in
               op.process_block(block).records()]
        assert got == expected, f"rows {a}..{b}"


def _with_tombstones(records: list[SampleRecord]) -> list[SampleRecord]:
    return [tombstone(r, "filter") if i % 7 == 3 else r for i, r in enumerate(records)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("blocks")
    rng = np.random.default_rng(3)
    for s in range(2):
        with open(root / f"s{s}.jsonl", "w") as f:
            for i in range(90):
                words = " ".join(f"w{int(x)}" for x in rng.integers(0, 50, rng.integers(0, 30)))
                f.write(json.dumps({"text": words, "id": i}) + "\n")
        rows = [rng.integers(0, 90, rng.integers(1, 40)).astype(np.int32) for _ in range(150)]
        pq.write_table(pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32())),
                                 "tag": [f"t{i}" for i in range(150)]}),
                       root / f"t{s}.parquet", row_group_size=32)
        (root / f"doc{s}.txt").write_text(f"a text file {s}\n")
    return root


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "text_files"])
def test_fetch_reads_blocks_as_it_reads_records(files: Path, kind: str) -> None:
    pattern = {"jsonl": "*.jsonl", "parquet": "*.parquet", "text_files": "*.txt"}[kind]
    source = getattr(zt.Pipeline, f"from_{kind}")(str(files / pattern), num_lanes=1,
                                                 chunk_size=64)
    pipe = source.fetch()
    op = Fetch()
    op.setup(_ctx(pipe))
    records = _source_records(pipe)
    assert records
    _both(op, _with_tombstones(records))


def test_a_parquet_block_is_fetched_as_columns_with_a_ragged_token_column(files: Path) -> None:
    from zephon_torch.block_columns import Ragged

    pipe = zt.Pipeline.from_parquet(str(files / "*.parquet"), num_lanes=1, chunk_size=64).fetch()
    op = Fetch()
    op.setup(_ctx(pipe))
    block = Block.from_records(_source_records(pipe)[:64])
    fetched = op.process_block(block)
    assert fetched.fields is not None and isinstance(fetched.fields["input_ids"], Ragged)
    assert fetched.records() == op.process_many(block.records())


def test_decode_tokenize_map_and_filter_decide_on_blocks_as_on_records(files: Path,
                                                                       tokenizer: Any) -> None:
    pipe = zt.Pipeline.from_jsonl(str(files / "*.jsonl"), num_lanes=1, chunk_size=64).fetch()
    fetch = Fetch()
    fetch.setup(_ctx(pipe))
    raw = fetch.process_many(_source_records(pipe))
    decode = DecodeText()
    decode.setup(_ctx(pipe))
    _both(decode, _with_tombstones(raw), seed=1)
    decoded = decode.process_many(raw)
    for special in ("bos_eos", "eos", "none"):
        tok = Tokenize(tokenizer, special_tokens=special, max_length=12)
        tok.setup(_ctx(pipe))
        _both(tok, _with_tombstones(decoded), seed=2)
    _both(MapTransform(lambda p: None if p["id"] % 5 == 0 else {**p, "n": 1}),
          _with_tombstones(decoded), seed=3)
    _both(Filter(lambda p: p["id"] % 3), _with_tombstones(decoded), seed=4)


def test_tokenize_keeps_dict_payloads_of_other_shapes_per_row(tokenizer: Any) -> None:
    items = [{"text": "a b"}, {"text": "c", "extra": 1}, {"text": ""}, {"text": 5}]
    pipe = zt.Pipeline.from_items(items, num_lanes=1)
    records = _source_records(pipe)
    tok = Tokenize(tokenizer, on_error="skip")
    tok.setup(_ctx(pipe))
    _both(tok, records)


def test_tokenize_chat_decides_on_blocks_as_on_records(tokenizer: Any) -> None:
    from zephon_torch.ops.tokenize_chat import TokenizeChat

    rng = np.random.default_rng(5)
    items: list[Any] = []
    for i in range(120):
        words = [" ".join(f"w{int(x)}" for x in rng.integers(0, 40, rng.integers(0, 9)))
                 for _ in range(int(rng.integers(1, 5)))]
        turns = [{"role": ("user", "assistant")[t % 2], "content": w} for t, w in enumerate(words)]
        items.append({"messages": turns, "id": i})
    items[17] = {"messages": [{"role": "user", "content": "x\ud800"}], "id": 17}
    pipe = zt.Pipeline.from_items(items, num_lanes=1)
    records = _with_tombstones(_source_records(pipe))
    for max_length in (None, 10):
        op = TokenizeChat(tokenizer, on_error="skip", max_length=max_length)
        op.setup(_ctx(pipe))
        _both(op, records, seed=6)
    blocks = blocks_from_elements(records[:40])
    out = TokenizeChat(tokenizer, on_error="skip").process_block(blocks[0])
    assert out.fields is not None and "input_ids" in out.fields  # ids travel as columns
