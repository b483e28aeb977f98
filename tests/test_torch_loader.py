"""Tests for ``zephon_torch.torch.loader.DataLoader``: real torch, real processes.

Every comparison is against ``pipe.iter()`` + ``to_training`` on the inline
runner, by sample ids and tensors. The lane workers, the engine process of
``runner="process"`` and its pool workers, shared-memory segments and a
two-process gloo group are all real.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zephon_torch as zt
from zephon_torch.runners import shm
from zephon_torch.torch.loader import DataLoader

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

pytestmark = pytest.mark.timeout(120)


def _items(n: int = 40) -> list[dict[str, Any]]:
    return [{"input_ids": np.arange(i, i + 9, dtype=np.int32), "text": f"doc {i}"}
            for i in range(n)]


def _pipe(n: int = 40, num_lanes: int = 4) -> zt.Pipeline:
    # map_transform(dict) (a copy of each payload) gives the pool's workers real work;
    # a builtin keeps them from importing this module (and torch) to unpickle it.
    return (zt.Pipeline.from_items(_items(n), num_lanes=num_lanes, chunk_size=4)
            .map_transform(dict).shuffle(8, seed=1).batch(2))


def _reference(pipe: zt.Pipeline, epoch: int = 0, **to_training: Any) -> list[dict[str, Any]]:
    return [b.to_training(**to_training) for b in pipe.iter(runner="inline", epoch=epoch)]


def _assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [b["ids"] for b in got] == [b["ids"] for b in want]
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for key, value in w.items():
            if isinstance(value, torch.Tensor):
                assert g[key].dtype == value.dtype, key
                assert torch.equal(g[key].cpu(), value), key
            else:
                assert g[key] == value, key


def _segments(*owners: int) -> list[str]:
    """Shared-memory segments owned by this process (the loader's, its pools') or ``owners``.

    Segment names start with the owner's pid: the loader's transport segments
    carry the training process's, the engine's pool segments the engine's.
    """
    prefixes = tuple(f"{shm.SEGMENT_PREFIX}{pid}-" for pid in (os.getpid(), *owners))
    return [name for name in os.listdir(shm.segment_dir()) if name.startswith(prefixes)]


def _descendants(pid: int) -> set[int]:
    """Pids whose parent chain leads to ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a process, zombies included (a zombie still has /proc/<pid>)."""
    return os.path.exists(f"/proc/{pid}")


def _wait_gone(pids: set[int], timeout: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = {pid for pid in pids if _exists(pid)}
        if not alive:
            return alive
        time.sleep(0.05)
    return {pid for pid in pids if _exists(pid)}


def _engine_tree(it: Any) -> set[int]:
    """The engine process and its pool workers, once all are up; or the lane workers."""
    pid = it.engine_pid
    if pid is None:
        assert it.worker_pids
        return set(it.worker_pids)
    return {pid, *_descendants(pid)}


# Where the pipeline runs: in this process (the inline runner, or a stage-parallel runner
# with in_process=True), in lane workers (the default with workers), or in an engine process.
MODES = {
    "inline": {"num_workers": 0},
    "in_process": {"in_process": True, "runner": "process", "num_workers": 2},
    "engine": {"runner": "process", "num_workers": 1},
    "lanes": {"num_workers": 2},
}


def _assert_clean(tree: set[int]) -> None:
    assert _wait_gone(tree) == set(), "engine or pool processes left behind"
    assert multiprocessing.active_children() == []
    assert _segments(*tree) == []


# --------------------------------------------------------------------------- output


@pytest.mark.parametrize("mode", [*MODES, "lanes-1", "lanes-3", "lanes-8"])
def test_output_equals_the_pipeline_iterator_with_to_training(mode):
    pipe = _pipe()
    kwargs = MODES.get(mode) or {"num_workers": int(mode.split("-")[1])}
    with DataLoader(pipe, **kwargs) as loader:
        got = list(loader)
    _assert_same(got, _reference(pipe))
    assert len(got) == 20
    assert _segments() == []


def test_lane_workers_are_the_default_with_workers_and_each_owns_its_lanes():
    loader = DataLoader(_pipe(num_lanes=4), num_workers=2)
    assert loader.runner == "lanes"
    assert DataLoader(_pipe(), num_workers=0).runner == "inline"
    assert DataLoader(_pipe(), num_workers=2, task_timeout=30).runner == "process"
    # Lane workers run every stage themselves; a stage placed on Ray needs the pool.
    remote = _pipe().map_transform(dict, placement="remote")
    assert DataLoader(remote, num_workers=2).runner == "process"
    it = iter(loader)
    next(it)
    assert len(it.worker_pids) == 2 and it.engine_pid is None
    assert os.getpid() not in it.worker_pids
    loader.close()
    assert _wait_gone(set(it.worker_pids)) == set()


def test_more_workers_than_lanes_warn_once_at_the_callers_line_and_output_is_unchanged():
    pipe = _pipe(num_lanes=2)
    loader = DataLoader(pipe, num_workers=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = [list(loader) for _ in range(2)]
    idle = [w for w in caught if "worker(s) get no lane" in str(w.message)]
    assert len(idle) == 1, [str(w.message) for w in caught]
    assert "5 workers but this rank owns 2 lane(s): 3 worker(s) get no lane" in str(
        idle[0].message)
    assert idle[0].filename == __file__
    for epoch, got in enumerate(epochs):  # each iteration runs the next epoch
        _assert_same(got, _reference(pipe, epoch))


def test_to_training_options_reach_to_training_in_the_engine():
    pipe = _pipe()
    options = {"return_labels": True, "dtype": torch.int32, "return_num_valid_tokens": True}
    got = list(DataLoader(pipe, to_training=options))
    want = _reference(pipe, **options)
    _assert_same(got, want)
    assert got[0]["labels"].dtype == torch.int32
    assert got[0]["input_ids"].shape == (2, 8)


@pytest.mark.parametrize("mode", ["engine", "lanes"])
def test_to_training_false_yields_the_sample_batches(mode):
    pipe = _pipe()
    got = list(DataLoader(pipe, to_training=False, **MODES[mode]))
    want = list(pipe.iter(runner="inline"))
    assert all(isinstance(b, zt.SampleBatch) for b in got)
    assert got == want


def test_device_cpu_places_tensors_on_the_cpu():
    pipe = _pipe()
    got = list(DataLoader(pipe, device="cpu", in_process=True))
    _assert_same(got, _reference(pipe))
    assert all(b["input_ids"].device.type == "cpu" and not b["input_ids"].is_pinned()
               for b in got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_device_pins_and_copies_without_blocking(num_workers):
    pipe = _pipe()
    want = _reference(pipe, return_labels=True)
    loader = DataLoader(pipe, device="cuda", to_training={"return_labels": True},
                        num_workers=num_workers)
    assert loader.pin_memory  # pinned by default for a CUDA device
    got = list(loader)
    assert all(b["input_ids"].is_cuda and b["labels"].is_cuda for b in got)
    _assert_same(got, want)
    pinned = list(DataLoader(pipe, pin_memory=True, in_process=True))
    assert all(b["input_ids"].is_pinned() for b in pinned)
    _assert_same(pinned, _reference(pipe))


# --------------------------------------------------------------------------- state


@pytest.mark.parametrize("mode", MODES)
def test_state_after_k_batches_resumes_exactly_despite_prefetching(mode):
    pipe = _pipe()
    want = _reference(pipe)
    loader = DataLoader(pipe, prefetch_factor=3, **MODES[mode])
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    # Let the prefetch thread (and the engine behind it) run ahead of the caller.
    deadline = time.monotonic() + 20
    while not it._run.queue.full() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert it._run.queue.full()
    state = loader.state_dict()
    json.dumps(state)  # a checkpoint is plain JSON
    assert loader.state_dict(gather=True) == state  # no process group: the local state
    loader.close()

    other = {"inline": "lanes", "lanes": "engine", "engine": "inline"}.get(mode, mode)
    resumed = DataLoader(pipe, **MODES[other])  # another number of workers, or runner
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # before iterating: the loaded position
    tail = list(resumed)
    _assert_same(head + tail, want)


def test_state_before_iterating_is_the_beginning_and_after_the_end_is_empty():
    pipe = _pipe()
    loader = DataLoader(pipe, in_process=True)
    start = loader.state_dict()
    everything = list(loader)
    end = loader.state_dict()

    fresh = DataLoader(pipe, in_process=True)
    fresh.load_state_dict(start)
    _assert_same(list(fresh), everything)
    done = DataLoader(pipe, in_process=True)
    done.load_state_dict(end)  # epoch 0 is over: the next iteration runs epoch 1
    _assert_same(list(done), _reference(pipe, 1))


def test_iterating_again_starts_a_new_epoch_unless_a_state_was_loaded():
    pipe = _pipe()
    want = [_reference(pipe, epoch) for epoch in range(4)]
    loader = DataLoader(pipe, in_process=True)
    _assert_same(list(loader), want[0])
    _assert_same(list(loader), want[1])  # after the end: the next epoch from its beginning
    for i, _ in enumerate(loader):
        if i == 3:
            break
    state = loader.state_dict()
    _assert_same(list(loader), want[3])  # after a break: the next epoch too
    loader.load_state_dict(state)
    _assert_same(list(loader), want[2][4:])  # the state's epoch, where it stopped


def test_iter_alone_starts_nothing_and_keeps_a_loaded_state():
    want = _reference(_pipe())
    loader = DataLoader(_pipe())
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    loader.close()
    resumed = DataLoader(_pipe())
    resumed.load_state_dict(state)
    probe = iter(resumed)  # what Lightning does to check that a loader is iterable
    assert probe.engine_pid is None
    assert resumed.state_dict() == state
    _assert_same(list(resumed), want[2:])  # a new iteration: the probe never started
    # The probe is an iterator like any other: used now, it starts a pass of its own,
    # the loader's next epoch.
    _assert_same([next(probe)], _reference(_pipe(), 1)[:1])
    probe.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_peek_with_a_new_iterator_inside_the_loop_is_refused_and_the_loop_goes_on(mode):
    pipe = _pipe()
    want = _reference(pipe)
    loader = DataLoader(pipe, **MODES[mode])
    got = []
    for i, batch in enumerate(loader):
        got.append(batch)
        if i == 2:
            peek = iter(loader)
            with pytest.raises(RuntimeError, match="one iteration at a time"):
                next(peek)
            assert peek.engine_pid is None and not peek.worker_pids  # it started nothing
            after_three = loader.state_dict()
    _assert_same(got, want)  # neither ended early nor restarted
    resumed = DataLoader(pipe, in_process=True)
    resumed.load_state_dict(after_three)  # the position of the loop's three batches
    _assert_same(list(resumed), want[3:])


def test_a_second_iterator_starts_once_the_first_has_ended_or_been_dropped():
    want = _reference(_pipe())
    loader = DataLoader(_pipe(), in_process=True)
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(RuntimeError, match="iteration in progress"):
        next(second)
    _assert_same([next(first)], want[1:2])  # the first goes on where it was
    del first  # dropped unfinished (as a for loop's iterator after a break)
    gc.collect()
    _assert_same(list(second), _reference(_pipe(), 1))  # a new pass: the next epoch
    third = iter(loader)
    fourth = iter(loader)
    _assert_same(list(third), _reference(_pipe(), 2))
    _assert_same(list(fourth), _reference(_pipe(), 3))  # after the end: another pass


def test_load_state_dict_during_an_iteration_makes_its_next_step_an_error_not_an_end():
    want = _reference(_pipe())
    loader = DataLoader(_pipe(), in_process=True)
    it = iter(loader)
    next(it)
    next(it)
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(RuntimeError, match=r"ended by load_state_dict\(\) after 2 batch"):
        next(it)
    _assert_same(list(loader), want[2:])


def test_loading_a_state_of_another_pipeline_is_a_clear_error():
    state = DataLoader(_pipe(), in_process=True).state_dict()
    other = DataLoader(_pipe().with_source(seed=5), in_process=True)
    with pytest.raises(ValueError, match="different pipeline configuration"):
        other.load_state_dict(state)


# --------------------------------------------------------------------------- errors


def _fails_on_doc_17(payload: dict[str, Any]) -> dict[str, Any]:
    if payload["text"] == "doc 17":
        raise KeyError("doc 17 is broken")
    return payload


@pytest.mark.parametrize("mode, where", [("engine", "engine process"), ("lanes", "lane worker"),
                                         ("inline", None)])
def test_an_error_in_the_pipeline_reaches_the_caller_with_its_type_after_earlier_batches(
        mode, where):
    pipe = (zt.Pipeline.from_items(_items(), num_lanes=1, chunk_size=4)
            .map_transform(_fails_on_doc_17).batch(2))
    got = []
    with pytest.raises(KeyError, match="doc 17 is broken") as info:
        for batch in DataLoader(pipe, microbatch_sizes={"map_transform": 2}, **MODES[mode]):
            got.append(batch)
    if where is not None:  # the traceback of the process where it was raised
        assert where in str(info.value.__cause__)
    want = [0, 2, 4, 6, 8, 10, 12, 14]
    firsts = [b["ids"][0][2] for b in got]
    if mode == "engine":
        # A stage-parallel runner raises when the failed micro-batch is released, and
        # may drop batches finished in the same step: a prefix, never a gap.
        assert firsts == want[:len(firsts)]
    else:
        assert firsts == want
    assert multiprocessing.active_children() == [] and _segments() == []


def test_torch_only_arguments_are_type_errors_that_say_what_to_do():
    pipe = _pipe()
    with pytest.raises(TypeError, match="batching lives in the pipeline"):
        DataLoader(pipe, batch_size=8)
    with pytest.raises(TypeError, match="batching lives in the pipeline"):
        DataLoader(pipe, 8)
    with pytest.raises(TypeError, match="to_training"):
        DataLoader(pipe, collate_fn=lambda b: b)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        DataLoader(pipe, bogus=1)
    with pytest.raises(TypeError, match="to the DataLoader itself"):
        DataLoader(pipe, to_training={"device": "cpu"})
    with pytest.raises(TypeError, match="unknown option"):
        DataLoader(pipe, to_training={"return_lables": True})
    with pytest.raises(ValueError, match=r"end it with \.batch"):
        DataLoader(zt.Pipeline.from_items(_items()))
    with pytest.raises(ValueError, match="on_uneven"):
        DataLoader(pipe, on_uneven="wait")


def test_timeout_must_be_a_non_negative_number_of_seconds():
    for bad in (-1, "30", True, float("nan")):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
            DataLoader(_pipe(), timeout=bad)
    assert DataLoader(_pipe(), timeout=2).timeout == 2.0


def test_a_pipeline_stuck_on_the_prefetch_thread_times_out_with_an_error_naming_it():
    release = threading.Event()

    def stuck_on_doc_29(payload: dict[str, Any]) -> dict[str, Any]:
        if payload["text"] == "doc 29":
            release.wait(60)  # a read that never returns, until the test lets it go
        return payload

    source = zt.Pipeline.from_items(_items(), num_lanes=1, chunk_size=4)
    want = _reference(source.map_transform(dict).batch(2))  # the same batches, never stuck
    pipe = source.map_transform(stuck_on_doc_29).batch(2)
    loader = DataLoader(pipe, in_process=True, timeout=3,
                        microbatch_sizes={"map_transform": 2})
    it = iter(loader)
    got = []
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"timed out after 3 seconds waiting for a batch "
                                               r"from the pipeline on the loader's prefetch "
                                               r"thread \(in_process=True"):
            for batch in it:
                got.append(batch)
        assert time.monotonic() - started < 30  # the error came; nothing hung
        assert len(got) < 15  # none from doc 28 on
        _assert_same(got, want[:len(got)])
        with pytest.raises(StopIteration):
            next(it)  # the iteration is over
    finally:
        release.set()
    it._run.thread.join(timeout=10)
    assert not it._run.thread.is_alive()  # it closed the pipeline once the call returned
    loader.close()


@pytest.mark.parametrize("mode", ["engine", "lanes"])
def test_a_stopped_process_times_out_with_an_error_naming_its_pid_and_is_cleaned_up(mode):
    loader = DataLoader(_pipe(n=400), num_workers=1, runner=MODES[mode].get("runner"))
    it = iter(loader)
    next(it)  # without a timeout: the engine's start-up (a spawn, imports) is not measured
    tree = _engine_tree(it)
    if mode == "engine":
        engine = it.engine_pid
        who = rf"the loader's engine process \(pid {engine}\)"
    else:
        engine = it.worker_pids[0]
        who = rf"the loader's lane worker 0 \(pid {engine}, lanes \[0, 1, 2, 3\]\)"
    loader.timeout = 2
    os.kill(engine, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=rf"timed out after 2 seconds waiting for a "
                                               rf"batch from {who}"):
            for _ in range(250):  # the batches already in transit come first
                next(it)
        assert time.monotonic() - started < 30
        _assert_clean(tree)  # the timeout ended the iteration: engine and worker stopped
        loader.close()
        with pytest.raises(StopIteration):
            next(it)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGCONT)  # never leave a stopped process behind


# --------------------------------------------------------------------------- lifetime


@pytest.mark.parametrize("mode", ["engine", "lanes"])
def test_close_stops_the_engine_and_its_workers(mode):
    loader = DataLoader(_pipe(), **MODES[mode])
    it = iter(loader)
    next(it)
    tree = _engine_tree(it)
    assert len(tree) >= 2  # the engine and its pool worker; or the two lane workers
    loader.close()
    _assert_clean(tree)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("mode", ["engine", "lanes"])
def test_break_then_garbage_collection_stops_the_engine(mode):
    loader = DataLoader(_pipe(), **MODES[mode])
    tree: set[int] = set()
    for it_batch in loader:
        tree = _engine_tree(loader._active())
        del it_batch
        break
    gc.collect()  # the for loop's iterator is unreachable now
    _assert_clean(tree)
    assert loader.state_dict() is not None


@pytest.mark.parametrize("mode", ["engine", "lanes"])
def test_an_exception_in_the_training_loop_stops_the_engine(mode):
    loader = DataLoader(_pipe(), **MODES[mode])
    tree: set[int] = set()
    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            tree = _engine_tree(loader._active())
            _ = 1 / 0
    gc.collect()
    _assert_clean(tree)


@pytest.mark.parametrize("mode", ["engine", "lanes"])
def test_dropping_the_loader_and_its_iterator_stops_the_engine(mode):
    loader = DataLoader(_pipe(), **MODES[mode])
    it = iter(loader)
    next(it)
    tree = _engine_tree(it)
    del it, loader
    gc.collect()
    _assert_clean(tree)


# A training script; spawned processes re-import it, so it imports little at the top.
_NO_GUARD = textwrap.dedent("""
    import multiprocessing
    import numpy as np
    import zephon_torch as zt

    items = [{"input_ids": np.arange(i, i + 6)} for i in range(400)]
    pipe = zt.Pipeline.from_items(items, num_lanes=4, chunk_size=4).batch(2)
    out = {}
    for workers in (0, 2):
        got = []
        for batch in zt.DataLoader(pipe, num_workers=workers):
            if not got:  # the workers, credits bounding how far ahead they run, still work
                children = len(multiprocessing.active_children())
                assert children == workers, (workers, children)
            got.append(batch["input_ids"].tolist())
        out[workers] = got
    print("same" if out[0] == out[2] else "different", len(out[0]))
""")


def test_a_script_without_a_main_guard_runs_with_0_or_2_workers_as_with_torchs_loader(tmp_path):
    # num_workers=0 starts no process at all; lane workers are forked (Linux), as torch's.
    script = tmp_path / "train.py"
    script.write_text(_NO_GUARD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ZEPHON_LANES_START_METHOD", None)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["same", "200"]


_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import zephon_torch as zt

    if __name__ == "__main__":
        from zephon_torch.torch.loader import DataLoader

        items = [{"input_ids": np.arange(9)} for _ in range(400)]
        pipe = zt.Pipeline.from_items(items, num_lanes=2, chunk_size=4).map_transform(dict)
        runner = None if sys.argv[2] == "lanes" else "process"
        loader = DataLoader(pipe.batch(2), num_workers=1, runner=runner)
        it = iter(loader)
        next(it)
        time.sleep(0.5)  # the engine and its worker are up; leave without closing
        pids = [it.engine_pid] if it.engine_pid is not None else it.worker_pids
        print("pids", *pids, flush=True)
        if sys.argv[1] == "kill":
            time.sleep(60)
""")


@pytest.mark.parametrize("mode", ["engine", "lanes"])
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_end_of_program_or_sigkill_stops_the_engine_without_leaks(tmp_path, how, mode):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), how, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.startswith("pids"), proc.stderr.read()
    pids = [int(p) for p in line.split()[1:]]
    tree = {p for pid in pids for p in (pid, *_descendants(pid))}
    if how == "kill":
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)  # exit: must not hang joining the non-daemonic engine
    assert _wait_gone(tree) == set()
    if how == "exit":
        assert proc.returncode == 0
    # The engine of a killed trainer sweeps the segments it wrote; at a normal exit
    # the loader does. Either way nothing of that process is left in /dev/shm.
    assert [n for n in _segments(proc.pid, *tree) if not n.startswith(
        f"{shm.SEGMENT_PREFIX}{os.getpid()}-")] == []


# --------------------------------------------------------------------------- distributed


def _uneven_pipe() -> zt.Pipeline:
    # 40 items in chunks of 4 over 3 lanes: lane 0 gets 4 chunks, lanes 1 and 2 three.
    # Two ranks: rank 0 owns lanes 0 and 2 (14 batches), rank 1 lane 1 (6 batches).
    return (zt.Pipeline.from_items(_items(40), num_lanes=3, chunk_size=4)
            .map_transform(dict).shuffle(8, seed=1).batch(2))


def _rank_main(rank: int, port: int, out: str, num_workers: int = 0) -> None:
    """One rank of the gloo group (run in a subprocess by the test below)."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore", RuntimeWarning)  # rank 1 has 2 workers for 1 lane
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    pipe = _uneven_pipe()
    report: dict[str, Any] = {}
    steps = 0
    for _ in DataLoader(pipe, num_workers=num_workers):
        dist.all_reduce(torch.ones(1))  # a collective training step: would hang if uneven
        steps += 1
    report["stop"] = steps
    report["continue"] = sum(1 for _ in DataLoader(pipe, on_uneven="continue",
                                                   in_process=True))
    loader = DataLoader(pipe, num_workers=num_workers)
    it = iter(loader)
    report["head"] = [next(it)["ids"] for _ in range(3)]
    report["state"] = loader.state_dict(gather=True)
    report["local"] = loader.state_dict()
    loader.close()
    Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_uneven_ranks_stop_together_and_a_gathered_state_resumes_on_one_process(
        tmp_path, num_workers):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    procs = []
    for rank in range(2):
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); "
                f"from test_torch_loader import _rank_main; "
                f"_rank_main({rank}, {port}, {str(tmp_path / f'rank{rank}.json')!r}, "
                f"{num_workers})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env,
                                      stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["stop"] for r in reports] == [6, 6]  # both stop when rank 1 runs out
    assert [r["continue"] for r in reports] == [14, 6]
    merged = reports[0]["state"]
    assert merged == reports[1]["state"]
    assert sorted(merged["lanes"]) == ["0", "1", "2"]
    assert sorted(reports[0]["local"]["lanes"]) == ["0", "2"]

    # One process resumes the merged state: per lane, what the two ranks delivered
    # followed by what it delivers is the lane's uninterrupted stream.
    pipe = _uneven_pipe()
    lane_of: dict[str, int] = {}
    full: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for batch in pipe.iter(runner="inline", rank=0, world_size=1):
        key = json.dumps(batch.to_training()["ids"])
        lane_of[key] = batch.lane_ids[0]
        full[batch.lane_ids[0]].append(key)
    resumed = DataLoader(pipe, rank=0, world_size=1)
    resumed.load_state_dict(merged)
    delivered: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for ids in reports[0]["head"] + reports[1]["head"]:
        key = json.dumps(ids)
        delivered[lane_of[key]].append(key)
    for batch in resumed:
        key = json.dumps([list(i) for i in batch["ids"]])
        delivered[lane_of[key]].append(key)
    assert delivered == full


def test_the_loader_spells_out_pipeline_iters_options_with_its_defaults() -> None:
    import inspect

    from zephon_torch.runners.iterator import ITER_KWARGS

    ours = inspect.signature(DataLoader).parameters
    theirs = inspect.signature(zt.Pipeline.iter).parameters
    documented = {name.strip() for line in (DataLoader.__doc__ or "").splitlines()
                  if line.startswith(" " * 8) and not line.startswith(" " * 9) and ":" in line
                  for name in line.split(":")[0].split(",")}
    for name in ITER_KWARGS:
        assert name in ours, name
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert name in documented, f"{name} is not documented"
    for name in ("deterministic", "microbatch_sizes", "lanes", "verify", "task_timeout"):
        assert ours[name].default == theirs[name].default, name
    with pytest.raises(TypeError, match="takes no 'batch_size'"):
        DataLoader(zt.Pipeline.from_items(["a"]).batch(1), batch_size=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'shufle'"):
        DataLoader(zt.Pipeline.from_items(["a"]).batch(1), shufle=True)
