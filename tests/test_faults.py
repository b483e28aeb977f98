"""Faults with real processes: killed workers, raising user code, consumers that
stop early or are interrupted. Nothing may hang, nothing may change the output,
and nothing may be left behind (worker processes, threads, ``/dev/shm`` segments).

Cleanliness is checked right after each test here (children through
``/proc``/psutil, threads by name, segments in ``shm.segment_dir()``); the
conftest checks every module the same way at its end.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from harness import assert_same, collect

from zephon_torch.ops.base import Operator
from zephon_torch.pipeline import Pipeline
from zephon_torch.runners import shm
from zephon_torch.runners.process import WorkerTraceback

ROOT = Path(__file__).resolve().parent.parent
RUNNERS = ("inline", "threads", "process")


class Slow(Operator):
    """Sleeps a little per micro-batch, so that a run lasts long enough to be hit."""

    name = "slow"

    def __init__(self, seconds: float = 0.01) -> None:
        self.seconds = seconds

    def process_many(self, elems: list[Any]) -> list[Any]:
        time.sleep(self.seconds)
        return list(elems)


class PoisonError(Exception):
    """A user exception type the consumer must see as it is."""


def poison(payload: dict[str, Any]) -> dict[str, Any]:
    if payload["text"].startswith("doc 37 "):
        raise PoisonError(f"refusing {payload['text'][:6]!r}")
    return {**payload, "n": len(payload["text"])}


def _texts(n: int) -> list[str]:
    return [f"doc {i} " + "word " * (1 + i % 13) for i in range(n)]


def _pipe(n: int = 400, *, slow: float = 0.0) -> Pipeline:
    pipe = Pipeline.from_items(_texts(n), num_lanes=4, chunk_size=8, seed=5)
    if slow:
        pipe = pipe.apply(Slow(slow))
    return (pipe.map_transform(lambda p: {"ids": np.frombuffer(p["text"].encode(), np.uint8)})
            .shuffle(16, seed=1).batch(4, drop_last=False))


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(c.cmdline() or [])}


def _our_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("zephon")]


def _segments() -> list[str]:
    return [n for n in os.listdir(shm.segment_dir()) if n.startswith(shm.SEGMENT_PREFIX)]


def assert_released(before: set[int], timeout: float = 15.0) -> None:
    """No new child process, zephon thread or segment is left (after ``timeout`` at most)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        left = (_children() - before, _our_threads(), _segments())
        if not any(left) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == (set(), [], []), f"left behind: children, threads, segments = {left}"


@pytest.fixture
def clean() -> Any:
    """The children alive before the test; the test ends by asserting it released the rest."""
    return _children()


# ---------------------------------------------------------------- killed workers


@pytest.mark.timeout(120)
def test_sigkill_of_workers_mid_run_leaves_the_output_identical(clean: set[int]) -> None:
    pipe = _pipe(600, slow=0.01)
    want = collect(pipe, runner="inline")
    it = pipe.iter(runner="process", num_workers=3, microbatch_sizes={"slow": 4})
    got = []
    killed = []
    for k, item in enumerate(it):
        got.append(item)
        if k in (5, 25, 60):  # three kills, each while the workers are busy
            victim = it._pool.worker_pids()[len(killed) % 3]
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
    it.close()
    assert_same(want, got, label="after SIGKILLs")
    assert len(set(killed)) == 3  # three different processes died, and were replaced
    assert_released(clean)


class KillSelf(Operator):
    """SIGKILLs its own worker whenever a micro-batch holds sample ``marker``."""

    name = "kill_self"

    def __init__(self, marker: int) -> None:
        self.marker = marker

    def process_many(self, elems: list[Any]) -> list[Any]:
        if any(e.meta.sample_id[2] == self.marker for e in elems):
            os.kill(os.getpid(), signal.SIGKILL)
        return list(elems)


@pytest.mark.timeout(120)
def test_a_micro_batch_that_always_kills_its_worker_is_a_clear_error_not_a_hang(
        clean: set[int]) -> None:
    pipe = Pipeline.from_items(_texts(60), num_lanes=2, chunk_size=8).apply(KillSelf(21))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        collect(pipe, runner="process", num_workers=2, microbatch_sizes={"kill_self": 2})
    message = str(info.value)
    assert "died while running stage 'kill_self'" in message and "SIGKILL" in message
    assert time.monotonic() - start < 60
    assert_released(clean)


class HangOn(Operator):
    """Never returns on a micro-batch holding sample ``marker`` (only once, with ``flag``)."""

    name = "hang_on"

    def __init__(self, marker: int, flag: str | None = None) -> None:
        self.marker = marker
        self.flag = flag

    def process_many(self, elems: list[Any]) -> list[Any]:
        if any(e.meta.sample_id[2] == self.marker for e in elems):
            if self.flag is None or not os.path.exists(self.flag):
                if self.flag is not None:
                    Path(self.flag).write_text("hung")
                time.sleep(3600)  # a deadlock, as far as anyone can tell
        return list(elems)


@pytest.mark.timeout(120)
def test_a_worker_that_hangs_once_is_killed_after_task_timeout_and_the_output_is_identical(
        tmp_path: Path, clean: set[int]) -> None:
    flag = tmp_path / "hung"
    base = Pipeline.from_items(_texts(60), num_lanes=2, chunk_size=8)
    want = collect(base, runner="inline")
    pipe = base.apply(HangOn(21, str(flag)))
    got = collect(pipe, runner="process", num_workers=2, task_timeout=1.5,
                  microbatch_sizes={"hang_on": 2})
    assert flag.exists()  # it did hang
    assert_same(want, got, label="after a hang")
    assert_released(clean)


@pytest.mark.timeout(120)
def test_a_micro_batch_that_always_hangs_is_a_clear_error_not_a_hang(clean: set[int]) -> None:
    pipe = Pipeline.from_items(_texts(60), num_lanes=2, chunk_size=8).apply(HangOn(21))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        collect(pipe, runner="process", num_workers=2, task_timeout=1.0,
                microbatch_sizes={"hang_on": 2})
    message = str(info.value)
    assert "stage 'hang_on'" in message, message
    assert "ran one micro-batch for more than task_timeout=1 s and was killed" in message
    assert "dispatched 4 times" in message and "a hang" in message
    assert time.monotonic() - start < 60
    assert_released(clean)


def test_task_timeout_needs_the_process_runner() -> None:
    pipe = Pipeline.from_items(_texts(4))
    with pytest.raises(ValueError, match=r"task_timeout=5 needs runner='process'"):
        pipe.iter(runner="threads", task_timeout=5)
    with pytest.raises(ValueError, match=r"task_timeout must be a number of seconds > 0"):
        pipe.iter(runner="process", task_timeout=0)


# ---------------------------------------------------------------- raising user code


@pytest.mark.timeout(120)
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_raising_user_function_reaches_the_consumer_with_its_type_and_traceback(
        runner: str, clean: set[int]) -> None:
    pipe = Pipeline.from_items(_texts(80), num_lanes=2, chunk_size=8).map_transform(poison)
    with pytest.raises(PoisonError, match=r"^refusing 'doc 37'$") as info:
        collect(pipe, runner=runner, num_workers=2)
    if runner == "process":
        cause = info.value.__cause__
        assert isinstance(cause, WorkerTraceback)
        text = cause.text
    else:
        text = "".join(traceback.format_exception(info.value))
    assert "in poison" in text and 'raise PoisonError(f"refusing' in text
    assert_released(clean)


# ---------------------------------------------------------------- consumers that stop


def _stop(make: Any, how: str) -> None:
    """Take a few items from ``make()``, then stop the way a training loop might.

    Only this function holds the iterator, so after a ``break`` nothing but
    garbage collection is left to release it.
    """
    it = make()
    if how == "break":
        for k, _ in enumerate(it):
            if k == 3:
                break
        del it  # the loop's iterator is unreachable: garbage collection closes it
    elif how == "close":
        for _ in range(3):
            next(it)
        it.close()
    elif how == "exception":
        with pytest.raises(ZeroDivisionError):
            for k, _ in enumerate(it):
                if k == 3:
                    _ = 1 / 0
    elif how == "keyboard_interrupt":  # raised in the consumer's own code
        with pytest.raises(KeyboardInterrupt):
            for k, _ in enumerate(it):
                if k == 3:
                    raise KeyboardInterrupt


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["break", "close", "exception", "keyboard_interrupt"])
@pytest.mark.parametrize("runner", ["threads", "process"])
def test_a_consumer_that_stops_releases_workers_threads_and_segments(
        runner: str, how: str, clean: set[int]) -> None:
    pipe = _pipe(2000, slow=0.002)
    _stop(lambda: pipe.iter(runner=runner, num_workers=2), how)
    assert_released(clean)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["break", "close", "exception", "keyboard_interrupt"])
def test_a_dataloader_consumer_that_stops_releases_the_engine(how: str,
                                                               clean: set[int]) -> None:
    pytest.importorskip("torch")
    from zephon_torch import DataLoader

    loader = DataLoader(_pipe(2000, slow=0.002), num_workers=2, to_training=False)
    _stop(lambda: iter(loader), how)
    if how != "close":
        loader.close()  # what a trainer does when it leaves the loop for good
    assert_released(clean, timeout=30)


_INTERRUPTED = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from zephon_torch.pipeline import Pipeline

    def slow(payload):
        time.sleep(0.005)
        return {"ids": np.frombuffer(payload["text"].encode(), np.uint8)}

    if __name__ == "__main__":
        pipe = (Pipeline.from_items([f"doc {i} " * 9 for i in range(10**6)], num_lanes=4,
                                    chunk_size=8)
                .map_transform(slow).batch(4))
        if sys.argv[1] == "loader":
            from zephon_torch import DataLoader
            source = DataLoader(pipe, num_workers=2, to_training=False)
        else:
            source = pipe.iter(runner="process", num_workers=2)
        for k, _ in enumerate(source):
            if k == 5:
                print("running", flush=True)
""")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tree(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.Error:
            pass
    return alive


@pytest.mark.timeout(180)
@pytest.mark.parametrize("consumer", ["iterator", "loader"])
def test_ctrl_c_stops_the_whole_process_group_cleanly(tmp_path: Path, consumer: str) -> None:
    if consumer == "loader":
        pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(_INTERRUPTED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # A shell starts background jobs with SIGINT ignored, and an ignored signal
    # is inherited: give the script a terminal's default Ctrl-C handling.
    proc = subprocess.Popen([sys.executable, str(script), consumer], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=_default_sigint)
    try:
        assert proc.stdout.readline().strip() == "running", proc.stderr.read()
        tree = _tree(proc.pid)
        assert tree, "expected worker processes"
        before = set(_segments())
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group gets it
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
    assert "Traceback" in err and err.count("KeyboardInterrupt") == 1, err[-3000:]  # only ours
    deadline = time.monotonic() + 20
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(tree) == set()
    owners = {f"{shm.SEGMENT_PREFIX}{pid}-" for pid in {proc.pid, *tree}}
    assert [n for n in _segments() if n.startswith(tuple(owners))] == [], before


# ---------------------------------------------------------------- SIGTERM

_TERMINATED = textwrap.dedent("""
    import signal, sys, time
    import numpy as np
    from zephon_torch.pipeline import Pipeline

    def slow(payload):
        time.sleep(0.002)
        # 8 KiB per record: every micro-batch and every batch of the loader travels
        # through a shared-memory segment
        return {"ids": np.full(1024, len(payload["text"]), np.int64)}

    if __name__ == "__main__":
        consumer, previous = sys.argv[1], sys.argv[2]
        asked = []
        if previous == "raises":  # a trainer's handler that stops at once
            def on_term(signum, frame):
                print("previous handler", flush=True)
                raise SystemExit(3)
            signal.signal(signal.SIGTERM, on_term)
        elif previous == "flag":  # a trainer's handler that stops after the step (Lightning)
            signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))
        # The shuffle buffer holds payload handles, so segments stay alive while it fills.
        pipe = (Pipeline.from_items([f"doc {i} " * 9 for i in range(10**6)], num_lanes=4,
                                    chunk_size=8)
                .map_transform(slow).shuffle(64, seed=1).batch(4))
        if consumer == "loader":
            from zephon_torch import DataLoader
            source = DataLoader(pipe, num_workers=2, to_training=False)
        else:
            source = pipe.iter(runner="process", num_workers=2)
        after = 0
        for k, _ in enumerate(source):
            if k == 5:
                print("running", flush=True)
            # A training step: the loader's engine has batches in transit meanwhile.
            time.sleep(0.01)
            if asked:
                after += 1
                if after == 20:  # the pool kept working after the signal
                    source.close()
                    print("stopped gracefully", flush=True)
                    break
""")


def _owned_segments(pids: set[int]) -> list[str]:
    owners = tuple(f"{shm.SEGMENT_PREFIX}{pid}-" for pid in pids)
    return [n for n in _segments() if n.startswith(owners)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("consumer", "target", "previous"),
    [
        ("iterator", "process", "none"),  # torchrun, kill: the training process only
        ("iterator", "group", "none"),  # a scheduler signalling every process of the job
        ("iterator", "process", "raises"),
        ("iterator", "process", "flag"),
        ("loader", "process", "none"),
        # A scheduler stopping the job: the reader dies by the default action, with the
        # batches the engine has sent it still in transit.
        ("loader", "group", "none"),
    ],
)
def test_sigterm_mid_iteration_leaves_no_segment_or_worker_and_still_ends_the_process(
        tmp_path: Path, consumer: str, target: str, previous: str) -> None:
    if consumer == "loader":
        pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(_TERMINATED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), consumer, previous],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "running", proc.stderr.read()
        tree = _tree(proc.pid)
        assert tree, "expected worker processes"
        deadline = time.monotonic() + 20
        while not _owned_segments({proc.pid, *tree}) and time.monotonic() < deadline:
            time.sleep(0.01)
            tree |= _tree(proc.pid)  # a worker started late owns its segments too
        assert _owned_segments({proc.pid, *tree}), "expected live segments to leak"
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    expected = {"none": -signal.SIGTERM, "raises": 3, "flag": 0}[previous]
    assert proc.returncode == expected, err[-3000:]
    if previous == "raises":
        assert "previous handler" in out
    if previous == "flag":
        assert "stopped gracefully" in out, err[-3000:]
    deadline = time.monotonic() + 20
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive, left = _alive(tree), _owned_segments({proc.pid, *tree})
    for pid in alive:  # leave nothing to the module's leak check: this test reports it
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for name in left:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm.segment_dir(), name))
    assert (alive, left) == (set(), [])


def _wide_pipe() -> Pipeline:
    # 8 KiB per record, 32 KiB per batch: every batch crosses in a segment of its own.
    return (Pipeline.from_items(_texts(2000), num_lanes=4, chunk_size=8)
            .map_transform(lambda p: {"ids": np.full(1024, len(p["text"]), np.int64)})
            .batch(4))


def _in_transit() -> list[str]:
    """Segments of batches the loader's engine has sent and the reader not yet read.

    Waits until they stay the same for a while: the reader's queue is full and the
    engine has used its credits, so nothing moves until the test consumes.
    """
    deadline = time.monotonic() + 30
    seen, since = sorted(_segments()), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = sorted(_segments())
        if now != seen:
            seen, since = now, time.monotonic()
        elif seen and time.monotonic() - since > 0.5:
            return seen
    raise AssertionError(f"expected batches waiting in transit, saw {seen}")


@pytest.mark.timeout(120)
def test_a_sigterm_to_the_loader_engine_alone_delivers_what_it_sent_then_an_error_naming_it(
        clean: set[int]) -> None:
    pytest.importorskip("torch")
    from zephon_torch import DataLoader

    it = _wide_pipe().iter(runner="inline")
    want = [next(it) for _ in range(60)]
    it.close()
    loader = DataLoader(_wide_pipe(), runner="threads", num_workers=1, to_training=False,
                        prefetch_factor=4)  # the stage-parallel runner: an engine process
    it = iter(loader)
    got = [next(it)]
    engine = it.engine_pid
    in_transit = _in_transit()
    # The engine alone, as when a trainer's own SIGTERM handler keeps the training process
    # alive: the batches already sent stay for it to read, then the end is loud.
    os.kill(engine, signal.SIGTERM)
    time.sleep(1.0)  # the engine has closed its pipeline meanwhile
    assert set(in_transit) <= set(_segments())
    with pytest.raises(RuntimeError, match=rf"loader's engine process \(pid {engine}\) was "
                                           rf"stopped by SIGTERM \(exit code 143\) before "
                                           rf"the end of the data"):
        while len(got) < len(want):
            got.append(next(it))
    assert_same(want[:len(got)], got, label="up to the SIGTERM")
    loader.close()
    assert_released(clean)


@pytest.mark.timeout(120)
def test_a_loader_segment_deleted_by_someone_else_is_an_error_naming_it(
        clean: set[int]) -> None:
    pytest.importorskip("torch")
    from zephon_torch import DataLoader

    loader = DataLoader(_wide_pipe(), runner="threads", num_workers=1, to_training=False,
                        prefetch_factor=4)  # the stage-parallel runner: an engine process
    it = iter(loader)
    next(it)
    for name in _in_transit():  # what systemd's RemoveIPC=yes does at a logout
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm.segment_dir(), name))
    with pytest.raises(RuntimeError, match=r"the shared-memory segment .* of a batch from the "
                                           r"zephon loader's engine process \(pid \d+\) was "
                                           r"removed before it was read, while the engine "
                                           r"still runs"):
        for _ in range(500):
            next(it)
    loader.close()
    assert_released(clean)


@pytest.mark.timeout(120)
def test_the_sigterm_handler_is_the_pools_only_while_one_is_alive_and_passes_the_signal_on(
        clean: set[int]) -> None:
    calls: list[int] = []

    def previous(signum: int, frame: Any) -> None:
        calls.append(signum)

    saved = signal.signal(signal.SIGTERM, previous)
    try:
        it = _pipe(200).iter(runner="process", num_workers=1)
        installed = signal.getsignal(signal.SIGTERM)
        assert installed is not previous, "no SIGTERM clean-up while the pool is alive"
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM]  # handed to the handler that was there first ...
        got = list(it)  # ... which chose to go on: the pool still works
        assert_same(collect(_pipe(200), runner="inline"), got, label="after a SIGTERM")
        it.close()
        assert signal.getsignal(signal.SIGTERM) is previous

        # A pool started on another thread cannot install a handler, and does not try.
        done: list[Any] = []
        thread = threading.Thread(target=lambda: done.append(
            _pipe(40).iter(runner="process", num_workers=1).close()))
        thread.start()
        thread.join()
        assert done == [None] and signal.getsignal(signal.SIGTERM) is previous

        # An ignored SIGTERM stays ignored.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        it = _pipe(40).iter(runner="process", num_workers=1)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        it.close()
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert_released(clean)


# An in-process loader whose pipeline runs a process pool: the pool starts on the
# loader's prefetch thread.
_IN_PROCESS_LOADER = textwrap.dedent("""
    import sys, time
    import numpy as np
    import zephon_torch as zt

    def slow(payload):
        time.sleep(0.002)
        return {"input_ids": np.full(1024, len(payload["text"]), np.int64)}

    if __name__ == "__main__":
        pipe = (zt.Pipeline.from_items([f"doc {i} " * 9 for i in range(10**6)], num_lanes=4,
                                       chunk_size=8)
                .map_transform(slow).shuffle(64, seed=1).batch(4))
        loader = zt.DataLoader(pipe, runner="process", in_process=True, num_workers=2,
                               to_training=False)
        for k, _ in enumerate(loader):
            if k == 5:
                print("running", flush=True)
            time.sleep(0.01)
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_an_in_process_loader_with_a_process_pool_leaves_no_segment(
        tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "train.py"
    script.write_text(_IN_PROCESS_LOADER)
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZEPHON_SHM_DIR": str(shm_dir)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "running", proc.stderr.read()
        deadline = time.monotonic() + 20
        while not os.listdir(shm_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.listdir(shm_dir), "expected live segments"
        os.kill(proc.pid, sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(2)  # the pool's workers notice their parent is gone
    left = sorted(os.listdir(shm_dir))
    for name in left:  # leave nothing behind: this test reports it
        with contextlib.suppress(OSError):
            os.unlink(shm_dir / name)
    # SIGTERM cleans up as SIGINT does, although the pool runs on the prefetch thread,
    # where no signal handler can be installed (the loader holds one from the main thread).
    assert left == []
