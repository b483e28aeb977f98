"""RunOptions: Pipeline.iter's arguments checked once; one description per runner."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import zephon_torch as zt
from zephon_torch.runners.executor import Executor
from zephon_torch.runners.options import ITER_KWARGS, RUNNERS, RunOptions
from zephon_torch.runners.registry import EXECUTORS, SPECS


def test_every_runner_name_has_an_executor_and_every_iter_argument_is_an_option() -> None:
    assert tuple(EXECUTORS) == RUNNERS == tuple(spec.name for spec in SPECS)
    assert RUNNERS == ("inline", "threads", "process", "lanes")
    assert all(issubclass(cls, Executor) for cls in EXECUTORS.values())
    names = [f.name for f in dataclasses.fields(RunOptions)]
    assert names[:len(ITER_KWARGS)] == list(ITER_KWARGS)
    defaults = inspect.signature(zt.Pipeline.iter).parameters
    for field in dataclasses.fields(RunOptions)[:len(ITER_KWARGS)]:
        assert field.default == defaults[field.name].default, field.name


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"runner": "gpu"}, r"unknown runner 'gpu'; use one of \['inline', 'threads'"),
    ({"runner": "threads", "task_timeout": 1.0}, r"task_timeout=1.0 needs runner='process'"),
    ({"runner": "inline", "prefetch": 2}, r"finish= and prefetch= apply to runner='lanes'"),
    ({"num_workers": 0}, r"num_workers must be a positive integer, got 0"),
    ({"num_workers": True}, r"num_workers must be a positive integer, got True"),
    ({"epoch": -1}, r"epoch must be an integer >= 0"),
])
def test_a_bad_option_is_refused_with_the_words_of_pipeline_iter(kwargs: dict,
                                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunOptions(**kwargs)


def test_options_are_frozen_and_hand_on_as_keywords() -> None:
    options = RunOptions(runner="inline", num_workers=2, epoch=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.runner = "threads"  # type: ignore[misc]
    assert RunOptions(**options.as_kwargs()) == options
    with zt.Pipeline.from_items(["a", "b"]).iter(runner="inline") as it:
        assert it.options.runner == "inline"
        assert type(it.executor).__name__ == "StagePoolExecutor"


# A runner added the way docs/architecture.md says: one new module and one entry in
# runners/registry.py, nothing else edited. The package is copied, the two edits made
# there, and a fresh interpreter shows the names, the checks and a run taking it up.
_TOY_MODULE = '''"""A toy runner: the stages on one worker thread."""

from zephon_torch.runners.base import ThreadPool
from zephon_torch.runners.executor import StagePoolExecutor
from zephon_torch.runners.spec import PoolSpec, RunnerSpec


def _one_thread(ops, ctxs, num_workers, task_timeout):
    return ThreadPool(ops, ctxs, 1)


TOY = RunnerSpec("toy", StagePoolExecutor, pool=PoolSpec(_one_thread), takes_finish=True)
'''

_TOY_CHECK = '''
import zephon_torch as zt
from zephon_torch import testing
from zephon_torch.runners import iterator, options

assert options.RUNNERS == ("inline", "threads", "process", "lanes", "toy"), options.RUNNERS
assert iterator.RUNNERS == options.RUNNERS == testing.RUNNERS
try:
    options.RunOptions(runner="gpu")
except ValueError as exc:
    print(exc)
for kwargs in ({"runner": "toy", "task_timeout": 1.0}, {"runner": "threads", "prefetch": 2}):
    try:
        options.RunOptions(**kwargs)
    except ValueError as exc:
        print(exc)
pipe = zt.Pipeline.from_items([f"doc {i}" for i in range(50)], num_lanes=3).batch(4)
with pipe.iter(runner="toy") as it:
    assert type(it.executor).__name__ == "StagePoolExecutor" and it.runner == "toy"
    assert type(it._pool).__name__ == "ThreadPool"
    toy = list(it)
testing.assert_same(testing.collect(pipe, runner="inline"), toy, "toy")
print("toy ok", len(toy))
'''


def test_a_runner_is_one_module_and_one_registry_entry(tmp_path) -> None:
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    package = Path(zt.__file__).resolve().parent
    copy = tmp_path / "zephon_torch"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "runners" / "toy.py").write_text(_TOY_MODULE)
    registry = copy / "runners" / "registry.py"
    text = registry.read_text()
    last = '    RunnerSpec("lanes", LaneExecutor, starts_processes=True, takes_finish=True),\n'
    assert text.count(last) == 1
    spec_import = "from zephon_torch.runners.spec import RunnerSpec\n"
    text = text.replace(last, last + "    TOY,\n").replace(
        spec_import, spec_import + "from zephon_torch.runners.toy import TOY\n")
    registry.write_text(text)
    result = subprocess.run([sys.executable, "-c", _TOY_CHECK], cwd=tmp_path, text=True,
                            capture_output=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "unknown runner 'gpu'; use one of ['inline', 'threads', 'process', 'lanes', 'toy']",
        "task_timeout=1.0 needs runner='process' (only a worker process can be stopped; a "
        "thread cannot), got runner='toy'",
        "finish= and prefetch= apply to runner='lanes' or runner='toy', got runner='threads'",
        "toy ok 12",
    ]

