"""The work schedule: chunks, lanes, passes, mixtures, and the memory-free permutation."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memsource import MemDataset

from zephon_torch.block import Block, Sentinel
from zephon_torch.sources.emitter import SourceEmitter
from zephon_torch.sources.permute import permute, seed_key
from zephon_torch.sources.schedule import WorkSchedule
from zephon_torch.vocab import TOMBSTONE_REASON_TAG


def all_chunks(schedule: WorkSchedule) -> list:
    chunks, state = [], schedule.initial_state()
    while True:
        chunk, state = schedule.chunk(state)
        if chunk is None:
            return chunks
        chunks.append(chunk)


def pointers(chunks: list) -> list[tuple[int, int, int]]:
    out = []
    for c in chunks:
        out.extend(zip(c.dataset_ids.tolist(), c.shard_ids.tolist(), c.local_ids.tolist()))
    return out


def test_chunks_are_dealt_round_robin_with_lane_local_ids() -> None:
    ds = MemDataset(list(range(23)), shard_sizes=[10, 13])
    chunks = all_chunks(WorkSchedule([ds], chunk_size=4, num_lanes=3, shuffle=False))
    assert [(c.lane_id, c.chunk_id) for c in chunks] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert [len(c) for c in chunks] == [4, 4, 4, 4, 4, 3]
    # unshuffled: shard 0 then shard 1, in file order
    assert pointers(chunks)[:12] == [(0, 0, i) for i in range(10)] + [(0, 1, 0), (0, 1, 1)]


def test_every_sample_once_per_pass_and_passes_reshuffle() -> None:
    ds = MemDataset(list(range(100)), shard_sizes=[30, 30, 40])
    chunks = all_chunks(WorkSchedule([ds], chunk_size=16, num_lanes=2, seed=3, passes=2))
    ptrs = pointers(chunks)
    assert len(ptrs) == 200
    assert Counter(ptrs) == Counter({p: 2 for p in set(ptrs)})
    first, second = ptrs[:100], ptrs[100:]
    assert sorted(first) == sorted(second)
    assert first != second  # reshuffled per pass
    assert first != sorted(first)  # shuffled at all


def test_seed_changes_the_order_and_same_config_gives_same_order() -> None:
    ds = MemDataset(list(range(64)), shard_sizes=[32, 32])
    a = pointers(all_chunks(WorkSchedule([ds], chunk_size=8, num_lanes=2, seed=1)))
    b = pointers(all_chunks(WorkSchedule([ds], chunk_size=8, num_lanes=2, seed=1)))
    c = pointers(all_chunks(WorkSchedule([ds], chunk_size=8, num_lanes=2, seed=2)))
    assert a == b
    assert a != c


def test_mixture_chunk_of_100_at_70_30_holds_exactly_70_and_30() -> None:
    big = MemDataset(list(range(1000)), component_id=0)
    small = MemDataset(list(range(1000)), component_id=1)
    chunks = all_chunks(WorkSchedule([big, small], chunk_size=100, num_lanes=4,
                                     weights=[0.7, 0.3], exhausted="stop"))
    for c in chunks[:10]:
        counts = Counter(c.dataset_ids.tolist())
        assert counts == {0: 70, 1: 30}
    # interleaved smoothly, not 70 then 30
    head = chunks[0].dataset_ids.tolist()[:10]
    assert head == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]  # largest deficit, ties to the lowest


def test_mixture_exhausted_stop_ends_with_the_first_dataset() -> None:
    a = MemDataset(list(range(50)), component_id=0)
    b = MemDataset(list(range(10)), component_id=1)
    chunks = all_chunks(WorkSchedule([a, b], chunk_size=8, num_lanes=2, weights=[1, 1],
                                     exhausted="stop"))
    counts = Counter(d for d, _, _ in pointers(chunks))
    assert counts[1] == 10
    assert counts[0] in (10, 11)


def test_mixture_exhausted_repeat_runs_until_every_dataset_finished() -> None:
    a = MemDataset(list(range(50)), component_id=0)
    b = MemDataset(list(range(10)), component_id=1)
    chunks = all_chunks(WorkSchedule([a, b], chunk_size=8, num_lanes=2, weights=[1, 1],
                                     exhausted="repeat"))
    counts = Counter(d for d, _, _ in pointers(chunks))
    assert counts[0] == 50
    assert counts[1] in (49, 50)  # b repeated (about five passes) while a finished
    b_ptrs = [p for p in pointers(chunks) if p[0] == 1]
    assert b_ptrs[:10] != b_ptrs[10:20]  # each repeat is reshuffled


def test_weights_default_to_dataset_sizes_and_empty_datasets_take_no_share() -> None:
    a = MemDataset(list(range(30)), component_id=0)
    b = MemDataset(list(range(10)), component_id=1)
    empty = MemDataset([], component_id=2)
    schedule = WorkSchedule([a, b, empty], chunk_size=8, num_lanes=1)
    assert schedule.weights == pytest.approx([0.75, 0.25, 0.0])
    assert Counter(d for d, _, _ in pointers(all_chunks(schedule))) == {0: 30, 1: 10}


def test_dataset_passes_override_the_default() -> None:
    a = MemDataset(list(range(10)), component_id=0, passes=3)
    chunks = all_chunks(WorkSchedule([a], chunk_size=7, num_lanes=2, passes=1))
    assert len(pointers(chunks)) == 30


def test_emitter_skips_other_lanes_and_injects_sentinels_per_lane() -> None:
    ds = MemDataset([f"d{i}" for i in range(40)])
    schedule = WorkSchedule([ds], chunk_size=4, num_lanes=2, shuffle=False)
    emitter = SourceEmitter(schedule, [ds], lanes=[1], flush_every=2)
    units = [unit for chunk in emitter for unit in chunk]
    # Lane 1 owns global chunks 1, 3, 5, 7, 9 (its chunks 0..4); a sentinel follows the
    # block of every second one, tagged with the first chunk of the next period.
    assert [(type(u).__name__, u.lane, u.boundary if type(u) is Sentinel else
             int(u.chunk_ids[0])) for u in units] == [
        ("Block", 1, 0), ("Block", 1, 1), ("Sentinel", 1, 2),
        ("Block", 1, 2), ("Block", 1, 3), ("Sentinel", 1, 4), ("Block", 1, 4)]
    data = [r for u in units if type(u) is Block for r in u.records()]
    assert {r.meta.lane_id for r in data} == {1}
    assert not any(r.meta.is_sentinel for r in data)
    assert [r.payload["text"] for r in data[:5]] == ["d4", "d5", "d6", "d7", "d12"]
    assert [r.meta.chunk_offset for r in data[:5]] == [0, 1, 2, 3, 0]
    assert [r.meta.chunk_id for r in data] == [c for c in range(5) for _ in range(4)]
    # As records (what a user accumulator sees), the sentinels are flush sentinels.
    records = [u.record() for u in units if type(u) is Sentinel]
    assert all(r.meta.is_flush_sentinel for r in records)
    assert [(r.meta.lane_id, r.meta.chunk_id) for r in records] == [(1, 2), (1, 4)]


def test_empty_item_text_becomes_a_tombstone_at_the_source() -> None:
    ds = MemDataset(["a", "", "  ", "b"])
    schedule = WorkSchedule([ds], chunk_size=8, num_lanes=1, shuffle=False)
    (block,) = next(iter(SourceEmitter(schedule, [ds], lanes=[0])))
    assert type(block) is Block
    records = block.records()
    assert [r.meta.tombstone for r in records] == [False, True, True, False]
    assert [r.meta.tags.get(TOMBSTONE_REASON_TAG) for r in records] == [
        None, "empty", "empty", None]
    assert [r.payload for r in records] == [{"text": "a"}, None, None, {"text": "b"}]
    assert [r.meta.chunk_offset for r in records] == [0, 1, 2, 3]


# Golden values: they pin the permutation so that an accidental change of the
# shuffle (and of every resumed run that depends on it) fails loudly.
def test_permutation_golden_values() -> None:
    assert permute(np.arange(10), 10, seed_key(0)).tolist() == [4, 1, 5, 2, 9, 0, 8, 7, 6, 3]
    assert permute(np.arange(10), 10, seed_key(1)).tolist() == [7, 0, 8, 2, 4, 5, 1, 3, 6, 9]
    # the Feistel network (shards over 65,536 samples)
    big = permute(np.arange(5), 100_003, seed_key(0)).tolist()
    assert big == GOLDEN_FEISTEL
    assert seed_key(0, 1, 2) == seed_key(0, 1, 2) != seed_key(0, 2, 1)


def test_schedule_golden_values() -> None:
    ds = MemDataset(list(range(12)), shard_sizes=[5, 7])
    ptrs = pointers(all_chunks(WorkSchedule([ds], chunk_size=12, num_lanes=1, seed=7)))
    assert ptrs == GOLDEN_SCHEDULE


GOLDEN_SCHEDULE = [
    (0, 0, 3), (0, 0, 2), (0, 0, 0), (0, 0, 1), (0, 0, 4), (0, 1, 3),
    (0, 1, 0), (0, 1, 2), (0, 1, 5), (0, 1, 6), (0, 1, 1), (0, 1, 4),
]
GOLDEN_FEISTEL = [95357, 85683, 27288, 27375, 59367]


def test_small_shards_are_shuffled_uniformly() -> None:
    counts = Counter(tuple(permute(np.arange(4), 4, seed_key(s)).tolist()) for s in range(2400))
    assert len(counts) == 24  # every order of 4 appears, about equally often
    assert min(counts.values()) > 60 and max(counts.values()) < 140


@settings(max_examples=60, deadline=None)
@given(n=st.one_of(st.integers(1, 5000), st.integers(65_537, 300_000)),
       key=st.integers(0, 2**64 - 1))
def test_permute_is_a_bijection(n: int, key: int) -> None:
    out = permute(np.arange(n), n, key)
    assert out.dtype == np.int64
    assert np.array_equal(np.sort(out), np.arange(n))
