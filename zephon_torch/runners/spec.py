"""What a runner is: one frozen description per runner, asked instead of its name.

A runner (``Pipeline.iter(runner=...)``) is a :class:`RunnerSpec`: its name,
the executor class that runs it (``executor.py``), the local pool of a
stage-pool runner (a :class:`PoolSpec`) and what it implies: whether it
starts worker processes of its own (then a daemonic process, such as a torch
DataLoader worker, runs its ``fallback`` instead), whether it takes
``task_timeout`` (a micro-batch runs in a worker process that can be
stopped), whether it takes ``finish``/``prefetch`` (lane workers). The
options (``options.py``), the iterator and the assembly of a run
(``assembly.py``) ask these questions; no code branches on a runner's name.

The descriptions are registered in one place, ``registry.py``: adding a
runner is one module (its executor, or its pool) and one entry there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PoolSpec", "RunnerSpec"]


@dataclass(frozen=True)
class PoolSpec:
    """The local pool of a stage-pool runner: how it is made and what that implies.

    Args:
        make: ``make(ops, ctxs, num_workers, task_timeout)`` returns the pool
            (a :class:`~zephon_torch.runners.base.Pool`) over the stages' operators.
        on_this_thread: The stages run on the iterating thread (every stage
            is ``local`` to the engine).
        min_elementwise_microbatch: The smallest default micro-batch of an
            elementwise stage without an override (each micro-batch pays a
            round trip to a worker); None: the operator's default.
    """

    make: Callable[..., Any]
    on_this_thread: bool = False
    min_elementwise_microbatch: int | None = None


@dataclass(frozen=True)
class RunnerSpec:
    """One runner (see the module doc).

    Args:
        name: What ``Pipeline.iter(runner=...)`` calls it.
        executor: The :class:`~zephon_torch.runners.executor.Executor`
            subclass that runs it; it is made with this description.
        pool: The local pool of a stage-pool executor (None: the executor
            runs the stages elsewhere, as lane workers do).
        starts_processes: It starts worker processes of its own, which a
            daemonic process cannot: there ``fallback`` runs instead.
        fallback: The runner a daemonic process runs in its place.
        takes_task_timeout: It accepts ``task_timeout=`` (a micro-batch runs
            in a worker process, which can be stopped).
        takes_finish: It accepts ``finish=`` and ``prefetch=`` (its workers
            run the whole pipeline and can finish a batch themselves).
    """

    name: str
    executor: type
    pool: PoolSpec | None = None
    starts_processes: bool = False
    fallback: str = "inline"
    takes_task_timeout: bool = False
    takes_finish: bool = False
