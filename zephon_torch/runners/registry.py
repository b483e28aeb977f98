"""The runners ``Pipeline.iter`` takes: one description each, registered here.

Each entry is a :class:`~zephon_torch.runners.spec.RunnerSpec`: the name,
the executor that runs it, its local pool and what it implies. Everything
else is derived from this table: the names and their order
(``options.RUNNERS``, the error that lists them), the checks of the run's
options, the fallback of a daemonic process, the executor the iterator makes,
the pool and micro-batch sizes of the assembly.

Adding a runner is one module (an
:class:`~zephon_torch.runners.executor.Executor` subclass, or a pool with its
:class:`~zephon_torch.runners.spec.PoolSpec` for the stage-pool executor) and
one entry in :data:`SPECS` below; ``docs/architecture.md`` says more.
"""

from __future__ import annotations

from zephon_torch.runners.assembly import INLINE_POOL, PROCESS_POOL, THREAD_POOL
from zephon_torch.runners.executor import Executor, LaneExecutor, StagePoolExecutor
from zephon_torch.runners.spec import RunnerSpec

__all__ = ["EXECUTORS", "RUNNER_SPECS", "SPECS", "runner_spec"]

#: Every runner, in the order the names are listed (``options.RUNNERS``).
SPECS: tuple[RunnerSpec, ...] = (
    RunnerSpec("inline", StagePoolExecutor, pool=INLINE_POOL),
    RunnerSpec("threads", StagePoolExecutor, pool=THREAD_POOL),
    RunnerSpec("process", StagePoolExecutor, pool=PROCESS_POOL, starts_processes=True,
               takes_task_timeout=True),
    RunnerSpec("lanes", LaneExecutor, starts_processes=True, takes_finish=True),
)

#: The description of each runner, by name (in the order of :data:`SPECS`).
RUNNER_SPECS: dict[str, RunnerSpec] = {spec.name: spec for spec in SPECS}
if len(RUNNER_SPECS) != len(SPECS):
    raise ValueError(f"two runners have one name: {[spec.name for spec in SPECS]}")
for _spec in SPECS:  # a daemonic process must be able to run the fallback
    if _spec.starts_processes and (_spec.fallback not in RUNNER_SPECS
                                   or RUNNER_SPECS[_spec.fallback].starts_processes):
        raise ValueError(f"runner {_spec.name!r} falls back to {_spec.fallback!r}, which is "
                         "not a runner without worker processes")
#: The executor class of each runner (each an :class:`Executor` subclass).
EXECUTORS: dict[str, type[Executor]] = {spec.name: spec.executor for spec in SPECS}


def runner_spec(name: str) -> RunnerSpec:
    """The description of the runner ``name`` (a KeyError if there is none;
    ``options.check_runner`` says it in the words of ``Pipeline.iter``)."""
    return RUNNER_SPECS[name]
