"""A run resumes on more lanes than it began with, from the state's step on.

``pipe.change_lanes(n, state=state)`` is the pipeline the state was saved by
with its lanes grown to ``n`` from the chunk after the state's change point
(the highest global chunk of any lane's ``next``; ``zephon_torch/relane.py``).
The result is defined as a run that grew its lanes at that step, and checked
three ways:

* the dealing, from first principles: over a source read in order, sample
  ``i`` lies in global chunk ``i // CHUNK``; written out here, chunk ``g``
  goes to lane ``g % L`` before the point and ``(g - G) % n`` from it, its
  lane-local chunk id counting on; every record of the grown run must carry
  that lane and chunk id;
* the past is kept: the saved run's items up to the state, then the resumed
  run's, are, lane by lane, the grown pipeline's uninterrupted run;
* nothing is lost or repeated, on every world size up to ``n``, on every
  runner, and on the DataLoader.

Then the large worlds the lanes exist for: 1,024 ranks of one pipeline in
one process, a gathered state of 1,024 ranks resumed on 768 and on 1, and a
state's size per lane.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from harness import assert_restores_everywhere, per_lane
from resume_helpers import head_and_state as _head
from resume_helpers import resumed_rest as _resume

import zephon_torch as zt
from zephon_torch.checkpoint import merge_states
from zephon_torch.pipeline import Pipeline

N = 240
CHUNK = 3
LANES = 2


def _texts(pipe: Pipeline, *, drop_last: bool = False) -> Pipeline:
    return pipe.shuffle(8, seed=1).batch(2, drop_last=drop_last)


def _base(**source: Any) -> Pipeline:
    options = {"num_lanes": LANES, "chunk_size": CHUNK, "flush_every_k_chunks": 2,
               "shuffle": False, **source}
    return _texts(Pipeline.from_items([f"d{i}" for i in range(N)], **options))


def _tokens() -> Pipeline:
    items = [{"input_ids": np.arange(i % 7 + 1, dtype=np.int32) + 100 * i} for i in range(N)]
    return (Pipeline.from_items(items, num_lanes=LANES, chunk_size=CHUNK, shuffle=False,
                                flush_every_k_chunks=2)
            .pack_flat(8, num_bins=2).shuffle(6, seed=1).batch(2, drop_last=False))


def _expected_dealing(changes: list[tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Global chunk -> (lane, chunk id), written out from the rule in the module doc."""
    regimes = [(0, LANES), *changes]
    counts: dict[int, int] = {}
    out = {}
    chunks = -(-N // CHUNK)
    for g in range(chunks):
        start, n = max((r for r in regimes if r[0] <= g), key=lambda r: r[0])
        lane = (g - start) % n
        out[g] = (lane, counts.get(lane, 0))
        counts[lane] = counts.get(lane, 0) + 1
    return out


def _sample(record: Any) -> int:
    return int(record.meta.sample_id[2])


def _lanes_of(items: list[Any]) -> dict[int, list[Any]]:
    return per_lane(items)


def _grown(pipe: Pipeline, steps: int, num_lanes: int) -> tuple[list[Any], dict, Pipeline]:
    head, state = _head(pipe, steps)
    return head, state, pipe.change_lanes(num_lanes, state=state)


@pytest.mark.parametrize("steps", [0, 1, 5, 12, 40])
def test_dealing_from_first_principles(steps: int) -> None:
    _, state, grown = _grown(_base(), steps, 5)
    (change,) = grown.source.lane_changes
    highest = max(int(e["next"][0]) for e in state["lanes"].values())
    assert change.at_chunk == highest + 1 and change.num_lanes == 5
    deal = _expected_dealing([(change.at_chunk, 5)])
    seen = 0
    for batch in grown.iter(runner="inline"):
        for record in batch.records:
            g = _sample(record) // CHUNK
            assert (record.meta.lane_id, record.meta.chunk_id) == deal[g], (g, record.meta)
            seen += 1
    assert seen == N


@pytest.mark.parametrize("make", [_base, _tokens], ids=["texts", "packed"])
@pytest.mark.parametrize("steps", [0, 3, 9, 25])
@pytest.mark.parametrize("world", [1, 3, 5])
def test_head_then_resumed_is_the_grown_run(make: Any, steps: int, world: int) -> None:
    pipe = make()
    head, state, grown = _grown(pipe, steps, 5)
    reference = _lanes_of(list(grown.iter(runner="inline")))
    rest: list[Any] = []
    for rank in range(world):
        rest += _resume(grown, state, rank=rank, world_size=world)
    got = _lanes_of(head)
    for lane, items in _lanes_of(rest).items():
        got.setdefault(lane, []).extend(items)
    assert sorted(got) == sorted(reference)
    for lane in reference:
        zt.testing.assert_same(reference[lane], got[lane], label=f"lane {lane}")
    ids = [r.meta.sample_id for b in head + rest for r in b.records
           if not (r.meta.tags and r.meta.tags.get("padding"))]
    if make is _base:
        assert sorted(int(i[2]) for i in ids) == list(range(N))


@pytest.mark.parametrize("setting", [{"runner": "threads", "num_workers": 2},
                                     {"runner": "lanes", "num_workers": 2},
                                     {"runner": "process", "num_workers": 2}],
                         ids=["threads", "lanes", "process"])
def test_other_runners_resume_the_grown_run(setting: dict[str, Any]) -> None:
    pipe = _tokens()
    head, state, grown = _grown(pipe, 7, 4)
    reference = _lanes_of(list(grown.iter(runner="inline")))
    got = _lanes_of(head + _resume(grown, state, **setting))
    assert sorted(got) == sorted(reference)
    for lane in reference:
        zt.testing.assert_same(reference[lane], got[lane], label=f"{setting}: lane {lane}")


def test_restores_at_every_step_on_the_grown_pipeline() -> None:
    _, _, grown = _grown(_tokens(), 6, 4)
    assert_restores_everywhere(grown, resume_settings=(
        {"runner": "inline"}, {"runner": "threads", "num_workers": 2},
        {"runner": "inline", "rank": 0, "world_size": 1}))


def test_a_later_state_of_the_grown_run_resumes_on_other_world_sizes() -> None:
    _, _, grown = _grown(_base(), 4, 6)
    reference = list(grown.iter(runner="inline"))
    # Three ranks of the grown run, each stopped at another step, then merged.
    states, head = [], []
    for rank, steps in ((0, 9), (1, 4), (2, 12)):
        it = grown.iter(runner="inline", rank=rank, world_size=3)
        head += [next(it) for _ in range(steps)]
        states.append(it.state_dict())
        it.close()
    merged = json.loads(json.dumps(merge_states(states)))
    # Called again with that later state, change_lanes finds the change in it and adds nothing.
    again = _base().change_lanes(6, state=merged)
    assert again.fingerprint() == grown.fingerprint()
    for world in (1, 2, 6):
        rest: list[Any] = []
        for rank in range(world):
            rest += _resume(again, merged, rank=rank, world_size=world)
        want, got = _lanes_of(reference), _lanes_of(head + rest)
        for lane in want:
            got_lane = sorted(got.get(lane, []), key=lambda b: b.records[0].meta.as_cursor_key())
            want_lane = sorted(want[lane], key=lambda b: b.records[0].meta.as_cursor_key())
            zt.testing.assert_same(want_lane, got_lane, label=f"world {world}, lane {lane}")


def test_lanes_grow_twice() -> None:
    pipe = _base()
    head, state = _head(pipe, 5)
    once = pipe.change_lanes(4, state=state)
    it = once.iter(runner="inline")
    it.load_state_dict(state)
    mid = [next(it) for _ in range(20)]
    later = json.loads(json.dumps(it.state_dict()))
    it.close()
    twice = pipe.change_lanes(9, state=later)
    assert [c.num_lanes for c in twice.source.lane_changes] == [4, 9]
    points = [c.at_chunk for c in twice.source.lane_changes]
    deal = _expected_dealing([(points[0], 4), (points[1], 9)])
    rest: list[Any] = []
    for rank in range(9):
        rest += _resume(twice, later, rank=rank, world_size=9)
    samples = [_sample(r) for b in head + mid + rest for r in b.records]
    assert sorted(samples) == list(range(N))
    for b in rest:
        for r in b.records:
            assert (r.meta.lane_id, r.meta.chunk_id) == deal[_sample(r) // CHUNK]


def test_a_mixture_grows_its_lanes() -> None:
    datasets = [zt.sources.items([f"{n}{i}" for i in range(size)], name=n, component_id=c)
                for c, (n, size) in enumerate((("a", 90), ("b", 60)))]
    pipe = _texts(Pipeline.from_sources(datasets, weights=[0.6, 0.4], num_lanes=2,
                                        chunk_size=5, seed=3, flush_every_k_chunks=2))
    head, state, grown = _grown(pipe, 6, 5)
    reference = _lanes_of(list(grown.iter(runner="inline")))
    rest: list[Any] = []
    for rank in range(5):
        rest += _resume(grown, state, rank=rank, world_size=5)
    got = _lanes_of(head)
    for lane, items in _lanes_of(rest).items():
        got.setdefault(lane, []).extend(items)
    for lane in reference:
        zt.testing.assert_same(reference[lane], got[lane], label=f"lane {lane}")


@pytest.mark.parametrize("workers", [0, 2])
def test_the_dataloader_resumes_on_the_grown_pipeline(workers: int) -> None:
    pytest.importorskip("torch")
    pipe = _base()
    loader = zt.DataLoader(pipe, num_workers=workers, to_training=False)
    it = iter(loader)
    head = [next(it) for _ in range(6)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    grown = pipe.change_lanes(4, state=state)
    reference = _lanes_of(list(grown.iter(runner="inline")))
    rest: list[Any] = []
    for rank in range(2):  # two lanes a rank: one a worker
        resumed = zt.DataLoader(grown, num_workers=workers, rank=rank, world_size=2,
                                to_training=False)
        resumed.load_state_dict(state)
        rest += list(resumed)
    got = _lanes_of(head)
    for lane, items in _lanes_of(rest).items():
        got.setdefault(lane, []).extend(items)
    for lane in reference:
        zt.testing.assert_same(reference[lane], got[lane], label=f"lane {lane}")


# ------------------------------------------------------------------ refusals


def test_refusals_name_the_change_and_what_to_do() -> None:
    pipe = _base()
    _, state = _head(pipe, 5)
    with pytest.raises(ValueError, match=r"lanes only grow .*asked for 1"):
        pipe.change_lanes(1, state=state)
    with pytest.raises(ValueError, match="positive integer"):
        pipe.change_lanes(0, state=state)
    one_rank = _head(pipe, 3, rank=0, world_size=2)[1]
    with pytest.raises(ValueError, match=r"no entry for lane\(s\) \[1\].*merge_states"):
        pipe.change_lanes(4, state=one_rank)
    # A later state of the run before the change went past the point: refused at load.
    grown = pipe.change_lanes(4, state=state)
    _, later = _head(pipe, 30)
    it = grown.iter(runner="inline")
    with pytest.raises(ValueError, match=r"lanes grow to 4 at global chunk .*change_lanes"):
        it.load_state_dict(later)
    it.close()
    # More ranks than lanes, and another num_lanes: both point to change_lanes.
    with pytest.raises(ValueError, match=r"change_lanes"):
        pipe.iter(runner="inline", rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"num_lanes.*change_lanes\(num_lanes, state=state\)"):
        other = _base(num_lanes=3).iter(runner="inline")
        other.load_state_dict(state)


def test_an_ended_stream_cannot_grow() -> None:
    pipe = _base()
    it = pipe.iter(runner="inline")
    list(it)
    state = it.state_dict()
    with pytest.raises(ValueError, match="has ended"):
        pipe.change_lanes(4, state=state)


# ------------------------------------------------------------------ large worlds


def _wide(num_lanes: int) -> Pipeline:
    return Pipeline.from_items([f"d{i}" for i in range(4096)], num_lanes=num_lanes,
                               chunk_size=2, shuffle=False).batch(2, drop_last=False)


def test_1024_ranks_in_one_process_deliver_every_sample_once() -> None:
    pipe = _wide(1024)
    samples: list[int] = []
    for rank in range(1024):
        it = pipe.iter(runner="inline", rank=rank, world_size=1024)
        samples += [_sample(r) for b in it for r in b.records]
        it.close()
    assert sorted(samples) == list(range(4096))


def test_a_gathered_state_of_1024_ranks_resumes_on_768_and_on_1() -> None:
    pipe = _wide(1024)
    reference = per_lane(list(pipe.iter(runner="inline")))
    states, head = [], []
    for rank in range(1024):
        it = pipe.iter(runner="inline", rank=rank, world_size=1024)
        head += [next(it) for _ in range(rank % 3)]
        states.append(it.state_dict())
        it.close()
    merged = json.loads(json.dumps(merge_states(states)))
    for world in (768, 1):
        rest: list[Any] = []
        for rank in range(world):
            rest += _resume(pipe, merged, rank=rank, world_size=world)
        got = per_lane(head + rest)
        assert sorted(got) == sorted(reference)
        for lane in reference:
            zt.testing.assert_same(reference[lane], got[lane], label=f"{world}: lane {lane}")


def test_growing_8_lanes_to_1024_reaches_every_rank() -> None:
    pipe = _wide(8)
    head, state = _head(pipe, 40)
    grown = pipe.change_lanes(1024, state=state)
    samples = [_sample(r) for b in head for r in b.records]
    busy = 0
    for rank in range(1024):
        rest = _resume(grown, state, rank=rank, world_size=1024)
        busy += bool(rest)
        samples += [_sample(r) for b in rest for r in b.records]
    assert sorted(samples) == list(range(4096))
    assert busy == 1024  # 4,096 samples in chunks of 2: every new lane has some


def test_state_size_grows_linearly_with_lanes_and_stays_small() -> None:
    sizes = {}
    for lanes in (8, 64, 1024):
        it = _wide(lanes).iter(runner="inline")
        for _ in range(lanes + 3):
            next(it)
        sizes[lanes] = len(json.dumps(it.state_dict()))
        it.close()
    per_lane_bytes = {n: sizes[n] / n for n in sizes}
    # No more per lane at 1,024 lanes than at 8 (fixed parts spread thinner), and small.
    assert per_lane_bytes[1024] <= per_lane_bytes[8]
    assert per_lane_bytes[1024] < 400, per_lane_bytes


def test_the_epoch_after_the_change_runs_every_lane_from_its_start() -> None:
    pipe = _base()
    grown = _grown(pipe, 5, 4)[2]
    # Epoch 1 deals every chunk over the four lanes from the first: g % 4.
    seen = []
    for rank in range(4):
        it = grown.iter(runner="inline", rank=rank, world_size=4, epoch=1)
        for batch in it:
            for record in batch.records:  # the source reads in file order in every epoch
                seen.append((record.meta.lane_id, record.meta.chunk_id, _sample(record)))
        it.close()
    assert sorted(s for _, _, s in seen) == list(range(N))
    deal = {g: (g % 4, g // 4) for g in range(-(-N // CHUNK))}
    assert all((lane, chunk) == deal[s // CHUNK] for lane, chunk, s in seen)
    # A state of epoch 1 resumes on another world size.
    head, later = _head(grown, 7, epoch=1)
    rest: list[Any] = []
    for rank in range(2):
        rest += _resume(grown, later, rank=rank, world_size=2)
    assert sorted(_sample(r) for b in head + rest for r in b.records) == list(range(N))
