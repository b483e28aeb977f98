"""A state resumes under a changed configuration when the change only affects what
comes next, and is refused, naming the change, when it would rewrite the past.

The batch size (and ``drop_last``) acts after the resume point: the replay filter
stands right before ``batch``, so a resumed lane's records after its cursor are
those of the saved run, and only the way they are cut into batches changes. The
result is defined as that of a run that changed the batch size at that step, and
checked as such: each lane's records after the cursor, cut into batches of the new
size from there on (``drop_last=True`` cuts a lane's stream continuously across
epochs, so the expectation is exact), and the changed pipeline restores at every
step.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import per_lane

from zephon_torch.pipeline import Pipeline
from zephon_torch.types import SampleBatch

N = 240


def _records(num_lanes: int = 3, **source: Any) -> Pipeline:
    options = {"num_lanes": num_lanes, "chunk_size": 8, "seed": 1, "shuffle": True, **source}
    return Pipeline.from_items([f"doc {i}" for i in range(N)], **options).shuffle(12, seed=2)


def _pipe(batch: int, drop_last: bool = True, **source: Any) -> Pipeline:
    return _records(**source).batch(batch, drop_last=drop_last)


def _keys(batch: SampleBatch) -> list[tuple]:
    return [r.meta.as_cursor_key() for r in batch.records]


def _head(pipe: Pipeline, steps: int) -> tuple[list[Any], dict[str, Any]]:
    it = pipe.iter()
    head = [next(it) for _ in range(steps)]
    state = it.state_dict()
    it.close()
    return head, state


def _resume(pipe: Pipeline, state: dict[str, Any]) -> list[Any]:
    it = pipe.iter()
    it.load_state_dict(state)
    rest = list(it)
    it.close()
    return rest


def _lane_records() -> dict[int, list[tuple]]:
    """Each lane's records as ``batch`` receives them, whatever its size."""
    out: dict[int, list[tuple]] = {}
    for lane, batches in per_lane(list(_pipe(1).iter())).items():
        out[lane] = [key for b in batches for key in _keys(b)]
    return out


@pytest.mark.parametrize(("before", "after"), [(4, 7), (6, 2), (5, 5)])
@pytest.mark.parametrize("steps", [0, 1, 5, 13])
def test_a_changed_batch_size_resumes_as_a_run_that_changed_it_at_that_step(
        before: int, after: int, steps: int) -> None:
    lanes = _lane_records()
    head, state = _head(_pipe(before), steps)
    rest = _resume(_pipe(after), state)
    done = {lane: [k for b in batches for k in _keys(b)]
            for lane, batches in per_lane(head).items()}
    got = per_lane(rest)
    for lane, records in lanes.items():
        seen = done.get(lane, [])
        assert records[:len(seen)] == seen
        left = records[len(seen):]
        expected = [left[i:i + after] for i in range(0, len(left) - after + 1, after)]
        assert [_keys(b) for b in got.get(lane, [])] == expected, lane


def test_the_changed_pipeline_restores_at_every_step() -> None:
    _, state = _head(_pipe(4), 6)
    changed = _pipe(7)
    rest = _resume(changed, state)
    it = changed.iter()
    it.load_state_dict(state)
    for step in range(len(rest)):
        again = it.state_dict()
        assert [_keys(b) for b in _resume(changed, again)] == [_keys(b) for b in rest[step:]]
        next(it)
    it.close()


def test_drop_last_may_change_too() -> None:
    head, state = _head(_pipe(4, drop_last=True), 5)
    rest = _resume(_pipe(4, drop_last=False), state)
    whole = list(_pipe(4, drop_last=False).iter())
    # Cut as before up to the next flush sentinel of each lane; the partial
    # batches drop_last=True would have dropped now leave.
    delivered = sorted(k for b in head + rest for k in _keys(b))
    assert delivered == sorted(k for b in whole for k in _keys(b))
    assert len(delivered) == N


def test_a_resumed_state_saved_after_the_change_names_the_new_size() -> None:
    _, state = _head(_pipe(4), 5)
    it = _pipe(7).iter()
    it.load_state_dict(state)
    next(it)
    again = it.state_dict()
    it.close()
    with pytest.raises(ValueError) as refused:
        _resume(_pipe(7, num_lanes=2), again)
    assert "num_lanes" in str(refused.value)
    assert [_keys(b) for b in _resume(_pipe(4), again)]  # and it changes back


@pytest.mark.parametrize(("changed", "named"), [
    (lambda: _records(seed=5).batch(4), "seed"),
    (lambda: _records(chunk_size=16).batch(4), "chunk_size"),
    (lambda: _records(num_lanes=2).batch(4), "num_lanes"),
    (lambda: Pipeline.from_items([f"doc {i}" for i in range(N)], num_lanes=3, chunk_size=8,
                                 seed=1, shuffle=True).shuffle(12, seed=3).batch(4),
     "shuffle (seed 2 -> 3)"),
])
def test_a_change_that_rewrites_the_past_is_refused_naming_it(changed: Any, named: str) -> None:
    _, state = _head(_pipe(4), 5)
    with pytest.raises(ValueError, match="different pipeline configuration") as refused:
        _resume(changed(), state)
    assert named in str(refused.value)


def test_an_operator_before_batch_cannot_change_with_it() -> None:
    _, state = _head(_pipe(4), 5)
    with pytest.raises(ValueError, match="shuffle"):
        _resume(_records().shuffle(3, seed=1).batch(7), state)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_resumes_a_changed_batch_size(workers: int) -> None:
    pytest.importorskip("torch")
    from zephon_torch import DataLoader

    loader = DataLoader(_pipe(4), num_workers=workers, to_training=False)
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    state = loader.state_dict()
    del it
    resumed = DataLoader(_pipe(7), num_workers=workers, to_training=False)
    resumed.load_state_dict(state)
    rest = list(resumed)
    reference = _resume(_pipe(7), _head(_pipe(4), 5)[1])
    assert [_keys(b) for b in head] == [_keys(b) for b in _head(_pipe(4), 5)[0]]
    assert sorted(k for b in rest for k in _keys(b)) == sorted(
        k for b in reference for k in _keys(b))
    assert {len(b.records) for b in rest} == {7}


def test_a_state_saved_right_after_the_load_is_the_new_pipelines() -> None:
    # Saved before any next(): it names the new batch size, so it merges with the
    # states of ranks that moved on, and resumes as any state of the new pipeline.
    _, state = _head(_pipe(4), 5)
    it = _pipe(7).iter()
    it.load_state_dict(state)
    at_load = it.state_dict()
    it.close()
    assert at_load["fingerprint"] == _pipe(7).iter().state_dict()["fingerprint"]
    assert at_load["fingerprint"] != state["fingerprint"]
    assert [_keys(b) for b in _resume(_pipe(7), at_load)] == [
        _keys(b) for b in _resume(_pipe(7), state)]
