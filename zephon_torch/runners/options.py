"""The options of one run, checked once: what ``Pipeline.iter`` was asked for.

``Pipeline.iter(**kwargs)`` keeps its keyword signature and turns its
arguments into a :class:`RunOptions`; the iterator, the torch wrappers and
the loader read the same object, so that a value is checked in one place and
every refusal says the same words wherever it came from. The options hold
what was asked, not what a machine makes of it: the rank's lanes, the
default worker count and the runner of a daemonic process are settled by the
iterator (``iterator.py``) and its executor (``executor.py``). Which runners
exist and which options each takes is read from their descriptions
(``registry.py``), never from a list of names here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from zephon_torch.epochs import check_epoch
from zephon_torch.runners.registry import RUNNER_SPECS

__all__ = ["ITER_KWARGS", "RUNNERS", "RunOptions", "check_loader_workers", "check_runner"]

#: The runners ``Pipeline.iter`` takes, in the order of their entries in ``registry.py``.
RUNNERS: tuple[str, ...] = tuple(RUNNER_SPECS)
#: The keyword arguments of ``Pipeline.iter`` (the torch wrappers check theirs against it).
ITER_KWARGS = ("runner", "num_workers", "deterministic", "rank", "world_size",
               "microbatch_sizes", "lanes", "verify", "task_timeout", "epoch")


def check_runner(runner: Any) -> str:
    """``runner`` if it names a runner, else the ValueError every entry point raises."""
    names = tuple(RUNNER_SPECS)  # compared by equality: an unhashable value is refused too
    if runner not in names:
        raise ValueError(f"unknown runner {runner!r}; use one of {list(names)}")
    return runner


def _runners_that(question: str) -> str:
    """The runners whose description answers ``question`` with True, as the words of a
    refusal: ``runner='process'`` (several: joined with " or ")."""
    return " or ".join(f"runner={name!r}" for name, spec in RUNNER_SPECS.items()
                       if getattr(spec, question))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_loader_workers(num_workers: Any) -> int:
    """``zephon_torch.DataLoader``'s ``num_workers``: an integer >= 0 (0: no workers)."""
    if not _is_count(num_workers) or num_workers < 0:
        raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    return num_workers


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How one pipeline run goes: the arguments of ``Pipeline.iter``, checked.

    The fields are ``Pipeline.iter``'s (see its docstring), plus two that
    only ``zephon_torch.DataLoader`` sets for lane workers: ``finish``
    (called in the lane worker on each batch) and ``prefetch`` (messages a
    lane worker may produce ahead of the consumer). Making one checks them;
    a ``ValueError`` names the first bad value.
    """

    runner: str = "threads"
    num_workers: int | None = None
    deterministic: bool = True
    rank: int | None = None
    world_size: int | None = None
    microbatch_sizes: Mapping[str, int] | None = None
    lanes: Sequence[int] | None = None
    verify: bool = False
    task_timeout: float | None = None
    epoch: int | None = None
    finish: Callable[[Any], Any] | None = None
    prefetch: int | None = None

    def __post_init__(self) -> None:
        runner = check_runner(self.runner)
        spec = RUNNER_SPECS[runner]
        if self.task_timeout is not None and not spec.takes_task_timeout:
            raise ValueError(
                f"task_timeout={self.task_timeout!r} needs {_runners_that('takes_task_timeout')} "
                f"(only a worker process can be stopped; a thread cannot), got runner={runner!r}"
            )
        if (self.finish is not None or self.prefetch is not None) and not spec.takes_finish:
            raise ValueError(f"finish= and prefetch= apply to {_runners_that('takes_finish')}, "
                             f"got runner={runner!r}")
        workers = self.num_workers
        if workers is not None and (not _is_count(workers) or workers < 1):
            raise ValueError(f"num_workers must be a positive integer, got {workers!r}")
        if self.epoch is not None:  # frozen: the checked value is stored as the field
            object.__setattr__(self, "epoch", check_epoch(self.epoch))

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments (``PipelineIterator(pipeline, **kwargs)``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
