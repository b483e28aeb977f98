"""Remote stages on a real local Ray (``runners/ray.py``, ``placement="remote"``).

One local Ray instance (2 CPUs, no dashboard, a small object store) serves
the whole module; the operators below live at module level so that Ray
workers import them by reference (the fixture puts ``tests/`` on their path).
Select these tests with ``-m ray``, skip them with ``-m "not ray"``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import assert_same, collect

import zephon_torch as zt
from zephon_torch.ops.base import OpContext, Operator
from zephon_torch.ops.placement import Remote
from zephon_torch.pipeline import Pipeline
from zephon_torch.runners.process import WorkerTraceback
from zephon_torch.types import SampleRecord

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

HERE = Path(__file__).resolve().parent
CONFIG = {"num_lanes": 3, "chunk_size": 16, "flush_every_k_chunks": 2, "seed": 0}


# --------------------------------------------------------------------------- operators


def with_lengths(payload: dict) -> dict:
    """Adds an int64 array (a numpy payload for the object store) and a count."""
    ids = payload["input_ids"]
    return {**payload, "doubled": np.asarray(ids, dtype=np.int64) * 2, "n": len(ids)}


def fail_on_doc_7(payload: dict) -> dict:
    if payload["text"].startswith("doc 7 "):
        raise ValueError("cannot transform doc 7")
    return payload


class CountSetups(Operator):
    """Adds the number of ``setup`` calls its holder saw (1 on every actor)."""

    name = "count_setups"

    def __init__(self) -> None:
        self.setups = 0

    def setup(self, ctx: OpContext) -> None:
        self.setups += 1

    def process_many(self, elems):
        return [SampleRecord(e.meta, {**e.payload, "setups": self.setups}) for e in elems]


class BadSetup(Operator):
    """Its setup raises: every micro-batch reports that error."""

    name = "bad_setup"

    def setup(self, ctx: OpContext) -> None:
        raise FileNotFoundError("model weights missing: /nonexistent/model.bin")

    def process_many(self, elems):
        return list(elems)


class KillSelf(Operator):
    """SIGKILLs its own Ray worker on the record whose local id is ``marker``."""

    name = "kill_self"

    def __init__(self, marker: int) -> None:
        self.marker = marker

    def process_many(self, elems):
        if any(e.meta.sample_id[2] == self.marker for e in elems):
            os.kill(os.getpid(), signal.SIGKILL)
        return list(elems)


class KillOnce(Operator):
    """SIGKILLs its Ray worker while running the micro-batch of ``marker``, once."""

    name = "kill_once"

    def __init__(self, marker: int, flag: str) -> None:
        self.marker = marker
        self.flag = flag

    def process_many(self, elems):
        if any(e.meta.sample_id[2] == self.marker for e in elems):
            if not os.path.exists(self.flag):
                Path(self.flag).write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
        return list(elems)


class Slow(Operator):
    """Sleeps a little per micro-batch (so that work piles up)."""

    name = "slow"

    def process_many(self, elems):
        time.sleep(0.02)
        return list(elems)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance for the module; its workers import from tests/ too."""
    import ray

    assert not ray.is_initialized(), "another test left Ray running"
    paths = [str(HERE.parent), str(HERE)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 1024 * 1024,
             log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}})
    try:
        yield ray
    finally:
        ray.shutdown()


def texts(n: int = 90) -> list[str]:
    return [f"doc {i} " + "lane chunk shard " * (i % 11) + "end" for i in range(n)]


def items(n: int = 90) -> Pipeline:
    return zt.Pipeline.from_items(texts(n), **CONFIG)


def jsonl(corpus: Path) -> Pipeline:
    return Pipeline.from_jsonl(str(corpus / "web" / "*.jsonl*"), **CONFIG)


def tokenize_map(base: Pipeline, tok: Any, placement: Any, *, fused: bool = False) -> Pipeline:
    """fetch, decode, tokenize and map (placed as asked), then a shuffle and batches.

    Two remote stages with the same options are fused into one; unless
    ``fused``, the map asks for other options, so that it stays a remote
    stage of its own (Ray to Ray).
    """
    map_placement = placement
    if placement == "remote" and not fused:
        map_placement = Remote(max_retries=2)
    return (base.fetch().decode_text()
            .tokenize(tok, placement=placement)
            .map_transform(with_lengths, placement=map_placement)
            .shuffle(12, seed=1)
            .batch(3, drop_last=False))


def _wait_until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _all_gone(ray, names: list[str]) -> bool:
    for name in names:
        try:
            ray.get_actor(name)
        except ValueError:
            continue
        return False
    return True


SMALL = {"tokenize": 5, "map_transform": 4, "fetch": 7, "decode_text": 6}


# --------------------------------------------------------------------------- without Ray


def test_placement_is_validated_copied_and_left_out_of_the_fingerprint(tokenizer) -> None:
    with pytest.raises(ValueError, match=r"placement must be one of .* got 'gpu'"):
        items().map_transform(with_lengths, placement="gpu")
    with pytest.raises(ValueError, match=r"num_cpus"):
        Remote(num_cpus=-1)
    with pytest.raises(ValueError, match=r"max_in_flight"):
        Remote(max_in_flight=0)
    op = CountSetups()
    pipe = items().apply(op, placement=Remote(num_actors=2))
    assert pipe.ops[-1].placement == "remote" and pipe.ops[-1].remote_options.num_actors == 2
    assert getattr(op, "placement", "local") == "local"  # the user's object is untouched
    local = items().fetch().decode_text().tokenize(tokenizer).map_transform(with_lengths)
    remote = (items().fetch(placement="remote").decode_text(placement="remote")
              .tokenize(tokenizer, placement="remote")
              .map_transform(with_lengths, placement=Remote(num_cpus=0.5)))
    assert [o.placement for o in remote.ops] == ["remote"] * 4
    assert local.fingerprint() == remote.fingerprint()  # resumable across placements


def test_auto_started_ray_and_lazy_import(tmp_path: Path) -> None:
    """No Ray running, no RAY_ADDRESS: the iterator starts a bounded local Ray."""
    script = textwrap.dedent("""
        import json, sys
        import zephon_torch as zt
        from zephon_torch.ops.placement import Remote
        sys.path.insert(0, {tests!r})
        from test_ray import with_lengths

        texts = [f"doc {{i}} " + "x " * (i % 5) for i in range(40)]
        def ids(p):
            return {{**p, "input_ids": list(range(len(p["text"])))}}
        base = zt.Pipeline.from_items(texts, num_lanes=2, chunk_size=8).map_transform(ids)
        pipe = base.map_transform(with_lengths, placement="remote")
        before = "ray" in sys.modules
        ref = list(base.map_transform(with_lengths).iter(runner="inline"))
        out = list(pipe.iter(runner="inline"))
        from zephon_torch.runners import ray as zray
        import ray
        same = len(out) == len(ref) and all(a == b for a, b in zip(ref, out))
        cpus = ray.cluster_resources().get("CPU")
        try:
            list(base.map_transform(with_lengths, placement=Remote(num_cpus=4)).iter())
            error = None
        except ValueError as exc:
            error = str(exc)
        print(json.dumps({{"before": before, "same": same, "n": len(out),
                           "started": zray.started_by_zephon(), "cpus": cpus,
                           "error": error}}))
        zray.shutdown()
        print(json.dumps({{"after": ray.is_initialized()}}))
    """).format(tests=str(HERE))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["ZEPHON_RAY_NUM_CPUS"] = "1"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=str(HERE.parent), timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    report, after = lines
    assert report["before"] is False  # building a remote pipeline does not import ray
    assert report["same"] and report["n"] == 40
    assert report["started"] is True and report["cpus"] == 1.0
    assert "CPU=4" in report["error"] and "has 1 in all" in report["error"]
    assert after == {"after": False}


# --------------------------------------------------------------------------- identity


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_remote_tokenize_and_map_transform_match_inline(
        ray_session, runner: str, corpus_dir: Path, tokenizer: Any) -> None:
    reference = collect(tokenize_map(jsonl(corpus_dir), tokenizer, "local"), runner="inline")
    pipe = tokenize_map(jsonl(corpus_dir), tokenizer, "remote")
    it = pipe.iter(runner=runner, num_workers=2, microbatch_sizes=SMALL)
    try:
        assert it._ray_pool is not None
        remote_names = sorted(it.stage_names[i] for i in it._ray_pool.stage_indices)
        assert remote_names == ["map_transform", "tokenize"]
        out = list(it)
        stages = it.stats()["stages"]
    finally:
        it.close()
    assert_same(reference, out, label=f"remote stages, runner={runner}")
    assert stages["tokenize"]["microbatches"] > 20  # many micro-batches really went to Ray
    assert stages["shuffle"]["sentinels"] > 0  # flush sentinels crossed the remote stages
    row = out[0].records[0].payload
    assert row["input_ids"].dtype == np.int32 and row["doubled"].dtype == np.int64
    assert row["doubled"].flags.writeable  # copied out of the object store, ours to keep


def test_fused_remote_stages_match_inline(ray_session, corpus_dir: Path, tokenizer: Any) -> None:
    reference = collect(tokenize_map(jsonl(corpus_dir), tokenizer, "local"), runner="inline")
    pipe = tokenize_map(jsonl(corpus_dir), tokenizer, "remote", fused=True)
    it = pipe.iter(runner="threads", num_workers=2, microbatch_sizes=SMALL)
    try:
        assert [it.stage_names[i] for i in it._ray_pool.stage_indices] == [
            "tokenize+map_transform"]
        out = list(it)
        stages = it.stats()["stages"]
    finally:
        it.close()
    assert_same(reference, out, label="fused remote stage")
    assert stages["tokenize+map_transform"]["microbatches"] > 20


def test_remote_fetch_decode_and_applied_operator_match_inline(
        ray_session, corpus_dir: Path) -> None:
    local = jsonl(corpus_dir).fetch().decode_text().apply(CountSetups())
    remote = (jsonl(corpus_dir).fetch(placement="remote")
              .decode_text(placement=Remote(num_actors=1))
              .apply(CountSetups(), placement=Remote(num_actors=1, num_cpus=0)))
    reference = collect(local, runner="inline")
    sizes = {"fetch": 7, "decode_text": 6, "count_setups": 5}
    assert_same(reference, collect(remote, runner="threads", microbatch_sizes=sizes))
    assert {r.payload["setups"] for r in reference} == {1}


def test_remote_stage_between_process_stages_reads_lazy_payloads(
        ray_session, corpus_dir: Path, tokenizer: Any) -> None:
    # fetch and tokenize run in worker processes (their outputs are shared-memory
    # handles); decode_text and map_transform in between run on Ray.
    local = (jsonl(corpus_dir).fetch().decode_text().tokenize(tokenizer)
             .map_transform(with_lengths))
    remote = (jsonl(corpus_dir).fetch().decode_text(placement="remote").tokenize(tokenizer)
              .map_transform(with_lengths, placement="remote"))
    assert_same(collect(local, runner="inline"),
                collect(remote, runner="process", num_workers=2, microbatch_sizes=SMALL))


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("direction", ["remote->inline", "inline->remote"])
def test_resume_across_placements(ray_session, direction: str, corpus_dir: Path,
                                  tokenizer: Any) -> None:
    local = tokenize_map(jsonl(corpus_dir), tokenizer, "local")
    remote = tokenize_map(jsonl(corpus_dir), tokenizer, "remote")
    first, second = (remote, local) if direction == "remote->inline" else (local, remote)
    reference = collect(local, runner="inline")
    for cut in (0, 9, len(reference) - 2):
        it = first.iter(runner="threads", num_workers=2, microbatch_sizes=SMALL)
        try:
            head = [next(it) for _ in range(cut)]
            state = json.loads(json.dumps(it.state_dict()))
        finally:
            it.close()
        resumed = second.iter(runner="inline", microbatch_sizes=SMALL)
        try:
            resumed.load_state_dict(state)
            rest = list(resumed)
        finally:
            resumed.close()
        assert_same(reference, head + rest, label=f"{direction}, cut at {cut}")


# --------------------------------------------------------------------------- faults


def test_actor_killed_mid_run_is_restarted_and_output_is_identical(
        ray_session, corpus_dir: Path, tokenizer: Any, tmp_path: Path) -> None:
    def chain(placement: Any, kill: bool) -> Pipeline:
        pipe = jsonl(corpus_dir).fetch().decode_text().tokenize(tokenizer, placement=placement)
        if kill:  # dies inside its 3rd record's micro-batch, which is then retried
            pipe = pipe.apply(KillOnce(3, str(tmp_path / "flag")), placement=placement)
        return (pipe.map_transform(with_lengths, placement=placement)
                .shuffle(12, seed=1).batch(3, drop_last=False))

    reference = collect(chain("local", kill=False), runner="inline")
    pipe = chain(Remote(num_actors=1, num_cpus=0.5), kill=True)
    sizes = {"tokenize": 2, "map_transform": 2, "kill_once": 2}
    it = pipe.iter(runner="inline", microbatch_sizes=sizes)
    try:
        out = [next(it)]
        pool = it._ray_pool
        killed = pool.actor_pids("tokenize") + pool.actor_pids("map_transform")
        for pid in killed:  # from outside, between two next() calls
            os.kill(pid, signal.SIGKILL)
        out.extend(next(it) for _ in range(3))
        # Both actors came back in new processes (asked while the run is still going).
        restarted = pool.actor_pids("tokenize") + pool.actor_pids("map_transform")
        assert len(restarted) == 2 and not set(restarted) & set(killed)
        out.extend(it)
    finally:
        it.close()
    assert (tmp_path / "flag").exists()  # the in-task death really happened
    assert len(out) > 5
    assert_same(reference, out, label="after killing the actors")


def test_micro_batch_that_keeps_killing_its_actor_fails_clearly(ray_session) -> None:
    pipe = items(40).apply(KillSelf(marker=13), placement=Remote(num_actors=1, max_retries=1))
    with pytest.raises(RuntimeError, match=r"stage 'kill_self'.*after 1 retries"):
        collect(pipe, runner="inline", microbatch_sizes={"kill_self": 4})


def test_user_exception_keeps_type_and_message_and_is_not_retried(ray_session) -> None:
    pipe = items(40).map_transform(fail_on_doc_7, placement="remote")
    with pytest.raises(ValueError, match=r"^cannot transform doc 7$") as info:
        collect(pipe, runner="threads")
    cause = info.value.__cause__
    assert isinstance(cause, WorkerTraceback)
    assert "stage 'map_transform'" in cause.text and "fail_on_doc_7" in cause.text
    with pytest.raises(FileNotFoundError, match="model weights missing") as info:
        collect(items(10).apply(BadSetup(), placement="remote"), runner="inline")
    assert "op.setup(ctx) of stage 'bad_setup'" in info.value.__cause__.text


# --------------------------------------------------------------------------- resources


def test_no_actor_or_cpu_is_left_after_close(ray_session, tokenizer: Any) -> None:
    ray = ray_session
    total = ray.cluster_resources()["CPU"]
    pipe = (items(200).tokenize(tokenizer, placement="remote")
            .map_transform(with_lengths, placement=Remote(max_retries=2)))  # two stages
    it = pipe.iter(runner="threads", microbatch_sizes={"tokenize": 2, "map_transform": 2})
    next(it)  # stopped early, with work in flight
    names = [n for group in it._ray_pool.actor_names().values() for n in group]
    assert len(names) == 2 and not _all_gone(ray, names)
    it.close()
    it.close()  # idempotent
    assert _wait_until(lambda: _all_gone(ray, names))
    assert _wait_until(lambda: ray.available_resources().get("CPU") == total)
    # A run to the end closes itself.
    it = pipe.iter(runner="inline")
    names = [n for group in it._ray_pool.actor_names().values() for n in group]
    assert len(list(it)) == 200
    assert _wait_until(lambda: _all_gone(ray, names))
    assert _wait_until(lambda: ray.available_resources().get("CPU") == total)


def test_max_in_flight_bounds_what_is_in_ray(ray_session) -> None:
    pipe = items(120).apply(Slow(), placement=Remote(num_actors=1, max_in_flight=2))
    it = pipe.iter(runner="inline", microbatch_sizes={"slow": 2})
    try:
        stage = next(iter(it._ray_pool._core.stages.values()))
        engine_stage = it.stages[it._ray_pool.stage_indices[0]]
        seen_running, seen_engine = [0], 0
        done = threading.Event()

        def watch() -> None:  # what runs in Ray, also while the consumer waits
            while not done.is_set():
                seen_running[0] = max(seen_running[0], len(stage.running))
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        out = []
        for item in it:
            out.append(item)
            seen_running[0] = max(seen_running[0], len(stage.running))
            seen_engine = max(seen_engine, engine_stage.in_flight)
    finally:
        done.set()
        it.close()
    watcher.join()
    assert len(out) == 120
    assert seen_running[0] == 2  # the bound was reached and never passed
    # The engine stops feeding the stage at the bound too (one chunk may overshoot it).
    assert seen_engine <= 2 + CONFIG["chunk_size"] // 2
