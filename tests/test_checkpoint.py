"""Checkpoints: exact resume at every cut point, bounded replay, elastic resume, errors."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from harness import assert_restores_everywhere, assert_same, collect, per_lane
from test_determinism import CONFIG, PIPELINES, full_chain

import zephon_torch as zt
from zephon_torch.checkpoint import merge_states
from zephon_torch.pipeline import Pipeline

K, CHUNK = CONFIG["flush_every_k_chunks"], CONFIG["chunk_size"]


def items_pipe(n: int = 80, **config: Any) -> Pipeline:
    config.setdefault("num_lanes", 3)
    config.setdefault("chunk_size", 4)
    texts = [f"doc {i} " + "word " * (i % 9) for i in range(n)]
    return zt.Pipeline.from_items(texts, **config)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_operator_restores_exactly_at_random_cut_points(
        name: str, corpus_dir: Path, tokenizer: Any) -> None:
    pipe = PIPELINES[name](corpus_dir, tokenizer)
    total = len(collect(pipe, runner="inline"))
    rng = random.Random(name)
    cuts = sorted(rng.sample(range(total + 1), min(total + 1, 12)))
    assert_restores_everywhere(
        pipe, cut_points=cuts,
        resume_settings=[{"runner": "inline"}, {"runner": "threads", "num_workers": 2}],
        max_replayed_per_lane=max(K, 1) * CHUNK,
    )


@pytest.mark.parametrize("algorithm", ["streaming", "block", "block_warmup"])
@pytest.mark.parametrize("drop_last", [True, False])
def test_full_chain_restores_at_every_cut_point(
        algorithm: str, drop_last: bool, corpus_dir: Path, tokenizer: Any) -> None:
    pipe = full_chain(corpus_dir, tokenizer, drop_last=drop_last, algorithm=algorithm)
    assert_restores_everywhere(
        pipe, resume_settings=[{"runner": "inline"}, {"runner": "threads", "num_workers": 3}],
        max_replayed_per_lane=K * CHUNK,
    )


def test_resume_on_the_process_runner(corpus_dir: Path, tokenizer: Any) -> None:
    pipe = full_chain(corpus_dir, tokenizer)
    assert_restores_everywhere(pipe, cut_points=[0, 7, 23],
                               resume_settings=[{"runner": "process", "num_workers": 2}])


@pytest.mark.parametrize("num_lanes", [4, 8])
def test_lane_workers_restore_at_every_step_and_across_worker_counts(
        num_lanes: int, corpus_dir: Path, tokenizer: Any) -> None:
    pipe = full_chain(corpus_dir, tokenizer).with_source(num_lanes=num_lanes)
    assert_restores_everywhere(
        pipe, runner="lanes", num_workers=2,
        resume_settings=[{"runner": "lanes", "num_workers": 3}, {"runner": "inline"},
                         {"runner": "lanes", "num_workers": 1},
                         {"runner": "lanes", "num_workers": 4}],
        max_replayed_per_lane=K * CHUNK,
    )


@pytest.mark.parametrize("flush_every", [None, 1, 3])
def test_several_passes_and_many_epochs_restore_exactly(flush_every: int | None) -> None:
    pipe = (items_pipe(40, passes=3, flush_every_k_chunks=flush_every, shuffle=True)
            .map_transform(lambda p: {**p, "n": len(p["text"])})
            .shuffle(3 * 6, seed=2).batch(4, drop_last=True))  # 6 rows a lane
    assert_restores_everywhere(pipe, max_replayed_per_lane=max(flush_every or 8, 1) * 4)


def test_order_preserving_plans_replay_at_most_one_chunk() -> None:
    pipe = items_pipe().batch(3, drop_last=True)
    assert pipe.flush_every() == 0
    assert_restores_everywhere(pipe, max_replayed_per_lane=4)


def test_the_state_reflects_what_the_caller_received() -> None:
    pipe = items_pipe().shuffle(3 * 8, seed=0).batch(2)
    it = pipe.iter(runner="threads", num_workers=2)
    head = [next(it) for _ in range(5)]
    for _ in range(20):  # let the engine run ahead: it must not move the state
        it._pump()
    state = it.state_dict()
    it.close()
    again = pipe.iter(runner="inline")
    again.load_state_dict(state)
    assert_same(collect(pipe, runner="inline"), head + list(again))


def test_state_is_small_json_and_bounded_by_the_window() -> None:
    pipe = items_pipe(2000, chunk_size=8).shuffle(3 * 16).batch(4)
    sizes = []
    it = pipe.iter(runner="inline")
    for step, _ in enumerate(it):
        if step in (10, 150, 300):
            sizes.append(len(json.dumps(it.state_dict())))
    assert max(sizes) < 2 * min(sizes)  # deep in the corpus, no bigger
    assert max(sizes) < 4000


def test_elastic_resume_on_other_world_sizes() -> None:
    # 18 rows over 4 lanes: ceil(18 / 4) = 5 a lane, whatever the ranks own
    pipe = items_pipe(120, num_lanes=4, flush_every_k_chunks=2).shuffle(18).batch(2)
    reference = per_lane(collect(pipe, runner="inline"))
    states, heads = [], {}
    for rank in range(2):
        it = pipe.iter(runner="inline", rank=rank, world_size=2)
        got = [next(it) for _ in range(7 + rank)]
        states.append(it.state_dict())
        it.close()
        for lane, items in per_lane(got).items():
            heads[lane] = items
    merged = json.loads(json.dumps(merge_states(states)))
    for world in (1, 3, 4):
        lanes: dict[int, list] = {}
        for rank in range(world):
            it = pipe.iter(runner="inline", rank=rank, world_size=world)
            it.load_state_dict(merged)
            for lane, items in per_lane(list(it)).items():
                lanes[lane] = items
        for lane, items in reference.items():
            assert_same(items, heads.get(lane, []) + lanes.get(lane, []),
                        label=f"world {world} lane {lane}")


def test_global_order_when_world_size_divides_num_lanes() -> None:
    pipe = items_pipe(96, num_lanes=4).batch(2)
    single = collect(pipe, runner="inline")
    for world in (2, 4):
        per_rank = [collect(pipe, runner="inline", rank=r, world_size=world)
                    for r in range(world)]
        steps = min(len(p) for p in per_rank)
        for t in range(steps):
            expected = single[world * t: world * t + world]
            got = sorted((per_rank[r][t] for r in range(world)), key=lambda b: b.lane_ids[0])
            assert_same(sorted(expected, key=lambda b: b.lane_ids[0]), got, f"step {t}")


def test_same_topology_restores_the_round_robin_position() -> None:
    pipe = items_pipe().batch(2, drop_last=False)
    it = pipe.iter(runner="inline")
    head = [next(it) for _ in range(4)]  # stops in the middle of a round
    state = it.state_dict()
    it.close()
    resumed = pipe.iter(runner="inline")
    resumed.load_state_dict(state)
    assert_same(collect(pipe, runner="inline"), head + list(resumed))


# ---------------------------------------------------------------- errors


def saved_state(pipe: Pipeline, steps: int = 3) -> dict:
    it = pipe.iter(runner="inline")
    for _ in range(steps):
        next(it)
    state = it.state_dict()
    it.close()
    return state


def test_fingerprint_mismatch_names_what_differs() -> None:
    state = saved_state(items_pipe().batch(2))
    # (The batch size may change on resume: tests/test_resume_changes.py.)
    with pytest.raises(ValueError, match=r"ops\.count \(1 operators -> 2\)"):
        items_pipe().shuffle(4).batch(2).iter(runner="inline").load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        items_pipe(seed=5).batch(2).iter(runner="inline").load_state_dict(state)
    with pytest.raises(ValueError, match="chunk_size"):
        items_pipe(chunk_size=5).batch(2).iter(runner="inline").load_state_dict(state)


def test_unknown_version_corruption_and_missing_lanes_are_clear_errors() -> None:
    pipe = items_pipe(num_lanes=4).batch(2)
    state = saved_state(pipe)
    with pytest.raises(ValueError, match="unknown state version 99"):
        pipe.iter(runner="inline").load_state_dict({**state, "version": 99})
    edited = json.loads(json.dumps(state))
    edited["lanes"]["0"]["outputs"] += 1
    with pytest.raises(ValueError, match="checksum"):
        pipe.iter(runner="inline").load_state_dict(edited)
    with pytest.raises(ValueError, match="corrupted state"):
        pipe.iter(runner="inline").load_state_dict({"version": 1, "lanes": []})
    rank_state = saved_state(pipe.with_source(), steps=2)
    it = pipe.iter(runner="inline", rank=0, world_size=2)
    head = it.state_dict()
    it.close()
    with pytest.raises(ValueError, match=r"no entry for lane\(s\) \[1, 3\]"):
        pipe.iter(runner="inline").load_state_dict(head)
    assert rank_state["lanes"]


def test_merge_rejects_overlapping_lanes() -> None:
    pipe = items_pipe(num_lanes=4).batch(2)
    state = saved_state(pipe)
    with pytest.raises(ValueError, match="appears in two states"):
        merge_states([state, state])


def test_load_after_iterating_is_refused() -> None:
    pipe = items_pipe().batch(2)
    state = saved_state(pipe)
    it = pipe.iter(runner="inline")
    next(it)
    with pytest.raises(RuntimeError, match="before iterating"):
        it.load_state_dict(state)
    it.close()


def test_a_replay_that_cannot_meet_its_cursor_raises_naming_the_lane() -> None:
    pipe = items_pipe(num_lanes=2, flush_every_k_chunks=2).shuffle(2 * 4).batch(2)
    it = pipe.iter(runner="inline")
    for _ in range(3):
        next(it)
    state = it.state_dict()
    it.close()
    lane = next(k for k, v in state["lanes"].items() if v["replay_cursor"] is not None)
    # A count the load cannot check (an edited cursor is refused at load: see
    # tests/test_state_untrusted.py); the replay finds the cursor elsewhere.
    state["lanes"][lane]["replay_count"] += 1
    from zephon_torch.checkpoint import state_checksum

    state["checksum"] = state_checksum(state)
    resumed = pipe.iter(runner="inline")
    resumed.load_state_dict(state)
    with pytest.raises(RuntimeError, match=f"replay diverged on lane {lane}"):
        list(resumed)


# ---------------------------------------------------------------- kill and resume

_CONSUMER = textwrap.dedent("""
    import json, os, sys
    import zephon_torch as zt
    texts = [f"doc {i} " + "w " * (i % 11) for i in range(300)]
    pipe = (zt.Pipeline.from_items(texts, num_lanes=3, chunk_size=5, flush_every_k_chunks=2)
            .shuffle(3 * 7, seed=3).batch(3))
    state_path, out_path = sys.argv[1], sys.argv[2]
    it = pipe.iter(runner="inline")
    if os.path.exists(state_path):
        with open(state_path) as f:
            it.load_state_dict(json.load(f))
    for batch in it:
        with open(out_path, "a") as f:
            f.write(json.dumps([list(r.meta.sample_id) for r in batch]) + "\\n")
            f.flush()
            os.fsync(f.fileno())
        tmp = state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(it.state_dict(), f)
        os.replace(tmp, state_path)
        if os.environ.get("SLOW"):
            import time; time.sleep(0.01)
""")


def test_killed_consumer_resumes_from_its_saved_state(tmp_path: Path) -> None:
    script = tmp_path / "consumer.py"
    script.write_text(_CONSUMER)
    state, out = tmp_path / "state.json", tmp_path / "out.jsonl"
    reference = tmp_path / "ref.jsonl"
    subprocess.run([sys.executable, str(script), str(tmp_path / "ref-state"), str(reference)],
                   check=True, timeout=120)
    proc = subprocess.Popen([sys.executable, str(script), str(state), str(out)],
                            env={**os.environ, "SLOW": "1"})
    deadline = 60
    import time

    start = time.time()
    while (not out.exists() or len(out.read_text().splitlines()) < 20):
        if time.time() - start > deadline:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # A step is "consumed" once the state after it is saved: keep exactly those lines.
    saved = json.loads(state.read_text())
    consumed = sum(v["outputs"] for v in saved["lanes"].values())
    lines = out.read_text().splitlines()[:consumed]
    out.write_text("".join(line + "\n" for line in lines))
    subprocess.run([sys.executable, str(script), str(state), str(out)], check=True, timeout=120)
    assert out.read_text() == reference.read_text()


def test_saving_right_after_a_restore_or_a_few_items_later_resumes_exactly() -> None:
    pipe = items_pipe(120, flush_every_k_chunks=2).shuffle(3 * 5).batch(2)
    reference = collect(pipe, runner="inline")
    for k in range(0, len(reference), 4):
        it = pipe.iter(runner="inline")
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(it.state_dict()))
        it.close()
        again = pipe.iter(runner="inline")
        again.load_state_dict(state)
        assert not again.started
        chained = json.loads(json.dumps(again.state_dict()))  # before any item
        middle = [next(again) for _ in range(min(2, len(reference) - k))]
        later = again.state_dict()
        again.close()
        for saved, got in ((chained, []), (later, middle)):
            resumed = pipe.iter(runner="inline")
            resumed.load_state_dict(saved)
            assert_same(reference, head + got + list(resumed), label=f"k={k}")


def test_chained_checkpoints_in_random_configurations() -> None:
    rng = random.Random(7)
    for trial in range(12):
        n, lanes, chunk = rng.randint(20, 90), rng.randint(1, 4), rng.randint(1, 8)
        period, size = rng.choice([None, 1, 2, 8]), rng.randint(1, 4)
        pipe = (zt.Pipeline.from_items([f"d{i} " + "x " * (i % 5) for i in range(n)],
                                       num_lanes=lanes, chunk_size=chunk,
                                       flush_every_k_chunks=period)
                # 2 to 10 rows a lane (buffer_size is shared by the lanes; 1 is refused)
                .shuffle(rng.randint(lanes + 1, 10 * lanes), seed=trial)
                .batch(size, drop_last=rng.random() < .5))
        reference = collect(pipe, runner="inline")
        for k in sorted(rng.sample(range(len(reference) + 1), min(3, len(reference) + 1))):
            it = pipe.iter(runner="inline")
            head = [next(it) for _ in range(k)]
            state = json.loads(json.dumps(it.state_dict()))
            it.close()
            for extra in (0, 1, 3):
                first = pipe.iter(runner="inline")
                first.load_state_dict(state)
                middle = [next(first) for _ in range(min(extra, len(reference) - k))]
                second_state = json.loads(json.dumps(first.state_dict()))
                first.close()
                second = pipe.iter(runner="inline")
                second.load_state_dict(second_state)
                assert_same(reference, head + middle + list(second),
                            label=f"trial {trial}, cut {k}, then {extra}")


def test_no_sentinels_with_a_reordering_operator_is_refused() -> None:
    with pytest.raises(ValueError, match=r"flush_every_k_chunks=0 .*\['shuffle'\]"):
        items_pipe(flush_every_k_chunks=0).shuffle(4).batch(2).iter(runner="inline")


@pytest.mark.parametrize("cut", [1, 255, 256, 300, 777, 856, 857])
def test_bulk_accounting_is_exact_at_any_cut(cut: int) -> None:
    # Deliveries are accounted a list at a time (every 256 records, or when
    # something reads the progress): counters and states must be exact anyway.
    items = [{"i": i} for i in range(1000)]
    pipe = Pipeline.from_items(items, num_lanes=2, chunk_size=64).map_transform(
        lambda p: p if p["i"] % 7 else None, drop_none=True)
    it = pipe.iter(runner="inline")
    head = [next(it) for _ in range(cut)]
    stats = it.stats()
    assert stats["delivered"] == cut
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    resumed = pipe.iter(runner="inline")
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert_same(collect(pipe, runner="inline"), head + rest, label=f"cut {cut}")
    assert len(head) + len(rest) == 1000 - len(range(0, 1000, 7))
