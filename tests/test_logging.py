"""The package logger (quiet by default) and what stats() tells a loader."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import zephon_torch as zt
from zephon_torch import logs
from zephon_torch.ops.base import Operator


def pipe(n: int = 24) -> zt.Pipeline:
    return (zt.Pipeline.from_items([f"d{i}" for i in range(n)], num_lanes=2, chunk_size=4)
            .shuffle(4, seed=1).batch(3))


def test_the_package_logger_is_quiet_by_default(tmp_path: Any) -> None:
    # a fresh interpreter, logging not configured: a pass that skips a bad sample (a
    # WARNING record) prints nothing but the warning, which this script silences
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "good"}\n{not json\n')
    code = (
        "import warnings, logging, zephon_torch as zt\n"
        "warnings.simplefilter('ignore')\n"
        f"p = zt.Pipeline.from_jsonl({str(path)!r}, num_lanes=1, on_error='skip')\n"
        "list(p.fetch().decode_text().iter(runner='inline'))\n"
        "print([type(h).__name__ for h in logging.getLogger('zephon_torch').handlers])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "['NullHandler']"
    assert done.stderr == ""


def test_start_and_end_of_a_pass_are_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="zephon_torch"):
        out = list(pipe().iter(runner="threads", num_workers=2, epoch=1))
    messages = [r.getMessage() for r in caplog.records if r.name == "zephon_torch"]
    start = next(m for m in messages if "iterating" in m)
    assert "runner=threads, num_workers=2" in start and "epoch 1" in start
    assert "lanes [0, 1] of 2" in start and "'shuffle'" in start
    end = next(m for m in messages if "ended" in m)
    assert f"{len(out)} item(s)" in end and "24 read" in end


def test_throughput_is_logged_periodically(caplog: pytest.LogCaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "THROUGHPUT_INTERVAL", 1e-9)  # every pump after the first
    with caplog.at_level(logging.INFO, logger="zephon_torch"):
        list(pipe(200).iter(runner="inline"))
    lines = [r.getMessage() for r in caplog.records if "items/s" in r.getMessage()]
    assert len(lines) >= 2
    assert "waited" in lines[-1] and "sample(s)" in lines[-1]


def test_a_resume_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    p = pipe()
    it = p.iter(runner="inline", epoch=2)
    next(it)
    state = it.state_dict()
    it.close()
    with caplog.at_level(logging.INFO, logger="zephon_torch"):
        p.iter(runner="inline").load_state_dict(state)
    assert any("resumed" in r.getMessage() and "epoch 2" in r.getMessage()
               for r in caplog.records)


def test_each_skip_warning_is_also_a_log_record(tmp_path: Any,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "good"}\n{not json\n{"text": "fine"}\n')
    p = zt.Pipeline.from_jsonl(str(path), num_lanes=1, on_error="skip").fetch().decode_text()
    with caplog.at_level(logging.WARNING, logger="zephon_torch"), \
            pytest.warns(RuntimeWarning, match="on_error='skip' turned 1 bad sample") as warned:
        list(p.iter(runner="inline"))
    records = [r for r in caplog.records if r.levelno == logging.WARNING
               and "on_error='skip' turned 1 bad sample" in r.getMessage()]
    assert len(records) == 1
    assert records[0].getMessage() == str(next(
        w.message for w in warned if "turned 1 bad" in str(w.message)))


def test_stats_say_what_runs_and_at_what_pace() -> None:
    it = pipe().iter(runner="threads", num_workers=2, rank=1, world_size=2, epoch=3)
    out = list(it)
    stats = it.stats()
    assert {k: stats[k] for k in ("epoch", "runner", "num_workers", "rank", "world_size",
                                  "num_lanes", "owned_lanes", "finished")} == {
        "epoch": 3, "runner": "threads", "num_workers": 2, "rank": 1, "world_size": 2,
        "num_lanes": 2, "owned_lanes": [1], "finished": True}
    pace = stats["throughput"]
    assert pace["outputs"] == stats["outputs"] == len(out)
    assert pace["samples"] == stats["delivered"]
    assert pace["elapsed_s"] >= pace["wait_s"] >= 0
    assert pace["outputs_per_s"] is None or pace["outputs_per_s"] > 0


def test_a_resumed_run_counts_its_pace_from_the_resume() -> None:
    p = pipe()
    it = p.iter(runner="inline")
    head = [next(it) for _ in range(2)]
    state = it.state_dict()
    it.close()
    resumed = p.iter(runner="inline")
    resumed.load_state_dict(state)
    rest = list(resumed)
    stats = resumed.stats()
    assert stats["throughput"]["outputs"] == len(rest)
    assert stats["outputs"] == len(head) + len(rest)  # the lanes' totals since the start


class ExitOnce(Operator):
    """Ends its worker process on the first micro-batch (a file marks that it happened)."""

    name = "exit_once"

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def process_many(self, elems: list[Any]) -> list[Any]:
        if not os.path.exists(self.flag):
            Path(self.flag).write_text("exited")
            os._exit(3)
        return list(elems)


def test_a_worker_restart_is_logged_as_a_warning(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    flag = tmp_path / "exited"
    p = pipe().apply(ExitOnce(str(flag)))
    with caplog.at_level(logging.WARNING, logger="zephon_torch"):
        out = list(p.iter(runner="process", num_workers=2))
    assert flag.exists() and len(out) == len(list(pipe().iter(runner="inline")))
    restarts = [r.getMessage() for r in caplog.records if "starting a new one" in r.getMessage()]
    assert len(restarts) == 1 and "exited with code 3" in restarts[0], restarts


def test_metrics_flatten_stats_for_a_metrics_logger() -> None:
    it = pipe().iter(runner="inline", epoch=2)
    out = list(it)
    stats = it.stats()
    numbers = logs.metrics(stats)
    assert numbers["data/epoch"] == 2.0 and numbers["data/outputs"] == float(len(out))
    assert numbers["data/samples"] == float(stats["delivered"])
    assert numbers["data/tombstoned"] == float(stats["tombstoned"])
    assert 0.0 <= numbers.get("data/wait_fraction", 0.0) <= 1.0
    assert all(isinstance(v, float) for v in numbers.values())
    assert set(logs.metrics(stats, prefix="")) == {k[len("data/"):] for k in numbers}
