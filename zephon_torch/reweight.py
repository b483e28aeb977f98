"""``Pipeline.change_weights``: resume a mixture under new weights from a state's step on.

The pipeline a state was saved by, with the mixture weights changed at the
state's *change point* (``sources/weight_plan.py``): the highest global chunk
of any lane's ``next``, so that every chunk a lane has registered or replays,
and every schedule state the state holds, lies before it. Every chunk before
it is computed with the weights before, exactly as saved (so every window
replays as it ran, and every sample of the stream is read once); from it on
the round-robin restarts on the new weights from the counts reached there
(those of the lane whose ``next`` it is). The point depends on the
whole state (every lane's ``next``), never on the world size, so any world
size resuming the same global state runs the same stream, and the result is
that of a run that changed the weights at that step: the same pipeline,
uninterrupted, gives the saved run's items up to the state and the resumed
run's after it.

The change travels in the pipeline's fingerprint (a ``weight_changes`` part,
with its values), so the states it saves carry it, and a later resume
rebuilds it: ``base.change_weights(new, state=later_state)`` on the original
pipeline finds the change in the state and adds nothing when the weights are
those already in force. A state saved before the change still resumes on
the changed pipeline (the change lies after it); a later state of the run
before the change does not (its lanes went past the point).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zephon_torch.checkpoint import check_state
from zephon_torch.epochs import epoch_pipeline, state_epoch
from zephon_torch.pipeline_sources import resolve_weights
from zephon_torch.sources.schedule import ScheduleState, WorkSchedule
from zephon_torch.sources.weight_plan import (
    MixtureWeights,
    WeightChange,
    change_point,
    changes_from_json,
    next_before,
)

if TYPE_CHECKING:
    from zephon_torch.pipeline import Pipeline

__all__ = ["change_weights", "counts_at"]

_ACTION = "change_weights"


def change_weights(pipeline: Pipeline, weights: Mapping[int, float] | Sequence[float], *,
                   state: Mapping[str, Any]) -> Pipeline:
    """``pipeline`` with mixture ``weights`` from ``state``'s change point on.

    Args:
        pipeline: The pipeline ``state`` was saved by (its original weights;
            changes the state already holds are taken from it).
        weights: The new weights, as ``Pipeline.from_sources`` takes them (one
            per dataset, or a mapping component -> weight); 0 leaves a dataset
            out from the change on. The same datasets: a dataset added or
            removed is another configuration.
        state: A whole state (every lane's entry: a ``merge_states`` or
            gathered one) saved by ``pipeline``.

    Raises:
        ValueError: ``state`` is not one of ``pipeline``'s, lacks lanes or has
            ended, the weights are not valid, or an operator steers toward
            the source weights (``ensure_mixture`` without ``mixture=``).
    """
    source = pipeline.source
    if len(source.datasets) < 2:
        raise ValueError(f"{_ACTION}: the pipeline reads one dataset, so it has no mixture "
                         "weights to change; build it with Pipeline.from_sources([...], "
                         "weights=...)")
    for op in pipeline.ops:
        if getattr(op, "name", None) == "ensure_mixture" and getattr(op, "mixture", 0) is None:
            raise ValueError(
                f"{_ACTION}: ensure_mixture() without mixture= steers each lane toward the "
                "source weights, and it runs before the resume point (its replayed windows "
                "must come out as saved): give it explicit targets, ensure_mixture("
                "mixture={component: weight, ...}), from the start of the run, or leave it out"
            )
    new = resolve_weights(source.datasets, weights)
    if new is None or len(new) != len(source.datasets):
        raise ValueError(f"{_ACTION}: weights {weights!r} must give one weight per dataset "
                         f"({len(source.datasets)}), or a mapping component -> weight")
    base = _with_saved_changes(pipeline, state)
    check_state(state, base.fingerprint(), stage_names=base.stage_names())
    held: MixtureWeights = base.source.weights
    if tuple(new) == held.current():
        return base  # already in force (a relaunch after the change): nothing to add
    epoch = state_epoch(state)
    point = change_point(state, int(state["num_lanes"]), action=_ACTION)
    changes = [c for c in held.changes if not (c.at_chunk == point and c.epoch == epoch)]
    trial = MixtureWeights(held, [*changes, WeightChange(point, new, (0,) * len(new), epoch)],
                           proportional=held.proportional)
    # Validates the new weights (finite, >= 0, a share only where there are samples).
    _epoch_schedule(pipeline.with_source(weights=trial), epoch)
    lane_next = next_before(state, point)
    counts = counts_at(_epoch_schedule(base, epoch), ScheduleState.from_json(lane_next), point)
    change = WeightChange(point, tuple(new), counts, epoch)
    return pipeline.with_source(weights=MixtureWeights(held, [*changes, change],
                                                       proportional=held.proportional))


def counts_at(schedule: WorkSchedule, state: ScheduleState, global_chunk: int
              ) -> tuple[int, ...]:
    """The counts of ``schedule`` at ``global_chunk``, walking from ``state`` (before it).

    Raises:
        ValueError: The stream ends before ``global_chunk``.
    """
    while state.global_chunk < global_chunk:
        components, state = schedule.advance(state)
        if components is None:
            raise ValueError(f"{_ACTION}: the stream ends at global chunk "
                             f"{state.global_chunk}, before the change point {global_chunk}; "
                             "resume with the weights the state was saved by")
    return state.counts


def _with_saved_changes(pipeline: Pipeline, state: Mapping[str, Any]) -> Pipeline:
    """``pipeline`` with the weight changes ``state`` holds (none: as it is)."""
    fingerprint = state.get("fingerprint") if isinstance(state, Mapping) else None
    saved = changes_from_json(fingerprint.get("weight_changes")
                              if isinstance(fingerprint, Mapping) else None)
    weights = pipeline.source.weights
    own = getattr(weights, "changes", ())
    if own and list(own) != saved[:len(own)]:
        raise ValueError(f"{_ACTION}: the pipeline's own weight changes are not those of the "
                         "state; pass the pipeline as first built (its original weights)")
    if weights is None:
        sizes = [float(len(d)) for d in pipeline.source.datasets]
        held = MixtureWeights(sizes, saved, proportional=True)
    else:
        held = MixtureWeights(weights, saved,
                              proportional=getattr(weights, "proportional", False))
    return pipeline.with_source(weights=held)


def _epoch_schedule(pipeline: Pipeline, epoch: int) -> WorkSchedule:
    src = epoch_pipeline(pipeline, epoch).source
    return WorkSchedule.for_source(src)
