"""A mixture resumes under other weights, from the state's step on.

``pipe.change_weights(new, state=state)`` is the pipeline the state was saved
by with the weights changed at the state's change point ``G0``: the highest
global chunk of any lane's ``next`` (``sources/weight_plan.py``). The result is
defined as a run that changed its weights at that step, and checked against
one built by hand here: the same datasets and options, the old weights for
the global chunks before ``G0`` and, from ``G0`` on, the round-robin restarted
on the new weights from the counts the old schedule had at ``G0`` (walked from
the start of the stream, never read from the state). The saved run's items up
to the state, then the resumed run's, must be that run's items one by one.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np
import pytest
from harness import assert_restores_everywhere, per_lane
from resume_helpers import head_and_state as _head
from resume_helpers import record_keys as _keys
from resume_helpers import resumed_rest as _resume

import zephon_torch as zt
from zephon_torch.checkpoint import merge_states
from zephon_torch.pipeline import Pipeline
from zephon_torch.sources.schedule import WorkSchedule
from zephon_torch.sources.weight_plan import MixtureWeights, WeightChange

SIZES = (90, 70, 50)
LANES = 3
CHUNK = 5


def _datasets(count: int = 2) -> list[Any]:
    return [zt.sources.items([f"{'abc'[d]}{i}" for i in range(SIZES[d])], name="abc"[d],
                             component_id=d) for d in range(count)]


def _base(weights: list[float], exhausted: str = "stop", *, ops: bool = True,
          count: int = 2) -> Pipeline:
    pipe = Pipeline.from_sources(_datasets(count), weights=weights, num_lanes=LANES,
                                 chunk_size=CHUNK, seed=4, exhausted=exhausted)
    return pipe.shuffle(6, seed=2).batch(2) if ops else pipe.batch(2, drop_last=False)


def _schedule(pipe: Pipeline) -> WorkSchedule:
    src = pipe.source
    return WorkSchedule(src.datasets, chunk_size=src.chunk_size, num_lanes=src.num_lanes,
                        seed=src.seed, passes=src.passes, shuffle=src.shuffle,
                        weights=src.weights, exhausted=src.exhausted)


def _reference(base: Pipeline, at: int, new: list[float]) -> Pipeline:
    """A run that changes the weights at global chunk ``at``, built from first principles."""
    schedule = _schedule(base)
    state = schedule.initial_state()
    while state.global_chunk < at:
        components, state = schedule.advance(state)
        assert components is not None
    change = WeightChange(at, tuple(new), state.counts, 0)
    return base.with_source(weights=MixtureWeights(base.source.weights, [change]))




def _point(state: dict[str, Any]) -> int:
    return max(entry["next"][0] for entry in state["lanes"].values())


@pytest.mark.parametrize("exhausted", ["stop", "repeat"])
@pytest.mark.parametrize("steps", [0, 4, 11])
def test_same_as_a_run_that_changed_here(exhausted: str, steps: int) -> None:
    base = _base([0.7, 0.3], exhausted)
    head, state = _head(base, steps)
    changed = base.change_weights([0.2, 0.8], state=state)
    reference = _reference(base, _point(state), [0.2, 0.8])
    assert changed.source.weights == reference.source.weights
    rest = _resume(changed, state)
    expected = list(reference.iter(runner="inline"))
    assert _keys(head + rest) == _keys(expected)
    # The saved run's head is the reference's: the change lies after everything it read.
    assert _keys(head) == _keys(expected[:steps])
    # ... and the change does change what follows.
    assert _keys(rest) != _keys(list(base.iter(runner="inline"))[steps:])


def _by_schedule_order(items: list[Any]) -> list[tuple[int, int, tuple]]:
    """(global chunk, offset, sample id) of every delivered record, in schedule order."""
    out = [(r.meta.chunk_id * LANES + r.meta.lane_id, r.meta.chunk_offset, r.meta.sample_id)
           for b in items for r in b.records]
    return sorted(out)


@pytest.mark.parametrize("exhausted", ["stop", "repeat"])
def test_every_sample_once_in_its_own_order_and_the_new_shares(exhausted: str) -> None:
    base = _base([0.7, 0.3], exhausted, ops=False)
    head, state = _head(base, 6)
    changed = base.change_weights([0.25, 0.75], state=state)
    at = changed.source.weights.changes[0].at_chunk
    placed = _by_schedule_order(head + _resume(changed, state))
    schedule = _schedule(base)
    for d in range(2):
        ids = [s for _, _, s in placed if s[0] == d]
        # Each dataset's samples, in the order of the schedule, are its stream: pass
        # after pass, each sample once per pass.
        shards, local = schedule.streams[d].locate(np.arange(len(ids), dtype=np.int64))
        assert ids == [(d, int(a), int(b)) for a, b in zip(shards, local)]
    if exhausted == "stop":  # the first dataset to run out ends it, read exactly once
        ids = [s for _, _, s in placed]
        assert len(ids) == len(set(ids))
        assert max(sum(s[0] == d for s in ids) / SIZES[d] for d in range(2)) == 1.0
    else:  # every dataset has finished its pass
        assert all(sum(s[0] == d for _, _, s in placed) >= SIZES[d] for d in range(2))
    after = [s[0] for g, _, s in placed if g >= at]
    before = [s[0] for g, _, s in placed if g < at]
    assert len(before) == at * CHUNK
    for n in range(1, len(after) + 1):  # the new shares, at every position from G0 on
        assert abs(after[:n].count(1) - 0.75 * n) <= 1.0
    for n in range(1, len(before) + 1):  # and the old ones before it
        assert abs(before[:n].count(1) - 0.3 * n) <= 1.0


def test_restores_at_every_step_on_the_changed_pipeline() -> None:
    base = _base([0.7, 0.3])
    head, state = _head(base, 5)
    changed = base.change_weights([0.2, 0.8], state=state)
    reference = assert_restores_everywhere(changed, resume_settings=(
        {"runner": "inline"}, {"runner": "threads", "num_workers": 2},
        {"runner": "lanes", "num_workers": 2}))
    # The run of the changed pipeline, cut at the state's step, is the saved run's head.
    assert _keys(reference[:5]) == _keys(head)
    # Every state of the saved run up to this one resumes on the changed pipeline too.
    for k in range(6):
        earlier, saved = _head(base, k)
        assert _keys(earlier + _resume(changed, saved)) == _keys(reference)


def test_a_relaunch_rebuilds_the_change_from_a_later_state() -> None:
    base = _base([0.7, 0.3])
    _, state = _head(base, 5)
    changed = base.change_weights([0.2, 0.8], state=state)
    reference = list(changed.iter(runner="inline"))
    head, later = _head(changed, 12)
    assert json.loads(later["fingerprint"]["weight_changes"])
    again = base.change_weights([0.2, 0.8], state=later)  # the relaunched job's line
    assert again.fingerprint() == changed.fingerprint()
    assert _keys(head + _resume(again, later)) == _keys(reference)
    # A second change on top of the first, from the later state.
    twice = base.change_weights([0.5, 0.5], state=later)
    assert len(twice.source.weights.changes) == 2
    rest = _resume(twice, later)
    expected = _reference(base, _point(state), [0.2, 0.8])
    schedule = _schedule(expected)
    at = _point(later)
    s = schedule.initial_state()
    while s.global_chunk < at:
        s = schedule.advance(s)[1]
    hand = expected.with_source(weights=MixtureWeights(
        (0.7, 0.3), [*expected.source.weights.changes, WeightChange(at, (0.5, 0.5), s.counts)]))
    assert _keys(head + rest) == _keys(list(hand.iter(runner="inline")))


@pytest.mark.parametrize("exhausted", ["stop", "repeat"])
def test_two_world_sizes(exhausted: str) -> None:
    base = _base([0.7, 0.3], exhausted)
    states, heads = [], []
    for rank in range(2):
        head, state = _head(base, 3, rank=rank, world_size=2)
        heads += head
        states.append(state)
    merged = merge_states(states)
    changed = base.change_weights([0.2, 0.8], state=merged)
    assert changed.source.weights == _reference(base, _point(merged), [0.2, 0.8]).source.weights
    full = per_lane(list(changed.iter(runner="inline")))
    for world in (1, 3):
        rests = [_resume(changed, merged, rank=r, world_size=world) for r in range(world)]
        lanes = per_lane(heads + [b for rest in rests for b in rest])
        assert {lane: _keys(items) for lane, items in lanes.items()} == \
            {lane: _keys(items) for lane, items in full.items()}
    # One rank's state alone cannot place the change: every lane's position decides it.
    with pytest.raises(ValueError, match=r"lane\(s\) \[1\].*merge_states"):
        base.change_weights([0.2, 0.8], state=states[0])


def test_a_dataset_left_out_and_one_taken_in() -> None:
    base = _base([0.5, 0.5, 0.0], "repeat", ops=False, count=3)
    head, state = _head(base, 7)
    changed = base.change_weights([0.0, 0.4, 0.6], state=state)
    reference = _reference(base, _point(state), [0.0, 0.4, 0.6])
    rest = _resume(changed, state)
    assert _keys(head + rest) == _keys(list(reference.iter(runner="inline")))
    at = _point(state)
    placed = _by_schedule_order(head + rest)
    assert not [s for g, _, s in placed if g >= at and s[0] == 0]
    assert [s for g, _, s in placed if g >= at and s[0] == 2]
    assert not [s for g, _, s in placed if g < at and s[0] == 2]
    # Dataset 2 starts its stream at its first sample, in its own order.
    ids = [s for _, _, s in placed if s[0] == 2]
    shards, local = _schedule(base).streams[2].locate(np.arange(len(ids), dtype=np.int64))
    assert ids == [(2, int(a), int(b)) for a, b in zip(shards, local)]


def test_unchanged_pipelines_and_states_stay_as_they_were() -> None:
    base = _base([0.7, 0.3])
    print_before = base.fingerprint()
    assert "weight_changes" not in print_before
    _, state = _head(base, 4)
    assert "weight_changes" not in state["fingerprint"]
    same = base.change_weights([0.7, 0.3], state=state)  # the weights in force: no change
    assert same.fingerprint() == print_before
    assert _keys(_resume(same, state)) == _keys(_resume(base, state))
    changed = base.change_weights([0.2, 0.8], state=state)
    source = pickle.loads(pickle.dumps(changed.source))  # what process workers receive
    assert source.weights == changed.source.weights
    assert source.weights.changes == changed.source.weights.changes


def test_refusals_name_the_change_and_what_to_do() -> None:
    base = _base([0.7, 0.3])
    _, state = _head(base, 5)
    plain = _base([0.2, 0.8])  # new weights without change_weights
    it = plain.iter(runner="inline")
    with pytest.raises(ValueError, match=r"other mixture weights.*change_weights"):
        it.load_state_dict(state)
    changed = base.change_weights([0.2, 0.8], state=state)
    _, later = _head(base, 14)  # the old run went on past the change point
    it = changed.iter(runner="inline")
    with pytest.raises(ValueError, match=r"change at global chunk \d+, but the state goes on "
                                         r"to chunk \d+.*change_weights"):
        it.load_state_dict(later)
    wrong = changed.source.weights.changes[0]
    forged = base.with_source(weights=MixtureWeights((0.7, 0.3), [WeightChange(
        wrong.at_chunk, wrong.weights, (wrong.counts[0] - 1, wrong.counts[1] + 1))]))
    it = forged.iter(runner="inline")
    with pytest.raises(ValueError, match=r"from counts .* but the schedule before it reaches"):
        it.load_state_dict(state)
    _, ended = _head(base, len(list(base.iter(runner="inline"))))
    with pytest.raises(ValueError, match=r"ended for lane\(s\).*weights the state was saved"):
        base.change_weights([0.2, 0.8], state=ended)
    with pytest.raises(ValueError, match=r"ensure_mixture\(\) without mixture="):
        Pipeline.from_sources(_datasets(), weights=[0.7, 0.3], num_lanes=LANES,
                              chunk_size=CHUNK).ensure_mixture().batch(2).change_weights(
            [0.2, 0.8], state=state)
    with pytest.raises(ValueError, match=r"weight -1"):
        base.change_weights([-1.0, 2.0], state=state)
    with pytest.raises(ValueError, match=r"one weight per dataset"):
        base.change_weights([1.0], state=state)
    # A dataset added is another configuration: still refused.
    with pytest.raises(ValueError, match=r"datasets"):
        _base([0.7, 0.3, 0.1], count=3).change_weights([0.2, 0.4, 0.4], state=state)


def test_later_epochs_run_the_new_weights_from_their_start() -> None:
    base = _base([0.7, 0.3], "repeat")
    _, state = _head(base, 5)
    changed = base.change_weights([0.2, 0.8], state=state)
    plain = _base([0.2, 0.8], "repeat")
    assert _keys(list(changed.iter(runner="inline", epoch=1))) == \
        _keys(list(plain.iter(runner="inline", epoch=1)))
    # A state of the changed run's next epoch resumes on it.
    head, later = _head(changed, 6, epoch=1)
    assert _keys(head + _resume(changed, later)) == \
        _keys(list(changed.iter(runner="inline", epoch=1)))


def test_a_torch_loader_resumes_under_the_new_weights() -> None:
    pytest.importorskip("torch")
    base = _base([0.7, 0.3])
    loader = zt.DataLoader(base, to_training=False)
    it = iter(loader)
    head = [next(it) for _ in range(4)]
    state = loader.state_dict()
    changed = base.change_weights([0.2, 0.8], state=state)
    resumed = zt.DataLoader(changed, to_training=False)
    resumed.load_state_dict(state)
    expected = list(_reference(base, _point(state), [0.2, 0.8]).iter(runner="inline"))
    assert _keys(head + list(resumed)) == _keys(expected)


def test_shares_proportional_to_the_sizes_change_too() -> None:
    base = Pipeline.from_sources(_datasets(), num_lanes=LANES, chunk_size=CHUNK, seed=4,
                                 exhausted="stop").batch(2)
    head, state = _head(base, 6)
    changed = base.change_weights([1.0, 3.0], state=state)
    assert changed.fingerprint()["weights"] is None  # as the state's
    sizes = MixtureWeights([float(n) for n in SIZES[:2]], proportional=True)
    at = _point(state)
    reference = _reference(base.with_source(weights=sizes), at, [1.0, 3.0])
    assert _keys(head + _resume(changed, state)) == _keys(list(reference.iter(runner="inline")))
