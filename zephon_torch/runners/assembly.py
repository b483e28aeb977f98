"""The assembly of a run: stage contexts, micro-batch sizes, pools, stages, the engine.

``PipelineIterator`` builds its run from these pieces, and so does each
lane worker of ``runner="lanes"`` (``lanes.py``) for the lanes it owns. The
pools live as long as the iterator; the stages (with their accumulators) and
the engine are made again whenever a state is loaded::

    source config -> make_schedule
    compiled plan -> stage_contexts -> make_pools (local pool; Ray pool for
                                                   remote stages)
                                    -> make_run: make_stages (one Stage per compiled
                                                   stage, block mode decided here)
                                                 + the source emitter (resumed)
                                                 + make_engine

Nothing here changes an output byte: micro-batch sizes and pools decide
only how the work is cut and where it runs. What differs between the local
pools is described by a :class:`~zephon_torch.runners.spec.PoolSpec`
(:data:`INLINE_POOL`, :data:`THREAD_POOL`, :data:`PROCESS_POOL`); the
functions here ask it, never a runner's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from zephon_torch.ops.base import OpContext, Operator
from zephon_torch.ops.fused import parts_of
from zephon_torch.ops.placement import placement_options
from zephon_torch.replay import ReplayFilter
from zephon_torch.resume_changes import resume_contexts
from zephon_torch.runners.base import InlinePool, Pool, ThreadPool
from zephon_torch.runners.engine import Engine, Stage
from zephon_torch.runners.spec import PoolSpec
from zephon_torch.sources.emitter import SourceEmitter
from zephon_torch.sources.schedule import Chunk, WorkSchedule

if TYPE_CHECKING:
    from zephon_torch.runners.resume import ResumePlan

__all__ = ["INLINE_POOL", "PROCESS_POOL", "THREAD_POOL", "Run", "make_engine", "make_pools",
           "make_run", "make_schedule", "make_stages", "microbatch_size", "remote_stages",
           "stage_contexts"]

#: Smallest default micro-batch of an elementwise stage under the process runner.
_PROCESS_MICROBATCH = 512
#: Micro-batches a stage may have out at once: this many per worker, plus the
#: extra. The source is read only while every stage is below its bound, and the
#: workers run their tasks in arrival order, so small downstream tasks (a
#: packer's rows) queue behind big upstream ones (tokenizing 512 documents); a
#: tight bound then stops the source while the workers still have work, and
#: they idle. 2 per worker + 2 cost the 2-worker text job about 15% of its time.
_IN_FLIGHT_PER_WORKER = 4
_IN_FLIGHT_EXTRA = 8
_TOKEN_PRODUCERS = frozenset({"tokenize", "tokenize_chat", "pack_flat", "pack_sequences"})


def make_schedule(source: Any) -> WorkSchedule:
    """The work schedule of a pipeline's source config (every rank computes the same one)."""
    return WorkSchedule.for_source(source)


def stage_contexts(source: Any, schedule: WorkSchedule, compiled: Sequence[Any], *,
                   lanes: Sequence[int], rank: int, world_size: int,
                   pool_spec: PoolSpec) -> list[OpContext]:
    """One :class:`OpContext` per compiled stage (``source``: the pipeline's source config)."""
    weights: dict[int, float] = {}
    for dataset, w in zip(source.datasets, schedule.weights):
        weights[dataset.component_id] = weights.get(dataset.component_id, 0.0) + w
    datasets = dict(enumerate(source.datasets))
    ctxs = []
    has_tokens = False
    for i, c in enumerate(compiled):
        plan = {"datasets": datasets, "num_components": len(weights),
                "has_tokens": has_tokens}
        ctxs.append(OpContext(
            num_lanes=source.num_lanes, lanes=tuple(lanes), rank=rank,
            world_size=world_size, seed=source.seed, stage_index=i,
            stage_name=c.name, microbatch_size=microbatch_size(c, pool_spec),
            component_weights=weights if len(weights) > 1 else None, plan=plan,
        ))
        # Stages after one of these see token arrays (mixtures weigh by tokens).
        has_tokens = has_tokens or any(op.name in _TOKEN_PRODUCERS for op in parts_of(c.op))
    return ctxs


def microbatch_size(c: Any, pool_spec: PoolSpec) -> int | None:
    """The stage's micro-batch size: the override, else the operator's default.

    Where the pool asks for it (``min_elementwise_microbatch``: the process
    pool's ``_PROCESS_MICROBATCH``), an elementwise stage without an
    override takes at least that many elements: each micro-batch pays a
    round trip to a worker, and an elementwise operator's output does not
    depend on where micro-batches are cut.
    """
    least = pool_spec.min_elementwise_microbatch
    if c.microbatch_size is not None or least is None or c.local:
        return c.microbatch_size
    if not c.op.traits().elementwise or placement_options(c.op) is not None:
        return None
    return max(c.op.default_microbatch_size, least)


def remote_stages(compiled: Sequence[Any]) -> list[int]:
    """The indices of the stages placed on Ray (``placement="remote"``)."""
    return [i for i, c in enumerate(compiled) if placement_options(c.op) is not None]


def make_pools(compiled: Sequence[Any], ctxs: list[OpContext], remote: Sequence[int], *,
               pool_spec: PoolSpec, num_workers: int,
               task_timeout: float | None) -> tuple[Pool, Pool | None]:
    """The local pool ``pool_spec`` makes, and the Ray pool of the remote stages (None if
    none).

    The local pool gets a stand-in for each remote stage. If the Ray pool
    cannot be made, the local pool is closed before the error propagates.
    """
    ops = [c.op for c in compiled]
    pool = pool_spec.make([_RemoteStandIn() if i in remote else op for i, op in enumerate(ops)],
                          ctxs, num_workers, task_timeout)
    if not remote:
        return pool, None
    from zephon_torch.runners.ray import RayPool

    try:
        return pool, RayPool(ops, ctxs, list(remote), upstream=pool)
    except BaseException:
        pool.close()
        raise


def _inline_pool(ops: list[Any], ctxs: list[OpContext], num_workers: int,
                 task_timeout: float | None) -> Pool:
    return InlinePool(ops, ctxs)


def _thread_pool(ops: list[Any], ctxs: list[OpContext], num_workers: int,
                 task_timeout: float | None) -> Pool:
    return ThreadPool(ops, ctxs, num_workers)


def _process_pool(ops: list[Any], ctxs: list[OpContext], num_workers: int,
                  task_timeout: float | None) -> Pool:
    from zephon_torch.runners.process import ProcessPool

    pool = ProcessPool(ops, ctxs, num_workers, task_timeout=task_timeout)
    for op, ctx in zip(ops, ctxs):
        if op.traits().inline:  # run on this thread: set up here too
            op.setup(ctx)
    return pool


#: Every stage on the iterating thread (``runner="inline"``, and each lane worker).
INLINE_POOL = PoolSpec(_inline_pool, on_this_thread=True)
#: Threads of this process (``runner="threads"``).
THREAD_POOL = PoolSpec(_thread_pool)
#: Spawned worker processes (``runner="process"``).
PROCESS_POOL = PoolSpec(_process_pool, min_elementwise_microbatch=_PROCESS_MICROBATCH)


def make_stages(compiled: Sequence[Any], ctxs: Sequence[OpContext], *, remote: Sequence[int],
                pool: Pool, ray_pool: Any, pool_spec: PoolSpec,
                deterministic: bool) -> list[Stage]:
    """One engine :class:`Stage` per compiled stage, each with a fresh accumulator.

    A stage takes blocks while the stream is records (before the first
    stage that produces batches) and its accumulator and operator have a
    block path; only ``batch(drop_last=True)`` may stall a sentinel.
    """
    from zephon_torch.ops.batch import Batch

    stages = []
    before_batch = True  # the stream is records (blocks), not batches, here
    for i, (c, ctx) in enumerate(zip(compiled, ctxs)):
        acc = c.op.accumulator(deterministic=deterministic, ctx=ctx)
        # Only batch(drop_last=True) may stall a sentinel: decided from the instance.
        stalls = isinstance(c.op, Batch) and bool(c.op.drop_last)
        blocks = before_batch and acc.takes_blocks and c.op.has_block_path()
        before_batch = before_batch and not c.op.traits().produces_batches
        if i in remote:  # on Ray
            stages.append(Stage(
                i, c.name, c.op, acc, ray_pool, local=False, stalls=stalls, blocks=blocks,
                max_in_flight=ray_pool.max_in_flight(i),
            ))
            continue
        local = c.local or pool_spec.on_this_thread
        stages.append(Stage(i, c.name, c.op, acc, pool, local=local, stalls=stalls,
                            blocks=blocks))
    return stages


class Run(NamedTuple):
    """The per-run half of an iterator: stages with fresh accumulators, emitter, engine."""

    stages: list[Stage]
    emitter: SourceEmitter
    engine: Engine
    replay_filter: Stage  # the planner's replay filter, whose accumulator drops replays


def make_run(source: Any, schedule: WorkSchedule, compiled: Sequence[Any],
             ctxs: Sequence[OpContext], *, lanes: Sequence[int], flush_every: int,
             plan: ResumePlan | None, replay_targets: dict[int, tuple[tuple, int, int]],
             on_chunk: Callable[[Chunk], None], on_drop: Callable[[Any], None],
             remote: Sequence[int], pool: Pool, ray_pool: Any, pool_spec: PoolSpec,
             deterministic: bool, num_workers: int) -> Run:
    """Stages, source emitter and engine for ``lanes``, started afresh or as ``plan`` says.

    Args:
        source: The pipeline's source config.
        plan: Where a resumed run starts (``resume.plan_resume``), or None.
        replay_targets: The replay filter's targets (from the same ``plan_resume``).
        on_chunk: Called with every chunk the emitter emits (the books register it).
        on_drop: Called with every replayed row the replay filter drops.
    """
    replay_filter = next(c.op for c in compiled if isinstance(c.op, ReplayFilter))
    replay_filter.targets = replay_targets  # read by the accumulator make_stages creates
    replay_filter.on_drop = on_drop
    if plan is not None:  # operators resumed under changed parameters (resume_changes.py)
        ctxs = resume_contexts(compiled, ctxs, plan.earlier)
    stages = make_stages(compiled, ctxs, remote=remote, pool=pool, ray_pool=ray_pool,
                         pool_spec=pool_spec, deterministic=deterministic)
    emitter = SourceEmitter(
        schedule, source.datasets, lanes=lanes, flush_every=flush_every, on_chunk=on_chunk,
        start=None if plan is None else plan.start,
        lane_next={} if plan is None else plan.lane_next,
        replay=[] if plan is None else plan.replay,
    )
    if plan is not None and plan.start is None:
        emitter.finished = True  # every lane's stream had ended
    engine = make_engine(emitter, stages, deterministic=deterministic, num_workers=num_workers)
    return Run(stages, emitter, engine,
               next(s for s in stages if isinstance(s.op, ReplayFilter)))


def make_engine(emitter: SourceEmitter, stages: list[Stage], *, deterministic: bool,
                num_workers: int) -> Engine:
    """The engine over ``stages``, with the in-flight bound of ``num_workers`` workers."""
    return Engine(emitter, stages, deterministic=deterministic,
                  max_in_flight=_IN_FLIGHT_PER_WORKER * num_workers + _IN_FLIGHT_EXTRA)


class _RemoteStandIn(Operator):
    """Takes a remote stage's place in the local pool: nothing to set up, never run."""

    name = "remote_stand_in"

    def process_many(self, elems: Any) -> list[Any]:
        raise RuntimeError("a remote stage's micro-batch reached the local pool (a zephon bug)")
