"""Executors: where the work of one iterator runs, behind one interface.

``PipelineIterator`` (``iterator.py``) keeps the books and hands items over
in lane order; what produces the items is its *executor*, the class the
runner's description names (a :class:`~zephon_torch.runners.spec.RunnerSpec`,
registered in ``registry.py``)::

    "inline", "threads", "process"  StagePoolExecutor: the stages run by the
                                    engine (``engine.py``) on this thread, their
                                    micro-batches on the runner's pool (its
                                    ``PoolSpec``: ``base.py``, ``process.py``;
                                    remote stages on Ray)
    "lanes"                         LaneExecutor: worker processes run the whole
                                    pipeline of their lanes (``lanes.py``)

An executor lives as long as its iterator. :meth:`Executor.prepare` sets up
an epoch (its pools), :meth:`Executor.build` a run from a position (the
engine), :meth:`Executor.pump` advances it until units wait in
:attr:`Executor.outputs`. Every executor yields, per lane, the same units in
the same order, so no output byte depends on which one runs. Adding a
runner is one module (an :class:`Executor`, or a pool for
:class:`StagePoolExecutor`) and one entry in ``registry.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zephon_torch.runners import resume
from zephon_torch.runners.assembly import make_pools, make_run, stage_contexts
from zephon_torch.runners.base import Pool
from zephon_torch.runners.engine import Stage
from zephon_torch.runners.lanes import LaneJob, LaneRun
from zephon_torch.runners.spec import RunnerSpec
from zephon_torch.sources.schedule import Chunk, WorkSchedule
from zephon_torch.topology import lane_shares

if TYPE_CHECKING:  # the options are checked against the registry, which names these classes
    from zephon_torch.runners.options import RunOptions

__all__ = ["Executor", "LaneExecutor", "StagePoolExecutor", "make_executor"]

#: A checked resume state's replay targets, per lane (``resume.plan_resume``).
Targets = dict[int, tuple[tuple, int, int]]


class Executor(ABC):
    """Runs the work of one iterator's lanes (see the module doc).

    Args:
        options: The run's options.
        runner: The description of the runner it runs as (``options.runner``'s,
            or its fallback's where worker processes cannot start).
        lanes: The lanes of the iterator.
        rank, world_size: The settled topology.
        default_workers: The worker count when none was asked for.

    Attributes:
        runner: The runner's name; ``spec`` its description.
        num_workers: The worker count it runs with.
        stages: The engine's stages (empty where the stages run elsewhere).
        emitter: The source's emitter, or a view of the schedule that
            tracks the chunks the workers read (``state_dict`` reads it).
        engine: What :meth:`pump` drives.
    """

    def __init__(self, options: RunOptions, runner: RunnerSpec, *, lanes: Sequence[int],
                 rank: int, world_size: int, default_workers: int, stacklevel: int) -> None:
        self.options = options
        self.spec = runner
        self.runner = runner.name
        self.lanes = list(lanes)
        self.rank = rank
        self.world_size = world_size
        self.num_workers = default_workers if options.num_workers is None \
            else options.num_workers
        self.stages: list[Stage] = []
        self.emitter: Any = None
        self.engine: Any = None
        self.remote: list[int] = []

    @abstractmethod
    def prepare(self, run: Any, schedule: WorkSchedule, compiled: Sequence[Any],
                remote: list[int]) -> None:
        """Set up an epoch: ``run`` is the epoch's pipeline, ``remote`` its Ray stages."""

    @abstractmethod
    def build(self, source: Any, state: Mapping[str, Any] | None,
              plan: resume.ResumePlan | None, targets: Targets, *, flush_every: int,
              on_chunk: Callable[[Chunk], None], on_drop: Callable[[Any], None]) -> None:
        """Make the run of ``source`` (the pipeline's source config) afresh, or from
        ``state`` (checked, planned as ``plan``, its replay ``targets``)."""

    @property
    @abstractmethod
    def outputs(self) -> deque[Any]:
        """The units produced and not yet taken, in order."""

    @abstractmethod
    def pump(self, lane: int | None) -> bool:
        """Advance until some output is ready for ``lane``; False once it has ended."""

    @abstractmethod
    def lanes_of(self, lane: int) -> Sequence[int]:
        """The lanes that end with ``lane`` when :meth:`pump` returns False for it."""

    @abstractmethod
    def pending_lanes(self) -> set[int]:
        """The lanes still replaying their window after a resume."""

    @abstractmethod
    def counters(self) -> dict[str, dict[str, int]]:
        """Per stage, its counters (``stats()["stages"]``)."""

    @abstractmethod
    def bytes_read(self, driver: int) -> int | None:
        """Bytes read from storage since the run started (None: not knowable);
        ``driver`` is what the iterating thread read while pumping."""

    @abstractmethod
    def start(self) -> None:
        """Start the run's worker processes now (only where a run has its own)."""

    def pids(self) -> list[int]:
        """The pids of the run's own worker processes."""
        return []

    @abstractmethod
    def release(self) -> None:
        """Close what an epoch set up (its pools)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the run and release every worker."""


class StagePoolExecutor(Executor):
    """The engine over the stages, their micro-batches on the runner's pool."""

    def __init__(self, options: RunOptions, runner: RunnerSpec, **kwargs: Any) -> None:
        super().__init__(options, runner, **kwargs)
        if runner.pool is None:
            raise ValueError(f"runner {runner.name!r} runs a StagePoolExecutor but describes "
                             "no pool (RunnerSpec.pool)")
        self.pool_spec = runner.pool
        self.pool: Pool | None = None
        self.ray_pool: Pool | None = None
        self._ctxs: list[Any] = []
        self._pool_bytes_base: list[int | None] = []

    def prepare(self, run: Any, schedule: WorkSchedule, compiled: Sequence[Any],
                remote: list[int]) -> None:
        self.remote = remote
        self._schedule = schedule
        self._compiled = compiled
        self._ctxs = stage_contexts(run.source, schedule, compiled, lanes=self.lanes,
                                    rank=self.rank, world_size=self.world_size,
                                    pool_spec=self.pool_spec)
        self.pool, self.ray_pool = make_pools(
            compiled, self._ctxs, remote, pool_spec=self.pool_spec, num_workers=self.num_workers,
            task_timeout=self.options.task_timeout)

    def build(self, source: Any, state: Mapping[str, Any] | None,
              plan: resume.ResumePlan | None, targets: Targets, *, flush_every: int,
              on_chunk: Callable[[Chunk], None], on_drop: Callable[[Any], None]) -> None:
        self._pool_bytes_base = self._pool_bytes_now()
        options = self.options
        run = make_run(
            source, self._schedule, self._compiled, self._ctxs, lanes=self.lanes,
            flush_every=flush_every, plan=plan, replay_targets=targets,
            on_chunk=on_chunk, on_drop=on_drop, remote=self.remote,
            pool=self.pool, ray_pool=self.ray_pool,  # type: ignore[arg-type]
            pool_spec=self.pool_spec,
            deterministic=options.deterministic, num_workers=self.num_workers)
        self.stages = run.stages
        self.emitter = run.emitter
        self.engine = run.engine
        self._replay = run.replay_filter.acc

    @property
    def outputs(self) -> deque[Any]:
        return self.engine.outputs

    def pump(self, lane: int | None) -> bool:
        return self.engine.pump()

    def lanes_of(self, lane: int) -> Sequence[int]:
        return self.lanes  # one engine for every lane: all of them end together

    def pending_lanes(self) -> set[int]:
        return self._replay.pending_lanes()  # type: ignore[attr-defined]

    def counters(self) -> dict[str, dict[str, int]]:
        return {stage.name: dict(stage.counters) for stage in self.stages}

    def _pool_bytes_now(self) -> list[int | None]:
        return [pool.bytes_read() if pool is not None else 0
                for pool in (self.pool, self.ray_pool)]

    def bytes_read(self, driver: int) -> int | None:
        if self.remote:  # Ray workers read where nothing counts them
            return None
        total = driver
        for now, then in zip(self._pool_bytes_now(), self._pool_bytes_base):
            if now is None or then is None:
                return None
            total += now - then
        return total

    def start(self) -> None:
        pass  # the pools live as long as the iterator: nothing is started per run

    def release(self) -> None:
        for pool in (self.ray_pool, self.pool):
            if pool is not None:
                pool.close()
        self.pool = self.ray_pool = None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        try:
            if self.ray_pool is not None:
                self.ray_pool.close()
        finally:
            if self.pool is not None:
                self.pool.close()


class LaneExecutor(Executor):
    """Lane worker processes, each running the whole pipeline of its share of the lanes
    (a :class:`~zephon_torch.runners.lanes.LaneRun`)."""

    def __init__(self, options: RunOptions, runner: RunnerSpec, *, lanes: Sequence[int],
                 default_workers: int, stacklevel: int, **kwargs: Any) -> None:
        super().__init__(options, runner, lanes=lanes, default_workers=default_workers,
                         stacklevel=stacklevel, **kwargs)
        if options.num_workers is None:  # no more workers than lanes by default
            self.num_workers = min(default_workers, len(self.lanes))
        # Workers beyond the rank's lanes would own none: they are not started.
        self._shares = lane_shares(self.lanes, self.num_workers, stacklevel=stacklevel + 1)

    def prepare(self, run: Any, schedule: WorkSchedule, compiled: Sequence[Any],
                remote: list[int]) -> None:
        if remote:
            raise ValueError(
                f"runner={self.runner!r} runs every stage in the lane workers, but stage(s) "
                f"{[compiled[i].name for i in remote]} are placed on Ray "
                "(placement='remote'); use runner='threads' or 'process' for them"
            )
        self._run = run
        self._schedule = schedule
        self._stage_names = [c.name for c in compiled]

    def build(self, source: Any, state: Mapping[str, Any] | None,
              plan: resume.ResumePlan | None, targets: Targets, *, flush_every: int,
              on_chunk: Callable[[Chunk], None], on_drop: Callable[[Any], None]) -> None:
        if self.engine is not None:  # a load after start(): those workers ran the old position
            self.engine.close()
        view = resume.ScheduleView(self._schedule, None if plan is None else plan.start,
                                   () if plan is None else plan.replay,
                                   ended=plan is not None and plan.start is None)

        def registered(chunk: Chunk) -> None:
            view.registered(chunk)
            on_chunk(chunk)

        options = self.options
        jobs = [LaneJob(pipeline=self._run, lanes=tuple(share), rank=self.rank,
                        world_size=self.world_size, microbatch_sizes=options.microbatch_sizes,
                        deterministic=options.deterministic, state=state,
                        finish=options.finish)
                for share in self._shares]
        prefetch = options.prefetch
        self.engine = LaneRun(jobs, on_chunk=registered, on_drop=on_drop,
                              replaying=set(targets), stage_names=self._stage_names,
                              **({} if prefetch is None else {"prefetch": prefetch}))
        self.stages = []
        self.emitter = view

    @property
    def outputs(self) -> deque[Any]:
        return self.engine.outputs

    def pump(self, lane: int | None) -> bool:
        return self.engine.pump(lane)

    def lanes_of(self, lane: int) -> Sequence[int]:
        return self.engine.lanes_of(lane)

    def pending_lanes(self) -> set[int]:
        return self.engine.pending_lanes()

    def counters(self) -> dict[str, dict[str, int]]:
        return self.engine.counters()

    def bytes_read(self, driver: int) -> int | None:
        return self.engine.bytes_read  # every read happens in the workers; they count it

    def start(self) -> None:
        self.engine.start()

    def pids(self) -> list[int]:
        return self.engine.pids()

    def release(self) -> None:
        pass  # the workers are the run's own: close() stops them

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def make_executor(options: RunOptions, runner: RunnerSpec, *, stacklevel: int = 2,
                  **kwargs: Any) -> Executor:
    """The executor of ``runner`` (``options.runner``'s description, or what it settled to).

    ``stacklevel`` is the one a warning issued by the caller itself would use;
    the executor's constructor gets it as counted from its own frame.
    """
    return runner.executor(options, runner, stacklevel=stacklevel + 2, **kwargs)
