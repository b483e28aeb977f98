"""A state saved under one shuffle ``buffer_size`` resumes under another.

The shuffle stands before the resume point: each lane replays its window through
it, so the window must be shuffled as it was. The change therefore takes effect
at each lane's next epoch boundary after its cursor (the last record the caller
received from it), and that is what "a run that made this change at this step"
means here (docs/checkpoints.md, "What a resume may change"). Each epoch of a
lane is shuffled on its own (the accumulators reset at every flush sentinel), so
the expected stream is built from two uninterrupted runs: per lane, the epochs
up to the cursor's from the run with the saved size, every later epoch from the
run with the new one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from zephon_torch.checkpoint import state_checksum
from zephon_torch.ops.shuffle import SHUFFLE_ALGORITHMS
from zephon_torch.pipeline import Pipeline

N = 240
CHUNK = 4
K = 2  # flush_every_k_chunks: an epoch is 8 records of a lane


def _pipe(size: int, *, lanes: int = 2, algorithm: str = "streaming", seed: int = 7,
          batch: int = 3) -> Pipeline:
    return (Pipeline.from_items([f"d{i}" for i in range(N)], num_lanes=lanes, chunk_size=CHUNK,
                                flush_every_k_chunks=K, seed=1, shuffle=True)
            .shuffle(size, seed=seed, algorithm=algorithm)
            .batch(batch))


def _keys(batches: list[Any]) -> dict[int, list[tuple]]:
    """Each lane's records (cursor keys), in the order the caller received them."""
    out: dict[int, list[tuple]] = {}
    for b in batches:
        for r in b.records:
            out.setdefault(r.meta.lane_id, []).append(r.meta.as_cursor_key())
    return out


def _run(pipe: Pipeline, state: dict[str, Any] | None = None, steps: int | None = None,
         **kwargs: Any) -> tuple[list[Any], dict[str, Any] | None]:
    it = pipe.iter(runner=kwargs.pop("runner", "inline"), **kwargs)
    if state is not None:
        it.load_state_dict(state)
    if steps is None:
        out, saved = list(it), None
    else:
        out = [next(it) for _ in range(steps)]
        saved = it.state_dict()
    it.close()
    return out, saved


def _expected(old: Pipeline, new: Pipeline, head: list[Any]) -> dict[int, list[tuple]]:
    """Per lane: the saved run's epochs up to the cursor's, the new run's after it."""
    before, after = _keys(_run(old)[0]), _keys(_run(new)[0])
    done = _keys(head)
    out = {}
    for lane in sorted(set(before) | set(after)):
        seen = done.get(lane, [])
        switch = seen[-1][0] // K + 1 if seen else 0  # the first epoch of the new size
        out[lane] = ([k for k in before.get(lane, []) if k[0] // K < switch]
                     + [k for k in after.get(lane, []) if k[0] // K >= switch])
    return out


CASES = [  # (lanes, saved buffer_size, new buffer_size)
    (2, 8, 20),   # 4 rows a lane -> 10 (more than an epoch holds)
    (2, 20, 6),
    (3, 12, 6),
    (1, 5, 3),
]


@pytest.mark.parametrize("algorithm", SHUFFLE_ALGORITHMS)
@pytest.mark.parametrize(("lanes", "before", "after"), CASES)
@pytest.mark.parametrize("steps", [0, 1, 4, 11, 30])
def test_a_changed_buffer_size_resumes_as_a_run_that_changed_it_at_the_next_epoch(
        algorithm: str, lanes: int, before: int, after: int, steps: int) -> None:
    old = _pipe(before, lanes=lanes, algorithm=algorithm)
    new = _pipe(after, lanes=lanes, algorithm=algorithm)
    head, state = _run(old, steps=steps)
    rest, _ = _run(new, state)
    expected = _expected(old, new, head)
    done, got = _keys(head), _keys(rest)
    for lane, keys in expected.items():
        seen = done.get(lane, [])
        assert keys[:len(seen)] == seen, lane
        assert got.get(lane, []) == keys[len(seen):], lane
    every = [k for keys in _keys(head + rest).values() for k in keys]
    # Every sample once (batch(drop_last=True) drops each lane's last few as a whole run
    # would; the expectation drops the same).
    assert len(every) == len(set(every)) == sum(len(keys) for keys in expected.values())
    assert len(every) > N - 3 * lanes


def test_the_expectation_differs_from_both_unchanged_runs() -> None:
    # The reference is neither run alone: the switch sits inside the stream.
    old, new = _pipe(8), _pipe(20)
    head, _ = _run(old, steps=11)
    expected = _expected(old, new, head)
    assert expected != _keys(_run(old)[0])
    assert expected != _keys(_run(new)[0])


@pytest.mark.parametrize("algorithm", SHUFFLE_ALGORITHMS)
@pytest.mark.parametrize(("lanes", "before", "after"), [(2, 8, 20), (3, 12, 6)])
def test_the_changed_pipeline_restores_at_every_step(algorithm: str, lanes: int, before: int,
                                                     after: int) -> None:
    old = _pipe(before, lanes=lanes, algorithm=algorithm)
    new = _pipe(after, lanes=lanes, algorithm=algorithm)
    _, state = _run(old, steps=9)
    rest, _ = _run(new, state)
    it = new.iter(runner="inline")
    it.load_state_dict(state)
    for step in range(len(rest) + 1):
        again = json.loads(json.dumps(it.state_dict()))
        assert _keys(_run(new, again)[0]) == _keys(rest[step:]), step
        if step < len(rest):
            assert _keys([next(it)]) == _keys([rest[step]])
    it.close()


def test_a_state_saved_after_the_change_carries_the_saved_size_while_its_window_needs_it(
        ) -> None:
    old, new = _pipe(8), _pipe(20)
    _, state = _run(old, steps=5)
    it = new.iter(runner="inline")
    it.load_state_dict(state)
    entries = []
    for _ in range(40):
        entries.append(it.state_dict())
        next(it)
    it.close()
    first = entries[0]["lanes"]
    assert first["0"]["earlier_ops"] == {"ops[0]": [[4, {"buffer_size": 8}]]}
    assert entries[0]["fingerprint"]["ops[0].buffer_size"] == "20"
    # Once a lane's window has passed the switch, its entry is plain again.
    last = entries[-1]["lanes"]
    assert all("earlier_ops" not in entry for entry in last.values())
    plain, _ = _run(new, entries[-1])
    assert plain  # a state saved with the new size resumes with it as any other


def test_the_switch_follows_the_cursor_not_the_read_ahead() -> None:
    old, new = _pipe(8, lanes=2), _pipe(20, lanes=2)
    _, state = _run(old, steps=7)
    inline, _ = _run(new, state)
    threads, _ = _run(new, state, runner="threads", num_workers=3)
    assert _keys(threads) == _keys(inline)
    lanes, _ = _run(new, state, runner="lanes", num_workers=2)  # lane workers resume it too
    assert _keys(lanes) == _keys(inline)
    _, state_threads = _run(old, steps=7, runner="threads", num_workers=3)
    assert _keys(_run(new, state_threads)[0]) == _keys(inline)


def test_a_second_change_and_a_change_back_resume_too() -> None:
    a, b, c = _pipe(8), _pipe(20), _pipe(6)
    head, state = _run(a, steps=6)
    mid, state_b = _run(b, state, steps=0)  # saved at once: still all of a's windows
    rest, _ = _run(c, state_b)
    every = [k for keys in _keys(head + mid + rest).values() for k in keys]
    assert len(every) == len(set(every)) == N  # 120 a lane: no remainder to drop
    # The state saved at once resumes under b exactly as the first state did.
    assert _keys(_run(b, state_b)[0]) == _keys(_run(b, state)[0])
    back, _ = _run(a, state_b)
    assert _keys(back) == _keys(_run(a, state)[0])  # back to a: the unchanged run


@pytest.mark.parametrize(("changed", "named"), [
    (lambda: _pipe(8, seed=8), "shuffle (seed 7 -> 8)"),
    (lambda: _pipe(20, seed=8), "seed 7 -> 8"),
    (lambda: _pipe(8, algorithm="block"), "algorithm"),
])
def test_a_changed_seed_or_algorithm_is_still_refused(changed: Any, named: str) -> None:
    _, state = _run(_pipe(8), steps=5)
    with pytest.raises(ValueError, match="different pipeline configuration") as refused:
        _run(changed(), state)
    assert named in str(refused.value)


def _edited(state: dict[str, Any], lane: str, value: Any) -> dict[str, Any]:
    edited = json.loads(json.dumps(state))
    edited["lanes"][lane]["earlier_ops"] = value
    edited["checksum"] = state_checksum(edited)
    return edited


@pytest.mark.parametrize(("value", "why"), [
    ({"ops[1]": [[4, {"buffer_size": 8}]]}, "no operator of this pipeline"),
    ({"ops[0]": [[3, {"buffer_size": 8}]]}, "not an epoch boundary"),
    ({"ops[0]": [[4, {"seed": 8}]]}, "parameters among ['buffer_size']"),
    ({"ops[0]": []}, "holds no"),
    ([], "not a non-empty dict"),
])
def test_an_edited_earlier_ops_is_refused(value: Any, why: str) -> None:
    _, state = _run(_pipe(8), steps=5)
    it = _pipe(20).iter(runner="inline")
    it.load_state_dict(state)
    saved = it.state_dict()
    it.close()
    with pytest.raises(ValueError, match="corrupted state: lane 0: 'earlier_ops'") as refused:
        _run(_pipe(20), _edited(saved, "0", value))
    assert why in str(refused.value)


def test_ranks_resume_their_lanes_of_a_changed_state() -> None:
    old, new = _pipe(12, lanes=4), _pipe(8, lanes=4)
    head, state = _run(old, steps=9)
    whole, _ = _run(new, state)
    got: dict[int, list[tuple]] = {}
    for rank in range(2):
        part, _ = _run(new, state, rank=rank, world_size=2)
        got.update(_keys(part))
    assert got == _keys(whole)
    expected = _expected(old, new, head)
    done = _keys(head)
    assert got == {lane: keys[len(done.get(lane, [])):] for lane, keys in expected.items()}
