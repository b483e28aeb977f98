"""RunOptions: Pipeline.iter's arguments checked once; one executor per runner name."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import zephon_torch as zt
from zephon_torch.runners.executor import EXECUTORS, Executor
from zephon_torch.runners.options import ITER_KWARGS, RUNNERS, RunOptions


def test_every_runner_name_has_an_executor_and_every_iter_argument_is_an_option() -> None:
    assert tuple(EXECUTORS) == RUNNERS
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
