"""A state resumes over a dataset whose file list grew: the new shards join at its next pass.

``grown.append_shards(state=state)`` (``zephon_torch/append.py``) is the
pipeline over the grown files with the new shards read from pass ``P`` on,
``P`` the first pass of the dataset that starts at or after the position the
state's change point ``G0`` (the highest ``next`` chunk of any lane) has
reached. The result is defined as a run that appended the shards at that
step, and checked against a stream built by hand here, never from the code
under test: stream positions ``[0, P * old)`` are those of the old pipeline
(the one the state was saved by, over the old files), and every pass from
``P`` on is that pass of a *fresh* pipeline over the grown files (the seeded
shard order it gives pass ``P``, ``P + 1`` ...). That is the same as a run that
made the change at this step: nothing the saved run read, replays or has
fixed moves (everything before ``G0`` lies in passes before ``P``), its pass
in progress ends as it would have, and from the next pass on the run reads
what a pipeline over the grown files reads in that pass. The saved run's
items up to the state, then the resumed run's, placed by their schedule
position, must be that stream one by one; each sample of a pass once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import assert_restores_everywhere, per_lane
from resume_helpers import head_and_state as _head
from resume_helpers import record_keys as _keys
from resume_helpers import resumed_rest as _resume

import zephon_torch as zt
from zephon_torch.checkpoint import merge_states
from zephon_torch.epochs import epoch_pipeline
from zephon_torch.pipeline import Pipeline
from zephon_torch.sources.schedule import WorkSchedule

OLD = {"part0": 20, "part1": 13, "part2": 17}   # 50 samples
NEW = {"part3": 11, "part4": 9}                 # 20 more
LANES = 3
CHUNK = 5
PASSES = 4


def _write(folder: Path, sizes: dict[str, int], *, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in sizes.items():
        lines = [json.dumps({"text": f"{name} {i}{extra}"}) for i in range(n)]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _pipe(folder: Path, *, passes: int | None = PASSES, ops: bool = True,
          lanes: int = LANES) -> Pipeline:
    pipe = Pipeline.from_jsonl(str(folder / "*.jsonl"), num_lanes=lanes, chunk_size=CHUNK,
                               seed=4, passes=passes).fetch().decode_text()
    return (pipe.shuffle(6, seed=2) if ops else pipe).batch(2, drop_last=False)


@pytest.fixture()
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    old = _write(tmp_path / "old", OLD)
    grown = _write(tmp_path / "grown", {**OLD, **NEW})
    return old, grown


def _schedule(pipe: Pipeline) -> WorkSchedule:
    src = pipe.source
    return WorkSchedule(src.datasets, chunk_size=src.chunk_size, num_lanes=src.num_lanes,
                        seed=src.seed, passes=src.passes, shuffle=src.shuffle,
                        weights=src.weights, exhausted=src.exhausted)




def _by_position(items: list[Any], lanes: int = LANES) -> list[tuple]:
    """The sample ids of the delivered records, by stream position (global chunk, offset)."""
    placed = sorted((r.meta.chunk_id * lanes + r.meta.lane_id, r.meta.chunk_offset,
                     r.meta.sample_id) for b in items for r in b.records)
    return [s for _, _, s in placed]


def _join_pass(state: dict[str, Any]) -> int:
    """By hand: the first pass at or after the position reached at the change point."""
    point = max(entry["next"][0] for entry in state["lanes"].values())
    return -(-point * CHUNK // sum(OLD.values()))


def _reference(old: Pipeline, fresh: Pipeline, join: int) -> list[tuple]:
    """Passes before ``join`` as the old pipeline reads them, then the fresh grown
    pipeline's passes ``join`` ... ``PASSES - 1``, position by position."""
    size_old, size_new = sum(OLD.values()), sum(OLD.values()) + sum(NEW.values())
    before = _schedule(old).streams[0].locate(np.arange(join * size_old, dtype=np.int64))
    after = _schedule(fresh).streams[0].locate(
        np.arange(join * size_new, PASSES * size_new, dtype=np.int64))
    return [(0, int(a), int(b)) for part in (before, after) for a, b in zip(*part)]


@pytest.mark.parametrize("steps", [0, 4, 13, 30])
def test_same_as_a_run_that_appended_here(dirs: tuple[Path, Path], steps: int) -> None:
    old, grown = _pipe(dirs[0]), _pipe(dirs[1])
    head, state = _head(old, steps)
    appended = grown.append_shards(state=state)
    join = _join_pass(state)
    assert [(g.shards_before, g.from_pass) for g in
            appended.source.datasets[0].shard_growth] == [(3, join)]
    rest = _resume(appended, state)
    expected = _reference(old, grown, join)
    assert _by_position(head + rest) == expected
    # Each pass holds every sample of its shards once: the old three before the
    # join, all five from it on.
    size_old = sum(OLD.values())
    for p in range(PASSES):
        lo = p * size_old if p <= join else join * size_old + (p - join) * 70
        span = expected[lo:lo + (size_old if p < join else 70)]
        assert len(set(span)) == len(span)
        assert {s[1] for s in span} == set(range(3 if p < join else 5))
    # The uninterrupted run of the appended pipeline gives the saved head, then the rest.
    full = list(appended.iter(runner="inline"))
    assert _keys(head + rest) == _keys(full)
    assert _keys(head) == _keys(full[:steps])
    # ... and the new shards do change what follows.
    assert _keys(rest) != _keys(list(old.iter(runner="inline"))[steps:])


def test_one_lane_delivers_the_reference_in_order(dirs: tuple[Path, Path]) -> None:
    old = _pipe(dirs[0], ops=False, lanes=1)
    grown = _pipe(dirs[1], ops=False, lanes=1)
    head, state = _head(old, 37)   # 74 samples: in pass 1, so they join at pass 2
    appended = grown.append_shards(state=state)
    assert appended.source.datasets[0].shard_growth[0].from_pass == 2
    rest = _resume(appended, state)
    ids = [r.meta.sample_id for b in head + rest for r in b.records]
    assert ids == _reference(old, grown, 2)


def test_restores_at_every_step_on_the_appended_pipeline(dirs: tuple[Path, Path]) -> None:
    old, grown = _pipe(dirs[0]), _pipe(dirs[1])
    head, state = _head(old, 20)
    appended = grown.append_shards(state=state)
    reference = assert_restores_everywhere(appended, resume_settings=(
        {"runner": "inline"}, {"runner": "threads", "num_workers": 2},
        {"runner": "lanes", "num_workers": 2}), cut_points=range(0, 105, 7))
    assert _keys(reference[:20]) == _keys(head)
    # Every state of the saved run up to this one resumes on the appended pipeline too.
    for k in (0, 9, 20):
        earlier, saved = _head(old, k)
        assert _keys(earlier + _resume(appended, saved)) == _keys(reference)


def test_two_world_sizes(dirs: tuple[Path, Path]) -> None:
    old, grown = _pipe(dirs[0]), _pipe(dirs[1])
    states, heads = [], []
    for rank in range(2):
        head, state = _head(old, 8, rank=rank, world_size=2)
        heads += head
        states.append(state)
    merged = merge_states(states)
    appended = grown.append_shards(state=merged)
    assert appended.source.datasets[0].shard_growth[0].from_pass == _join_pass(merged)
    full = per_lane(list(appended.iter(runner="inline")))
    for world in (1, 3):
        rests = [_resume(appended, merged, rank=r, world_size=world) for r in range(world)]
        lanes = per_lane(heads + [b for rest in rests for b in rest])
        assert {lane: _keys(items) for lane, items in lanes.items()} == \
            {lane: _keys(items) for lane, items in full.items()}
    assert _by_position(heads + [b for r in range(3) for b in _resume(
        appended, merged, rank=r, world_size=3)]) == \
        _reference(old, grown, _join_pass(merged))
    # One rank's state alone cannot place the join: every lane's position decides it.
    with pytest.raises(ValueError, match=r"lane\(s\) \[1\].*merge_states"):
        grown.append_shards(state=states[0])


def test_the_lanes_runner_resumes_the_same(dirs: tuple[Path, Path]) -> None:
    old, grown = _pipe(dirs[0]), _pipe(dirs[1])
    head, state = _head(old, 11)
    appended = grown.append_shards(state=state)
    inline = _resume(appended, state)
    assert _keys(_resume(appended, state, runner="lanes", num_workers=2)) == _keys(inline)
    assert _by_position(head + inline) == _reference(old, grown, _join_pass(state))


def test_a_relaunch_rebuilds_the_growth_and_a_second_one_joins_later(
        dirs: tuple[Path, Path], tmp_path: Path) -> None:
    old, grown = _pipe(dirs[0]), _pipe(dirs[1])
    _, state = _head(old, 2)
    appended = grown.append_shards(state=state)
    first = _join_pass(state)
    reference = list(appended.iter(runner="inline"))
    head, later = _head(appended, 40)
    assert json.loads(later["fingerprint"]["shard_growth"]) == [[0, 3, first, 0]]
    again = grown.append_shards(state=later)   # the relaunched job's line
    assert again.fingerprint() == appended.fingerprint()
    assert _keys(head + _resume(again, later)) == _keys(reference)
    # More files since: a second growth, at the next pass after the later state.
    bigger = _pipe(_write(tmp_path / "bigger", {**OLD, **NEW, "part5": 6}))
    twice = bigger.append_shards(state=later)
    growth = twice.source.datasets[0].shard_growth
    reached = max(e["next"][0] for e in later["lanes"].values()) * CHUNK

    def starts(p: int) -> int:  # by hand: passes of 50 before the first join, then of 70
        return p * 50 if p <= first else first * 50 + (p - first) * 70

    join = next(p for p in range(first, PASSES) if starts(p) >= reached)
    assert [(g.shards_before, g.from_pass) for g in growth] == [(3, first), (5, join)]
    rest = _resume(twice, later)
    placed = _by_position(head + rest)
    assert placed[:starts(join)] == _by_position(reference)[:starts(join)]
    fresh = _schedule(bigger).streams[0].locate(np.arange(join * 76, PASSES * 76))
    assert placed[starts(join):] == [(0, int(a), int(b)) for a, b in zip(*fresh)]


def test_refusals_name_the_change_and_what_to_do(dirs: tuple[Path, Path],
                                                 tmp_path: Path) -> None:
    old = _pipe(dirs[0])
    _, state = _head(old, 13)
    # Loaded as it is: the generic refusal names the new shard and append_shards.
    it = _pipe(dirs[1]).iter(runner="inline")
    with pytest.raises(ValueError, match=r"new: 'part3.jsonl'.*append_shards\(state=state\)"):
        it.load_state_dict(state)
    removed = _pipe(_write(tmp_path / "removed", {"part0": 20, "part2": 17, **NEW}))
    with pytest.raises(ValueError, match=r"1 shard\(s\) of the state are gone.*its shard 1"):
        removed.append_shards(state=state)
    longer = _pipe(_write(tmp_path / "longer", {**OLD, "part1": 14, **NEW}))
    with pytest.raises(ValueError, match=r"shard 1 'part1.jsonl' has 14 samples now, 13 in "
                                         r"the state: it changed in place"):
        longer.append_shards(state=state)
    rewritten = _write(tmp_path / "rewritten", {**OLD, **NEW})
    _write(rewritten, {"part1": 13}, extra="!")
    with pytest.raises(ValueError, match=r"the data changed since.*'part1.jsonl'"):
        _pipe(rewritten).append_shards(state=state)
    reordered = _pipe(_write(tmp_path / "reordered", {**OLD, "part0a": 5}))
    with pytest.raises(ValueError, match=r"shard 1 is shard 2 \('part1.jsonl'\).*reordered.*"
                                         r"sort last"):
        reordered.append_shards(state=state)
    # One pass, already started: there is no next pass to join.
    once_state = _head(_pipe(dirs[0], passes=1), 1)[1]
    with pytest.raises(ValueError, match=r"read for 1 pass\(es\).*join at pass 1, which never"):
        _pipe(dirs[1], passes=1).append_shards(state=once_state)
    # ... nor after the last pass has ended.
    ended = _head(_pipe(dirs[0], passes=1), 13)[1]
    with pytest.raises(ValueError, match=r"has ended.*'part3.jsonl' \.\.\. have no pass"):
        _pipe(dirs[1], passes=1).append_shards(state=ended)
    # Nothing read yet: the grown shards make the one pass (pass 0).
    fresh_state = _head(_pipe(dirs[0], passes=1, lanes=1), 0)[1]
    from_start = _pipe(dirs[1], passes=1, lanes=1).append_shards(state=fresh_state)
    assert from_start.source.datasets[0].shard_growth[0].from_pass == 0
    # A mixture component that grew: not supported.
    mix = Pipeline.from_sources([zt.sources.jsonl(str(dirs[1] / "*.jsonl"), component_id=0),
                                 zt.sources.items(["x"] * 10, component_id=1)],
                                weights=[0.5, 0.5], num_lanes=LANES, chunk_size=CHUNK)
    with pytest.raises(ValueError, match=r"reads 2 datasets.*not supported yet"):
        mix.append_shards(state=state)
    # Other settings: the generic refusal (the seed) still speaks.
    with pytest.raises(ValueError, match=r"seed differ"):
        _pipe(dirs[1]).with_source(seed=5).append_shards(state=state)
    # A later state of the run before the growth, on a pipeline made from an earlier one:
    # its lanes went on into the pass the new shards were to join.
    early = _pipe(dirs[1]).append_shards(state=_head(old, 2)[1])
    late = _head(old, 40)[1]
    with pytest.raises(ValueError, match=r"join at pass 1 .*read to position \d+ over the "
                                         r"old shards.*append_shards\(state=state\)"):
        early.iter(runner="inline").load_state_dict(late)


def test_nothing_appended_and_pipelines_that_never_grew(dirs: tuple[Path, Path]) -> None:
    old = _pipe(dirs[0])
    head, state = _head(old, 9)
    same = old.append_shards(state=state)
    assert same.fingerprint() == old.fingerprint()
    assert "shard_growth" not in old.fingerprint()
    assert _keys(head + _resume(same, state)) == _keys(list(old.iter(runner="inline")))


def test_a_later_epoch_reads_the_grown_shards_from_its_first_pass(
        dirs: tuple[Path, Path]) -> None:
    old, grown = _pipe(dirs[0]), _pipe(dirs[1])
    _, state = _head(old, 13)
    appended = grown.append_shards(state=state)
    later = epoch_pipeline(appended, 1)
    assert later.source.datasets[0].shard_growth == ()
    assert _schedule(later).streams[0].locate(np.arange(280))[0].tolist() == \
        _schedule(epoch_pipeline(grown, 1)).streams[0].locate(np.arange(280))[0].tolist()


def test_a_state_of_an_earlier_epoch_than_the_growth_is_refused(
        dirs: tuple[Path, Path]) -> None:
    old, grown = _pipe(dirs[0]), _pipe(dirs[1])
    it = old.iter(runner="inline", epoch=1)
    next(it)
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    appended = grown.append_shards(state=state)
    assert appended.source.datasets[0].shard_growth[0].epoch == 1
    earlier = _head(old, 2)[1]   # epoch 0, before the growth
    with pytest.raises(ValueError, match=r"appended in epoch 1, and this state was saved in "
                                         r"epoch 0"):
        appended.iter(runner="inline").load_state_dict(earlier)
    rest = _resume(appended, state, epoch=1)
    assert rest
