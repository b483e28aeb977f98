"""``runner="lanes"``: worker processes that each run the whole pipeline of some lanes.

Every comparison is against the inline runner, exactly (metas and payloads).
The workers, their pipes and shared-memory segments are real; the module's
leak check (conftest) makes sure none is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from harness import assert_conserved, assert_same, collect

import zephon_torch as zt
from zephon_torch.runners import lanes as lanes_mod
from zephon_torch.runners import shm
from zephon_torch.runners.iterator import PipelineIterator
from zephon_torch.topology import deal_lanes

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


def _texts(n: int) -> list[str]:
    return [f"doc {i} " + "word " * (i % 7) for i in range(n)]


def _pipe(n: int = 90, num_lanes: int = 4, **config: Any) -> zt.Pipeline:
    config.setdefault("chunk_size", 4)
    config.setdefault("flush_every_k_chunks", 2)
    return (zt.Pipeline.from_items(_texts(n), num_lanes=num_lanes, **config)
            .map_transform(lambda p: {**p, "n": len(p["text"])})
            .shuffle(6 * num_lanes, seed=3).batch(3, drop_last=False))


def _segments() -> list[str]:
    return [n for n in os.listdir(shm.segment_dir())
            if n.startswith(f"{shm.SEGMENT_PREFIX}{os.getpid()}-")]


def _gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") for pid in pids):
            return True
        time.sleep(0.05)
    return False


# --------------------------------------------------------------------------- output


def test_workers_are_dealt_the_lanes_at_positions_w_w_plus_n():
    assert deal_lanes([1, 3, 5, 7, 9], 2) == [[1, 5, 9], [3, 7]]
    assert deal_lanes([0, 1], 3) == [[0], [1], []]


@pytest.mark.parametrize("num_lanes", [4, 8])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_output_equals_inline_for_every_worker_count(num_lanes, workers):
    pipe = _pipe(num_lanes=num_lanes)
    reference = collect(pipe, runner="inline")
    assert_same(reference, collect(pipe, runner="lanes", num_workers=workers),
                label=f"{workers} workers over {num_lanes} lanes")


def test_records_without_a_batch_stage_come_out_as_inline():
    pipe = zt.Pipeline.from_items(_texts(50), num_lanes=3, chunk_size=4).map_transform(
        lambda p: {**p, "n": 1})
    assert_same(collect(pipe, runner="inline"), collect(pipe, runner="lanes", num_workers=2))


def test_more_workers_than_lanes_warn_once_and_start_one_worker_per_lane():
    pipe = _pipe(num_lanes=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = pipe.iter(runner="lanes", num_workers=5)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "5 workers but this rank owns 2 lane(s): 3 worker(s) get no lane" in messages[0]
    try:
        first = next(it)
        assert len(it.worker_pids()) == 2
        assert_same(collect(pipe, runner="inline"), [first, *it])
    finally:
        it.close()


def test_a_rank_runs_only_its_lanes_in_its_workers():
    pipe = _pipe(num_lanes=8)
    for rank in (0, 1):
        assert_same(collect(pipe, runner="inline", rank=rank, world_size=2),
                    collect(pipe, runner="lanes", num_workers=3, rank=rank, world_size=2),
                    label=f"rank {rank}")


def test_stats_are_those_of_the_inline_runner(corpus_dir, tokenizer):
    def build() -> zt.Pipeline:  # afresh for each run: a dataset caches what it read
        return (zt.Pipeline.from_jsonl(str(corpus_dir / "web" / "*.jsonl"), num_lanes=4,
                                       chunk_size=16, flush_every_k_chunks=2)
                .fetch().decode_text().tokenize(tokenizer).pack_flat(64).batch(4))

    stats = {}
    for runner, kwargs in (("inline", {}), ("lanes", {"num_workers": 3})):
        it = build().iter(runner=runner, **kwargs)
        try:
            list(it)
            stats[runner] = it.stats()
        finally:
            it.close()
    inline, lanes = stats["inline"], stats["lanes"]
    for key in ("lanes", "read", "delivered", "tombstoned", "sample_bytes", "stages",
                "bad_samples"):
        assert lanes[key] == inline[key], key
    # What the workers read is counted: at least what one process reads (each worker
    # reads the parts of the files its lanes need, and a file's lanes may be in several).
    assert lanes["bytes_read"] >= inline["bytes_read"] > 0


def test_every_sample_is_closed_exactly_once():
    stats = assert_conserved(_pipe(), runner="lanes", num_workers=3, verify=True)
    assert stats["read"] == 90


# --------------------------------------------------------------------------- states


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_the_state_after_every_item_resumes_exactly_although_workers_run_ahead(workers):
    pipe = _pipe(60)
    reference = collect(pipe, runner="inline")
    inline = pipe.iter(runner="inline")
    lanes = PipelineIterator(pipe, runner="lanes", num_workers=workers, prefetch=8)

    def assert_position(state: dict, step: int, *, ended: bool = False) -> None:
        want = inline.state_dict()
        # What was handed out per lane, and the round-robin, are the inline runner's;
        # a lane's window may differ (its chunks registered ahead, here or in a worker).
        assert {k: v["outputs"] for k, v in state["lanes"].items()} == {
            k: v["outputs"] for k, v in want["lanes"].items()}, f"after item {step}"
        if not ended:  # once every lane has ended, where the round-robin stopped is moot
            assert state["round_robin"] == want["round_robin"], f"after item {step}"
        resumed = pipe.iter(runner="inline")
        try:
            resumed.load_state_dict(json.loads(json.dumps(state)))
            assert_same(reference[step + 1:], list(resumed), label=f"after item {step}")
        finally:
            resumed.close()

    try:
        assert lanes.state_dict() == inline.state_dict()
        for step, want in enumerate(inline):
            got = next(lanes)
            assert_same([want], [got], label=f"item {step}")
            assert_position(lanes.state_dict(), step)
        with pytest.raises(StopIteration):
            next(lanes)
        assert_position(lanes.state_dict(), len(reference) - 1, ended=True)
    finally:
        inline.close()
        lanes.close()


@pytest.mark.parametrize("saved_with, resumed_with", [
    (2, {"runner": "lanes", "num_workers": 3}),
    (3, {"runner": "lanes", "num_workers": 1}),
    (4, {"runner": "inline"}),
    (1, {"runner": "threads", "num_workers": 2}),
])
def test_a_state_saved_with_n_workers_resumes_with_m_workers_or_another_runner(
        saved_with, resumed_with):
    pipe = _pipe(num_lanes=8)
    reference = collect(pipe, runner="inline")
    for cut in (0, 5, 17, len(reference) - 1):
        it = pipe.iter(runner="lanes", num_workers=saved_with)
        try:
            head = [next(it) for _ in range(cut)]
            state = json.loads(json.dumps(it.state_dict()))
        finally:
            it.close()
        resumed = pipe.iter(**resumed_with)
        try:
            resumed.load_state_dict(state)
            rest = list(resumed)
        finally:
            resumed.close()
        assert_same(reference, head + rest, label=f"cut {cut}")


def test_an_epoch_runs_in_the_workers_as_inline_and_its_state_resumes_there():
    pipe = _pipe(num_lanes=4)
    reference = collect(pipe, runner="inline", epoch=2)
    assert_same(reference, collect(pipe, runner="lanes", num_workers=2, epoch=2))
    it = pipe.iter(runner="lanes", num_workers=3, epoch=2)
    try:
        head = [next(it) for _ in range(9)]
        state = json.loads(json.dumps(it.state_dict()))
    finally:
        it.close()
    resumed = pipe.iter(runner="lanes", num_workers=2)  # the state's epoch is taken
    try:
        resumed.load_state_dict(state)
        assert_same(reference, head + list(resumed))
    finally:
        resumed.close()


def test_a_state_loaded_and_saved_before_any_item_is_the_loaded_position():
    pipe = _pipe()
    it = pipe.iter(runner="inline")
    head = [next(it) for _ in range(7)]
    state = it.state_dict()
    it.close()
    resumed = pipe.iter(runner="lanes", num_workers=2)
    try:
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        again = pipe.iter(runner="inline")
        again.load_state_dict(resumed.state_dict())
        assert_same(collect(pipe, runner="inline"), head + list(again))
    finally:
        resumed.close()


# --------------------------------------------------------------------------- start-up


def _slow_unless_lane_0(payload: dict) -> dict:
    # Documents 0-3 are lane 0's chunk; the other lanes take 4 s each.
    if int(payload["text"].split()[1]) >= 4:
        time.sleep(1.0)
    return payload


def test_the_first_item_comes_as_soon_as_lane_0_has_one():
    pipe = (zt.Pipeline.from_items(_texts(16), num_lanes=4, chunk_size=4)
            .map_transform(_slow_unless_lane_0))
    it = pipe.iter(runner="lanes", num_workers=4)
    try:
        started = time.monotonic()
        first = next(it)
        assert time.monotonic() - started < 2.5  # start-up, not lanes 1-3's 4 s
        assert first.payload["text"].startswith("doc 0 ")
        it.start()  # idempotent once running
    finally:
        it.close()


def _imports(payload: dict) -> dict:
    return {**payload, "torch": "torch" in sys.modules, "pid": os.getpid()}


def test_spawned_workers_import_no_torch_and_give_the_same_output(monkeypatch):
    monkeypatch.setenv("ZEPHON_LANES_START_METHOD", "spawn")
    assert lanes_mod.start_method() == "spawn"
    pipe = zt.Pipeline.from_items(_texts(24), num_lanes=2, chunk_size=4).map_transform(_imports)
    out = collect(pipe, runner="lanes", num_workers=2)
    assert [r.meta for r in out] == [r.meta for r in collect(pipe, runner="inline")]
    assert not any(r.payload["torch"] for r in out)
    assert len({r.payload["pid"] for r in out}) == 2
    assert os.getpid() not in {r.payload["pid"] for r in out}


def test_a_bad_start_method_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ZEPHON_LANES_START_METHOD", "thread")
    with pytest.raises(ValueError, match=r"ZEPHON_LANES_START_METHOD='thread': use one of"):
        lanes_mod.start_method()


_NO_GUARD = textwrap.dedent("""
    import zephon_torch as zt

    texts = [f"doc {i}" for i in range(40)]
    pipe = zt.Pipeline.from_items(texts, num_lanes=4, chunk_size=4).map_transform(
        lambda p: {"text": p["text"].upper()}).batch(2)
    lanes = [[r.payload["text"] for r in b] for b in pipe.iter(runner="lanes", num_workers=2)]
    inline = [[r.payload["text"] for r in b] for b in pipe.iter(runner="inline")]
    print("same" if lanes == inline else "different", len(lanes))
""")


def test_a_script_without_a_main_guard_runs_with_forked_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_NO_GUARD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ZEPHON_LANES_START_METHOD", None)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["same", "20"]


# --------------------------------------------------------------------------- faults


class Boom(ValueError):
    pass


def _raise_at_13(payload: dict) -> dict:
    if payload["text"].startswith("doc 13 "):
        raise Boom("document 13 is bad")
    return payload


def test_an_error_in_a_worker_reaches_the_caller_with_its_type_and_traceback():
    pipe = zt.Pipeline.from_items(_texts(40), num_lanes=4, chunk_size=4).map_transform(
        _raise_at_13)
    it = pipe.iter(runner="lanes", num_workers=2)
    got = []
    with pytest.raises(Boom, match="document 13 is bad") as info:
        for record in it:
            got.append(record)
    assert "lane worker" in str(info.value.__cause__)
    assert got and all(not r.payload["text"].startswith("doc 13 ") for r in got)
    assert _gone(it.worker_pids())
    assert _segments() == []


def _exit_at_21(payload: dict) -> dict:
    if payload["text"].startswith("doc 21 "):
        os._exit(3)
    return payload


def test_a_worker_that_dies_is_named_and_the_run_is_reaped():
    pipe = zt.Pipeline.from_items(_texts(40), num_lanes=4, chunk_size=4).map_transform(
        _exit_at_21)
    it = pipe.iter(runner="lanes", num_workers=2)
    with pytest.raises(RuntimeError, match=r"zephon lane worker 1 \(pid \d+, lanes \[1, 3\]\) "
                                           r"exited with code 3 before the end of its lanes"):
        list(it)
    assert _gone(it.worker_pids())
    assert _segments() == []


def test_close_mid_run_reaps_the_workers_and_their_segments():
    it = PipelineIterator(_pipe(200), runner="lanes", num_workers=3, prefetch=16)
    next(it)
    pids = it.worker_pids()
    assert len(pids) == 3
    time.sleep(0.3)  # the workers fill their credits
    it.close()
    assert _gone(pids)
    assert _segments() == []
    with pytest.raises(StopIteration):
        next(it)


def test_dropping_an_unfinished_iterator_reaps_its_workers():
    it = _pipe(200).iter(runner="lanes", num_workers=2)
    next(it)
    pids = it.worker_pids()
    del it
    import gc

    gc.collect()
    assert _gone(pids)
    assert _segments() == []


_KILLED = textwrap.dedent("""
    import os, sys, time
    import zephon_torch as zt

    texts = [f"doc {i} " + "w " * 50 for i in range(4000)]
    pipe = zt.Pipeline.from_items(texts, num_lanes=4, chunk_size=8).batch(2)
    it = pipe.iter(runner="lanes", num_workers=2)
    next(it)
    time.sleep(0.5)
    print(" ".join(map(str, it.worker_pids())), flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_workers_of_a_main_process_that_is_killed_exit_and_leave_no_segments(tmp_path, how):
    script = tmp_path / "main.py"
    script.write_text(_KILLED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.strip(), proc.stderr.read()
    pids = [int(p) for p in line.split()]
    proc.send_signal(how)
    proc.wait(timeout=30)
    assert proc.returncode == -how
    assert _gone(pids)
    prefix = f"{shm.SEGMENT_PREFIX}{proc.pid}-"
    assert [n for n in os.listdir(shm.segment_dir()) if n.startswith(prefix)] == []
