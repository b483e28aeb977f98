"""The planner: a pipeline's chain of operators as the stages a runner runs.

:func:`compile_plan` (``Pipeline.compile``) names the stages (the method
name, suffixed ``_1``, ``_2`` ... when it repeats, :func:`stage_names`),
inserts the replay filter (:class:`~zephon_torch.replay.ReplayFilter`) right
before ``batch`` (or at the end), checks the chain (a pointer record may only
meet ``fetch``), fixes each stage's micro-batch size (the operator's default
unless ``microbatch_sizes`` overrides it; sizes that define the output are
parameters, not knobs) and fuses runs of elementwise stages
(:func:`fuse`). :func:`flush_every` decides the flush-sentinel period:
``flush_every_k_chunks=None`` means 8 when an operator does not preserve
cursor order (packing, shuffle, mixture) and 0 (no sentinels) otherwise.

The planner reads a pipeline's parts (its ``SourceConfig`` and operators),
never the ``Pipeline`` class, so the builder imports it and not the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zephon_torch.ops.base import Operator
from zephon_torch.ops.fused import FusedOperator
from zephon_torch.ops.placement import placement_options
from zephon_torch.replay import ReplayFilter

__all__ = ["CompiledStage", "compile_plan", "flush_every", "fuse", "stage_names"]

_DEFAULT_FLUSH_EVERY = 8
# Stages whose size defines the output: naming them in microbatch_sizes is an error.
_OUTPUT_DEFINING = frozenset({"batch", "shuffle", "ensure_mixture", "replay_filter"})


@dataclass(frozen=True, slots=True)
class CompiledStage:
    """A stage of a compiled plan."""

    name: str
    op: Operator
    microbatch_size: int | None
    local: bool


def stage_names(ops: Sequence[Operator]) -> list[str]:
    """The names of the user's stages (method names, suffixed when repeated)."""
    stems = [op.name for op in ops]
    totals: dict[str, int] = {}
    for stem in stems:
        totals[stem] = totals.get(stem, 0) + 1
    seen: dict[str, int] = {}
    names = []
    for stem in stems:
        if totals[stem] > 1:
            seen[stem] = seen.get(stem, 0) + 1
            names.append(f"{stem}_{seen[stem]}")
        else:
            names.append(stem)
    return names


def flush_every(source: Any, ops: Sequence[Operator]) -> int:
    """The effective flush-sentinel period of ``ops`` over ``source`` (0: no sentinels).

    Raises:
        ValueError: ``flush_every_k_chunks=0`` with an operator that reorders.
    """
    configured = source.flush_every_k_chunks
    reorders = [op.name for op in ops if not op.traits().preserves_cursor_order]
    if configured == 0 and reorders:
        raise ValueError(
            f"flush_every_k_chunks=0 (no flush sentinels) needs an order-preserving plan, "
            f"but {reorders} reorder(s) records: their state would span the whole run and "
            "no checkpoint could resume it; leave flush_every_k_chunks=None (8) or set a "
            "positive period"
        )
    if configured is not None:
        return configured
    return _DEFAULT_FLUSH_EVERY if reorders else 0


def compile_plan(source: Any, ops: Sequence[Operator],
                 microbatch_sizes: Mapping[str, int] | None = None) -> list[CompiledStage]:
    """Validated stages of ``ops`` over ``source``, with the replay filter in place.

    Raises:
        ValueError: A pointer record would meet another operator than
            ``fetch``, or ``microbatch_sizes`` names no stage, a stage whose
            size defines the output, or a size that is not a positive integer.
    """
    _validate_chain(source, ops)
    names = stage_names(ops)
    overrides = dict(microbatch_sizes or {})
    for name, size in overrides.items():
        if name not in names:
            raise ValueError(
                f"microbatch_sizes names {name!r}, which is not a stage of this pipeline "
                f"(stages: {names})"
            )
        op = ops[names.index(name)]
        if op.name in _OUTPUT_DEFINING:
            raise ValueError(
                f"microbatch_sizes[{name!r}]: the size of {op.name!r} defines the output, "
                f"so it is a parameter of .{op.name}(), not a performance knob"
            )
        _check_size(f"microbatch_sizes[{name!r}]", size)
    stages = fuse([
        CompiledStage(name, op, overrides.get(name), op.traits().inline)
        for name, op in zip(names, ops)
    ])
    cut = next((i for i, c in enumerate(stages) if c.op.traits().produces_batches),
               len(stages))
    replay = ReplayFilter()
    stages.insert(cut, CompiledStage("replay_filter", replay, None, True))
    return stages


def _check_size(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; it is how many "
                         "records one task of that stage holds; omit the stage to use the "
                         "operator's default")


def _validate_chain(source: Any, ops: Sequence[Operator]) -> None:
    shards = [s for d in source.datasets for s in d.shards()]
    emits_pointers = any(s.access == "pointer" for s in shards)
    if not emits_pointers:
        return
    names = stage_names(ops)
    if not ops or not ops[0].traits().accepts_pointers:
        where = f"before .{names[0]}()" if names else "to the pipeline"
        raise ValueError(
            f"this source emits pointer records (the bytes are still on disk): add "
            f".fetch() {where}, usually followed by .decode_text()"
        )


def fuse(stages: list[CompiledStage]) -> list[CompiledStage]:
    """Merge runs of consecutive elementwise stages into fused stages.

    Stages join a run when both are elementwise, neither runs inline and
    they share a placement (remote stages: the same ``Remote`` options). A
    fused stage takes the largest micro-batch size overridden for any of its
    parts (else the largest default of its parts).
    Fusing changes where micro-batches are cut, which elementwise operators
    do not see, so no output changes (see ``ops/fused.py``).
    """

    def joins(prev: CompiledStage, nxt: CompiledStage) -> bool:
        a, b = prev.op.traits(), nxt.op.traits()
        return (a.elementwise and b.elementwise and not prev.local and not nxt.local
                and placement_options(prev.op) == placement_options(nxt.op))

    runs: list[list[CompiledStage]] = []
    for stage in stages:
        if runs and joins(runs[-1][-1], stage):
            runs[-1].append(stage)
        else:
            runs.append([stage])
    out = []
    for run in runs:
        if len(run) == 1:
            out.append(run[0])
            continue
        fused = FusedOperator([(c.name, c.op) for c in run])
        sizes = [c.microbatch_size for c in run if c.microbatch_size is not None]
        out.append(CompiledStage("+".join(c.name for c in run), fused,
                                 max(sizes) if sizes else None, False))
    return out
