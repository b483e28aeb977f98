"""``Pipeline.change_lanes``: resume a run on more lanes than it began with, from a state on.

A run's lanes bound its world size: every rank needs a lane. A run that
began with 8 and must go on over 16 or 1,024 ranks grows its lanes at the
chunk after the state's *change point* (``sources/weight_plan.change_point``:
the highest global chunk of any lane's ``next``), so every chunk a lane has
registered, replays or names as its next lies before it and is dealt as it
was. From that chunk on the chunks
go round the new lane count (``sources/lane_plan.py``): the old lanes carry
on with their state (their bins, buffers and partial batches), the new ones
start fresh at their first chunk. The point depends on the whole state,
never on the world size, so every world size resuming the same state runs
the same stream, which is that of a run that grew its lanes at that step.

The change travels in the pipeline's fingerprint (a ``lane_changes`` part),
so the states the grown run saves carry it; ``change_lanes`` again on the
original pipeline with such a state finds it there and adds nothing when
the lanes asked for are those already in force. A state saved before the
change still resumes on the grown pipeline (its new lanes start fresh at the
point); a later state of the run before the change does not (its lanes went
past the point under the old dealing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from zephon_torch.checkpoint import check_state
from zephon_torch.epochs import state_epoch
from zephon_torch.sources.lane_plan import LaneChange, lane_changes_from_json, lane_count
from zephon_torch.sources.weight_plan import change_point

if TYPE_CHECKING:
    from zephon_torch.pipeline import Pipeline

__all__ = ["change_lanes"]

_ACTION = "change_lanes"


def change_lanes(pipeline: Pipeline, num_lanes: int, *, state: Mapping[str, Any]) -> Pipeline:
    """``pipeline`` with ``num_lanes`` lanes from ``state``'s change point on.

    Args:
        pipeline: The pipeline ``state`` was saved by, as first built (lane
            changes the state already holds are taken from it).
        num_lanes: The lanes from the change point on: more than the state
            has (the same number: nothing changes).
        state: A whole state (every lane's entry: a ``merge_states`` or
            gathered one) saved by ``pipeline``.

    Raises:
        ValueError: ``num_lanes`` is not a whole number above the state's
            lanes, ``state`` is not one of ``pipeline``'s, lacks lanes or has
            ended.
    """
    if isinstance(num_lanes, bool) or not isinstance(num_lanes, int) or num_lanes < 1:
        raise ValueError(f"{_ACTION}: num_lanes must be a positive integer, got {num_lanes!r}")
    base = _with_saved_changes(pipeline, state)
    check_state(state, base.fingerprint(), stage_names=base.stage_names())
    held = base.source.lane_changes
    have = lane_count(base.source)
    if num_lanes == have:
        return base  # already in force (a relaunch after the change): nothing to add
    if num_lanes < have:
        raise ValueError(
            f"{_ACTION}: the state has {have} lanes and lanes only grow (asked for "
            f"{num_lanes}): a rank may own several lanes, so {num_lanes} ranks resume the "
            f"{have} lanes as they are; load the state without change_lanes")
    # The chunk after the highest next: that next chunk stays its lane's (the lane's
    # entry names it), and every chunk a lane has fixed lies before it.
    point = change_point(state, have, action=_ACTION) + 1
    change = LaneChange(point, num_lanes, state_epoch(state))
    return pipeline.with_source(lane_changes=(*held, change))


def _with_saved_changes(pipeline: Pipeline, state: Mapping[str, Any]) -> Pipeline:
    """``pipeline`` with the lane changes ``state`` holds (none: as it is)."""
    fingerprint = state.get("fingerprint") if isinstance(state, Mapping) else None
    saved = lane_changes_from_json(fingerprint.get("lane_changes")
                                   if isinstance(fingerprint, Mapping) else None)
    own = list(pipeline.source.lane_changes)
    if own and own != saved[:len(own)]:
        raise ValueError(f"{_ACTION}: the pipeline's own lane changes are not those of the "
                         "state; pass the pipeline as first built")
    if len(saved) == len(own):
        return pipeline
    return pipeline.with_source(lane_changes=tuple(saved))
