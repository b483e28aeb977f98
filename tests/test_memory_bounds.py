"""What the default pipeline keeps alive: bounded by its buffers, not by how rows arrive.

Two holders of memory that grew with the layout of the data rather than with
what the pipeline was asked to keep:

* a lane's shuffle reservoir refers to rows where they arrived (blocks of
  packed rows); a block with one row left in the reservoir kept all of its
  rows, so a lane's share of 128 rows fed blocks of a few dozen rows kept
  thousands alive. It now keeps at most about twice its size;
* the Parquet reader kept one decoded row group per shard, so two reads
  going on in two row groups of one shard (chunks fetched side by side by
  threads) evicted each other's group and decoded it again.

Neither changes a byte of the output: the block and record paths of the
shuffle still decide alike (``test_ops_shuffle.py``), and these tests check
the output too.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from corpus import write_token_parquet

from zephon_torch.block import Block
from zephon_torch.block_columns import Ragged
from zephon_torch.ops.shuffle import ReservoirShuffleAccumulator
from zephon_torch.pipeline import Pipeline
from zephon_torch.sources.datasets import ParquetDataset
from zephon_torch.types import SampleMeta, SampleRecord

ROW_TOKENS = 2048  # 8 KiB of int32 per row


def _rows(start: int, n: int) -> Block:
    """``n`` rows of ``ROW_TOKENS`` tokens each, as one columnar block (packed rows are)."""
    ids = np.arange(start, start + n)
    values = np.repeat(ids.astype(np.int32), ROW_TOKENS)
    block = Block.from_records([
        SampleRecord(SampleMeta((0, 0, int(i)), 0, int(i) // 64, int(i) % 64, {0: 1}, None, ()),
                     {"input_ids": values[:0]}) for i in ids])
    offsets = np.arange(n + 1, dtype=np.int64) * ROW_TOKENS
    return block.with_fields({"input_ids": Ragged(values, offsets)})


@pytest.mark.parametrize(("size", "rows_per_block"), [(8, 40), (128, 36), (64, 64)])
def test_a_reservoir_keeps_about_twice_its_size_alive_whatever_the_blocks(
        size: int, rows_per_block: int) -> None:
    acc = ReservoirShuffleAccumulator(size, seed=3)
    row_bytes = ROW_TOKENS * 4
    warm = ReservoirShuffleAccumulator(size, seed=3)  # lazy imports happen before the count
    for k in range(3):
        warm.push_block(_rows(k * rows_per_block, rows_per_block))
    warm.flush()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peak_alive = 0
        out_rows = 0
        for k in range(60):
            evicted = acc.push_block(_rows(k * rows_per_block, rows_per_block))
            out_rows += sum(len(b) for b in evicted)
            del evicted  # the consumer takes them: only what the reservoir keeps is left
            peak_alive = max(peak_alive, tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert out_rows == 60 * rows_per_block - size
    # What stays alive between pushes: the held rows' blocks, at most about twice the
    # reservoir's size in rows plus the block that just arrived (and small bookkeeping).
    bound = (2 * size + rows_per_block) * row_bytes
    assert peak_alive <= bound + 256 * 1024, (peak_alive / row_bytes, bound / row_bytes)


def test_a_compacting_reservoir_evicts_and_drains_the_same_rows_as_records() -> None:
    size, rows_per_block = 8, 40
    blocks, records = ReservoirShuffleAccumulator(size, seed=9), \
        ReservoirShuffleAccumulator(size, seed=9)
    got: list[Any] = []
    want: list[Any] = []
    for k in range(30):
        block = _rows(k * rows_per_block, rows_per_block)
        got += [(r.meta.sample_id, int(r.payload["input_ids"][0])) for b in
                blocks.push_block(block) for r in b.records()]
        want += [(r.meta.sample_id, int(r.payload["input_ids"][0])) for mb in
                 records.push_many(block.records()) for r in mb]
    got += [(r.meta.sample_id, int(r.payload["input_ids"][0]))
            for b in blocks.flush() for r in b.records()]
    want += [(r.meta.sample_id, int(r.payload["input_ids"][0]))
             for mb in records.flush() for r in mb]
    assert got == want and len(got) == 30 * rows_per_block
    assert all(sid[2] == first for sid, first in got)  # each row kept its own tokens


class CountingParquet(ParquetDataset):
    """Counts the decodes of each row group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decodes: Counter[tuple[int, int]] = Counter()

    def _read_row_group(self, shard_id: int, row_group: int) -> Any:
        self.decodes[(shard_id, row_group)] += 1
        return super()._read_row_group(shard_id, row_group)


@pytest.fixture(scope="module")
def five_groups(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two Parquet shards of 200 documents in row groups of 40 (5 groups each)."""
    root = tmp_path_factory.mktemp("five_groups")
    return [str(write_token_parquet(root / f"part-{i}.parquet", 200, seed=70 + i,
                                    rows_per_group=40)) for i in range(2)]


def test_reads_going_on_in_two_row_groups_of_one_shard_decode_each_once(
        five_groups: list[str]) -> None:
    # Chunks fetched side by side (threads, several lanes) read halves of two row
    # groups of one shard in turn: each group is decoded once, and the rows are
    # those read alone.
    ds = CountingParquet(five_groups[:1])
    plain = ParquetDataset(five_groups[:1])
    order = [range(0, 20), range(40, 60), range(20, 40), range(60, 80)]
    for ids in order:
        got = ds.read(0, list(ids))
        want = plain.read(0, list(ids))
        assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, want))
    assert ds.decodes == {(0, 0): 1, (0, 1): 1}
    # Spent groups are let go: nothing of them stays cached.
    assert len(ds._groups) == 0


def test_the_default_pipeline_under_threads_reads_each_byte_once(
        five_groups: list[str], tmp_path: Path) -> None:
    # The default source (8 lanes, shuffled) under iter()'s default runner: many
    # chunks in flight at once, from row groups of the same shards.
    ds = CountingParquet(five_groups)
    pipe = (Pipeline.from_sources([ds], chunk_size=20)
            .fetch().pack_flat(128).shuffle(64, seed=1).batch(4, drop_last=False))
    it = pipe.iter(runner="threads", num_workers=2, microbatch_sizes={"fetch": 20})
    out = [r.meta.sample_id for b in it for r in b.records]
    stats = it.stats()
    assert stats["bytes_read"] == stats["sample_bytes"]
    assert set(ds.decodes.values()) == {1} and len(ds.decodes) == 10
    inline = pipe.iter(runner="inline")
    assert [r.meta.sample_id for b in inline for r in b.records] == out
