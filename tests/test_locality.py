"""Reads with locality: a shuffled pass visits each shard block by block.

A shard's read blocks (``Dataset.blocks``: Parquet row groups, ranges of
JSONL lines) come in a seeded order and the samples of a block in a seeded
order, so a decoded row group is read about once per pass, and
``stats()["bytes_read"]`` counts what the readers really read.
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from corpus import documents, write_jsonl, write_token_parquet
from harness import (
    assert_deterministic,
    assert_elastic,
    assert_restores_everywhere,
    collect,
    matrix,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from memsource import MemDataset

from zephon_torch.checkpoint import accept_changed_data
from zephon_torch.pipeline import Pipeline
from zephon_torch.sources.base import Dataset, Shard
from zephon_torch.sources.datasets import JsonlDataset, ParquetDataset
from zephon_torch.sources.handles import RandomAccessFile
from zephon_torch.sources.permute import permute, seed_key
from zephon_torch.sources.schedule import WorkSchedule


def all_pointers(schedule: WorkSchedule) -> list[tuple[int, int, int]]:
    out, state = [], schedule.initial_state()
    while True:
        chunk, state = schedule.chunk(state)
        if chunk is None:
            return out
        out.extend(zip(chunk.dataset_ids.tolist(), chunk.shard_ids.tolist(),
                       chunk.local_ids.tolist()))


class LaidOut(MemDataset):
    """In-memory shards with a given block layout per shard."""

    def __init__(self, sizes: Sequence[int], starts: Sequence[Sequence[int]]) -> None:
        super().__init__(list(range(sum(sizes))), shard_sizes=sizes, access="pointer")
        self.layout = [np.asarray(s, dtype=np.int64) for s in starts]

    def blocks(self, shard_id: int) -> np.ndarray:
        return self.layout[shard_id]


@st.composite
def layouts(draw: Any) -> tuple[list[int], list[list[int]]]:
    sizes = draw(st.lists(st.integers(0, 60), min_size=1, max_size=5))
    starts = []
    for n in sizes:
        if n == 0:
            starts.append([])
            continue
        cuts = draw(st.sets(st.integers(1, n - 1), max_size=8)) if n > 1 else set()
        starts.append([0, *sorted(cuts)])
    return sizes, starts


# ---------------------------------------------------------------- the order


@settings(max_examples=80, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32), chunk=st.integers(1, 40),
       lanes=st.integers(1, 4))
def test_every_pass_visits_every_sample_once_block_by_block(
        layout: tuple[list[int], list[list[int]]], seed: int, chunk: int, lanes: int) -> None:
    sizes, starts = layout
    ds = LaidOut(sizes, starts)
    total = sum(sizes)
    ptrs = all_pointers(WorkSchedule([ds], chunk_size=chunk, num_lanes=lanes, seed=seed,
                                     passes=3))
    assert len(ptrs) == 3 * total
    for p in range(3):
        one_pass = ptrs[p * total:(p + 1) * total]
        assert sorted(one_pass) == [(0, s, i) for s, n in enumerate(sizes) for i in range(n)]
        # Each shard is one run of the pass, and each of its blocks one run of the shard.
        shard_runs = [s for k, (_, s, _) in enumerate(one_pass)
                      if k == 0 or one_pass[k - 1][1] != s]
        assert len(shard_runs) == len(set(shard_runs))
        for s, block_starts in enumerate(starts):
            if not block_starts:
                continue
            visited = [int(np.searchsorted(block_starts, i, side="right")) - 1
                       for (_, shard, i) in one_pass if shard == s]
            runs = [b for k, b in enumerate(visited) if k == 0 or visited[k - 1] != b]
            assert sorted(runs) == list(range(len(block_starts))), (s, runs)


def test_a_shard_of_one_block_keeps_the_order_it_always_had() -> None:
    ds = MemDataset(list(range(90)), shard_sizes=[40, 50], access="pointer")
    ptrs = all_pointers(WorkSchedule([ds], chunk_size=7, num_lanes=2, seed=11, passes=2))
    for p in range(2):
        one_pass = ptrs[p * 90:(p + 1) * 90]
        for shard, n in ((0, 40), (1, 50)):
            within = [i for (_, s, i) in one_pass if s == shard]
            key = seed_key(11, 0, p, shard)
            assert within == permute(np.arange(n), n, key).tolist()


def test_the_block_order_differs_by_seed_and_by_pass_and_repeats_exactly() -> None:
    ds = LaidOut([100, 80], [list(range(0, 100, 10)), list(range(0, 80, 8))])

    def order(seed: int) -> list[tuple[int, int, int]]:
        return all_pointers(WorkSchedule([ds], chunk_size=9, num_lanes=3, seed=seed,
                                         passes=2))

    first = order(5)
    assert first == order(5)
    assert first != order(6)
    assert first[:180] != first[180:]  # pass 1 is reshuffled
    assert sorted(first[:180]) == sorted(first[180:])


def test_shuffle_false_keeps_file_order_whatever_the_blocks() -> None:
    ds = LaidOut([30, 20], [[0, 10, 20], [0, 5]])
    ptrs = all_pointers(WorkSchedule([ds], chunk_size=8, num_lanes=2, shuffle=False))
    assert ptrs == [(0, 0, i) for i in range(30)] + [(0, 1, i) for i in range(20)]


# Blocks 0-5, 6-7 and 8-9 visited in the order 6-7, 0-5, 8-9.
SCHEDULE_GOLDEN = [(0, 0, 6), (0, 0, 7), (0, 0, 4), (0, 0, 2), (0, 0, 5), (0, 0, 1),
                   (0, 0, 0), (0, 0, 3), (0, 0, 8), (0, 0, 9)]


def test_block_order_golden_values() -> None:
    # Pins the block shuffle, so that an accidental change of it (and of every
    # resumed run that depends on it) fails loudly.
    ds = LaidOut([10], [[0, 6, 8]])
    assert all_pointers(WorkSchedule([ds], chunk_size=4, num_lanes=1, seed=7)) == SCHEDULE_GOLDEN


class Huge(Dataset):
    """A shard of 2**40 samples in 2**20 blocks: nothing per sample may be allocated."""

    kind = "huge"
    name = "huge"

    def shards(self) -> list[Shard]:
        return [Shard(shard_id=0, num_samples=1 << 40, name="huge")]

    def read(self, shard_id: int, local_ids: Sequence[int]) -> list[Any]:
        raise AssertionError("the schedule never reads")

    def blocks(self, shard_id: int) -> np.ndarray:
        return np.arange(0, 1 << 40, 1 << 20, dtype=np.int64)


def test_a_shard_of_a_million_blocks_is_shuffled_without_per_sample_memory() -> None:
    schedule = WorkSchedule([Huge()], chunk_size=4096, num_lanes=2, seed=3)
    tracemalloc.start()
    try:
        state = schedule.initial_state()
        seen = []
        for _ in range(3):
            chunk, state = schedule.chunk(state)
            seen.extend(chunk.local_ids.tolist())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20  # the per-block arrays of 2**20 blocks; never 2**40 samples
    assert len(set(seen)) == len(seen) == 3 * 4096
    # Consecutive positions stay inside one block of 2**20 samples.
    assert len({i >> 20 for i in seen}) <= 2


def test_blocks_that_do_not_describe_the_shard_are_a_clear_error() -> None:
    bad = LaidOut([10], [[1, 5]])
    with pytest.raises(ValueError, match=r"blocks\(0\) returned .*beginning at 0"):
        all_pointers(WorkSchedule([bad], chunk_size=4, num_lanes=1))
    unsorted = LaidOut([10], [[0, 7, 3]])
    with pytest.raises(ValueError, match="ascending"):
        all_pointers(WorkSchedule([unsorted], chunk_size=4, num_lanes=1))


# ---------------------------------------------------------------- reads


class CountingParquet(ParquetDataset):
    """Records every row-group decode (the reads a test can count in this process)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decodes: Counter[tuple[int, int]] = Counter()
        self._decode_lock = threading.Lock()

    def _read_row_group(self, shard_id: int, row_group: int) -> Any:
        with self._decode_lock:
            self.decodes[(shard_id, row_group)] += 1
        return super()._read_row_group(shard_id, row_group)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_decode_lock")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._decode_lock = threading.Lock()


@pytest.fixture(scope="module")
def many_groups(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Four Parquet shards of 600 documents in row groups of 40 (15 groups each)."""
    root = tmp_path_factory.mktemp("many_groups")
    return [str(write_token_parquet(root / f"part-{i}.parquet", 600, seed=300 + i,
                                    rows_per_group=40)) for i in range(4)]


def _group_of(ds: ParquetDataset, shard: int, local: int) -> int:
    return int(np.searchsorted(ds._bounds[shard], local, side="right")) - 1


def _group_bytes(ds: ParquetDataset, decodes: Counter) -> int:
    return sum(int(ds._group_bytes[s][g]) * n for (s, g), n in decodes.items())


@pytest.mark.parametrize("num_lanes", [1, 3, 4])
def test_a_shuffled_pass_decodes_each_row_group_once_per_lane_sharing_it(
        many_groups: list[str], num_lanes: int) -> None:
    ds = CountingParquet(many_groups)
    pipe = (Pipeline.from_sources([ds], num_lanes=num_lanes, chunk_size=32, seed=1, passes=2)
            .fetch().pack_flat(256).shuffle(64, seed=2).batch(4))
    it = pipe.iter(runner="inline")
    out = list(it)
    stats = it.stats()
    # Per pass and row group, the lanes whose chunks hold some of its rows.
    sharing: dict[tuple[int, int, int], set[int]] = defaultdict(set)
    for batch in out:
        for record in batch.records:
            lane = record.meta.lane_id
            for ref in record.meta.contribution_refs():
                cursor = ref.cursor
                _, shard, local = cursor.sample_id
                position = (cursor.chunk_id * num_lanes + lane) * 32 + cursor.chunk_offset
                sharing[(position // 2400, shard, _group_of(ds, shard, local))].add(lane)
    groups = sum(len(ds._group_bytes[s]) for s in range(4))
    assert len(sharing) == 2 * groups and len(ds.decodes) == groups
    for (shard, group), count in ds.decodes.items():
        bound = sum(len(sharing[(p, shard, group)]) for p in range(2))
        assert count <= bound, (shard, group, count, bound)
    # bytes_read is what was decoded, exactly; a pass of one lane reads the files at
    # most once (a group that ends pass 0 and starts pass 1 may be decoded once for both).
    assert stats["bytes_read"] == _group_bytes(ds, ds.decodes)
    assert stats["sample_bytes"] == 2 * sum(int(b.sum()) for b in ds._group_bytes)
    if num_lanes == 1:
        assert stats["bytes_read"] <= stats["sample_bytes"]
    assert stats["bytes_read"] <= num_lanes * stats["sample_bytes"]


def test_bytes_read_counts_every_decode_with_threads(many_groups: list[str]) -> None:
    ds = CountingParquet(many_groups)
    pipe = Pipeline.from_sources([ds], num_lanes=2, chunk_size=16, seed=4).fetch()
    it = pipe.iter(runner="threads", num_workers=3, microbatch_sizes={"fetch": 8})
    assert len(list(it)) == 2400
    assert it.stats()["bytes_read"] == _group_bytes(ds, ds.decodes)
    assert sum(ds.decodes.values()) >= 60


def test_bytes_read_gathers_the_reads_of_worker_processes(many_groups: list[str]) -> None:
    ds = ParquetDataset(many_groups)
    total = sum(int(b.sum()) for b in ds._group_bytes)
    pipe = Pipeline.from_sources([ds], num_lanes=1, chunk_size=600, shuffle=False).fetch()
    it = pipe.iter(runner="process", num_workers=1, microbatch_sizes={"fetch": 40})
    assert len(list(it)) == 2400
    stats = it.stats()
    # One worker, row groups in file order, one micro-batch per group: each read once.
    assert stats["bytes_read"] == stats["sample_bytes"] == total


def test_threads_wanting_the_same_row_group_wait_for_one_decode(many_groups: list[str]) -> None:
    class Slow(CountingParquet):
        def _read_row_group(self, shard_id: int, row_group: int) -> Any:
            time.sleep(0.2)  # a long decode: the other threads arrive meanwhile
            return super()._read_row_group(shard_id, row_group)

    ds = Slow(many_groups[:1])
    start = threading.Barrier(4)
    results: list[Any] = []

    def read(ids: list[int]) -> None:
        start.wait()
        results.append(ds.read(0, ids))

    threads = [threading.Thread(target=read, args=([k, k + 10],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    assert ds.decodes == {(0, 0): 1}


class CountingFile(RandomAccessFile):
    reads: ClassVar[list[int]] = []  # bytes of each range read for lines
    checks: ClassVar[list[int]] = []  # bytes read when a file is opened (its identity check)

    def read_at(self, offset: int, size: int) -> bytes:
        data = super().read_at(offset, size)
        CountingFile.reads.append(len(data))
        return data


class CountingJsonl(JsonlDataset):
    """JSONL whose file handles record the bytes of every range read."""

    block_bytes = 4096

    def _open(self, shard_id: int) -> RandomAccessFile:
        file = self._files[shard_id]
        handle = CountingFile(file.path)
        mark = len(CountingFile.reads)
        self._check_unchanged(file, handle)
        CountingFile.checks.extend(CountingFile.reads[mark:])
        del CountingFile.reads[mark:]
        return handle


def test_a_shuffled_pass_reads_each_jsonl_byte_once(tmp_path: Path) -> None:
    paths = [write_jsonl(tmp_path / f"p{i}.jsonl", documents(300, seed=i)) for i in range(2)]
    sizes = sum(p.stat().st_size for p in paths)
    assert min(p.stat().st_size for p in paths) > 8 * CountingJsonl.block_bytes
    CountingFile.reads, CountingFile.checks = [], []
    ds = CountingJsonl([str(p) for p in paths], cache_dir=tmp_path / "index")
    pipe = Pipeline.from_sources([ds], num_lanes=1, chunk_size=50, seed=3).fetch()
    it = pipe.iter(runner="inline")
    texts = [json.loads(r.payload)["text"] for r in it]
    assert sorted(texts) == sorted(t for i in range(2) for t in documents(300, seed=i) if t)
    # Every byte once, in blocks; and the line ending before each block but the first,
    # which the reader checks against the index.
    checked = sum(len(ds.blocks(s)) - 1 for s in range(2))
    assert checked > 10
    assert sum(CountingFile.reads) == sizes + checked
    assert it.stats()["bytes_read"] == sizes + checked + sum(CountingFile.checks)


def test_text_files_count_their_size_per_read(tmp_path: Path) -> None:
    for i, text in enumerate(["one", "two two", ""]):
        (tmp_path / f"{i}.txt").write_text(text)
    it = Pipeline.from_text_files(str(tmp_path / "*.txt"), num_lanes=2, chunk_size=1,
                                  passes=2).fetch().iter(runner="inline",
                                                         microbatch_sizes={"fetch": 1})
    list(it)
    assert it.stats()["bytes_read"] == 20  # each file read once per pass
    it = Pipeline.from_items(["in memory"]).iter(runner="inline")
    list(it)
    assert it.stats()["bytes_read"] == 0


# ---------------------------------------------------------------- determinism and resume


def _rg_pipe(files: list[str], seed: int = 0) -> Pipeline:
    return (Pipeline.from_parquet(files, num_lanes=4, chunk_size=24, seed=seed, passes=2,
                                  flush_every_k_chunks=3)
            .fetch().pack_flat(128).shuffle(16, seed=1).batch(3))


def test_the_block_order_is_the_same_on_every_runner_and_world_size(
        many_groups: list[str]) -> None:
    pipe = _rg_pipe(many_groups[:2])
    assert_deterministic(pipe, matrix(workers=(2,)))
    assert_elastic(pipe, world_sizes=(2, 4))
    other = collect(_rg_pipe(many_groups[:2], seed=9), runner="inline")
    assert [b.ids for b in other] != [b.ids for b in collect(pipe, runner="inline")]


def test_a_run_over_many_row_groups_restores_at_every_cut(many_groups: list[str]) -> None:
    pipe = (Pipeline.from_parquet(many_groups[:1], num_lanes=2, chunk_size=16, seed=2,
                                  flush_every_k_chunks=2)
            .fetch().pack_flat(96).batch(2))
    assert_restores_everywhere(pipe, resume_settings=({"runner": "inline"},
                                                      {"runner": "threads", "num_workers": 2}))


def test_a_resume_over_files_whose_row_groups_changed_is_refused(tmp_path: Path) -> None:
    path = write_token_parquet(tmp_path / "a.parquet", 200, seed=1, rows_per_group=20)
    pipe = Pipeline.from_parquet(str(path), num_lanes=2, chunk_size=8).fetch()
    it = pipe.iter(runner="inline")
    next(it)
    state = it.state_dict()
    it.close()
    assert "blocks" in pipe.fingerprint()
    write_token_parquet(path, 200, seed=1, rows_per_group=25)  # same rows, other groups
    again = Pipeline.from_parquet(str(path), num_lanes=2, chunk_size=8).fetch()
    with pytest.raises(ValueError, match="blocks differ"):
        again.iter(runner="inline").load_state_dict(state)
    # Not even with changed data accepted: the order itself is another, so the replay
    # could not find its place.
    with pytest.raises(ValueError, match="blocks differ"):
        again.iter(runner="inline").load_state_dict(accept_changed_data(state))
    # Without shuffling, or with one block per shard, the layout decides nothing.
    assert "blocks" not in Pipeline.from_parquet(str(path), shuffle=False).fingerprint()
    one = write_token_parquet(tmp_path / "b.parquet", 50, seed=2, rows_per_group=100)
    assert "blocks" not in Pipeline.from_parquet(str(one)).fingerprint()
