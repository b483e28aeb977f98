"""Saving and resuming a ``PipelineIterator``'s position.

``state_dict()`` and ``load_state_dict()`` are thin methods of the iterator
(they hold its lock); what they compute is here:

* :func:`lane_entries` and :func:`make_state`: a state from the iterator's
  books (a lane still replaying a loaded state keeps the loaded entry);
* :func:`checked_state`: a state validated for this iterator (``check_state``
  plus its lanes);
* :func:`check_resumable`: its lane entries checked against the schedule of
  its epoch (``state_checks.py``), before anything runs;
* :func:`plan_resume`: what a loaded state means for a new run: where each
  lane's progress starts, the replay targets of the replay filter, the
  windows the source emits again, the emitter's first chunk and the
  round-robin position;
* :func:`narrow_state`: the part of a state that concerns some lanes (a
  rank's, a worker's), still a valid state;
* :class:`ScheduleView`: what a state needs to know of the source emitter,
  for an iterator whose emitters run in lane workers (``runner="lanes"``).

The state format itself, its checks and the replay filter are in
``checkpoint.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from zephon_torch.accounting import Accounting
from zephon_torch.checkpoint import (
    STATE_VERSION,
    check_state,
    key_from_json,
    lane_state,
    state_checksum,
)
from zephon_torch.epochs import epoch_pipeline, state_epoch
from zephon_torch.resume_changes import EARLIER_KEY, plan_earlier
from zephon_torch.runners.assembly import make_schedule
from zephon_torch.sources.lane_plan import (
    LanePlan,
    lane_changes_from_json,
    lane_count,
    total_lanes,
)
from zephon_torch.sources.schedule import Chunk, ScheduleState, WorkSchedule
from zephon_torch.sources.weight_plan import next_before
from zephon_torch.state_checks import check_against_schedule

__all__ = ["ResumePlan", "ScheduleView", "check_resumable", "checked_state", "lane_entries",
           "make_state", "narrow_state", "plan_resume", "with_grown_lanes"]


class EmitterView(Protocol):
    """What :func:`lane_entries` asks of the source emitter (or a :class:`ScheduleView`)."""

    finished: bool

    def pending_replay(self, global_chunk: int) -> ScheduleState | None:
        """The start state of a chunk still to be replayed, if it is one."""

    def state_of(self, global_chunk: int) -> ScheduleState | None:
        """The schedule state at a chunk not emitted yet (None: past the end)."""


def lane_entries(accounting: Accounting, lanes: Sequence[int], loaded: Mapping[str, Any],
                 replaying: set[int], emitter: EmitterView,
                 plan: LanePlan) -> dict[str, dict[str, Any]]:
    """Each lane's entry of a state, after the last item handed to the caller.

    A lane still replaying has delivered nothing new, so its position is the
    loaded one: the lanes in ``replaying`` (the replay filter's pending ones)
    and those whose output count is still the loaded state's.
    """
    saved = loaded["lanes"]
    replaying = replaying | {
        lane for lane in lanes
        if str(lane) in saved and accounting.lanes[lane].outputs == saved[str(lane)]["outputs"]
    }

    def next_state(global_chunk: int, exhausted: bool) -> ScheduleState | None:
        pending = emitter.pending_replay(global_chunk)
        if pending is not None:
            return pending
        if exhausted or emitter.finished:
            return None
        return emitter.state_of(global_chunk)

    return {
        str(lane): (dict(saved[str(lane)]) if lane in replaying else
                    lane_state(accounting.lanes[lane], next_state, plan,
                               earlier=saved.get(str(lane), {}).get(EARLIER_KEY)))
        for lane in lanes
    }


def make_state(*, deterministic: bool, parts: dict[str, Any], num_lanes: int,
               lanes: dict[str, Any], round_robin: dict[str, Any] | None,
               epoch: int = 0) -> dict[str, Any]:
    """A state with its checksum (``parts``: the fingerprint's parts; ``epoch``: the run's)."""
    state = {
        "version": STATE_VERSION,
        "deterministic": deterministic,
        "fingerprint": parts,
        "num_lanes": num_lanes,
        "epoch": epoch,
        "lanes": lanes,
        "round_robin": round_robin,
    }
    state["checksum"] = state_checksum(state)
    return state


def checked_state(state: Any, *, pipeline: Any, fingerprint: Mapping[str, Any],
                  stage_names: Sequence[str], deterministic: bool,
                  lanes: Sequence[int]) -> dict[str, Any]:
    """``state`` validated for an iterator over ``lanes`` (see ``check_state``), with
    entries for the lanes ``pipeline`` grew since (:func:`with_grown_lanes`).

    Raises:
        ValueError: The state is corrupted, from another configuration or
            another lane count, or lacks one of ``lanes``.
        NotCheckpointableError: ``deterministic`` is False.
    """
    state = check_state(state, fingerprint, stage_names=stage_names,
                        deterministic=deterministic)
    state = with_grown_lanes(state, pipeline, lanes)
    check_lanes_present(state, lanes)
    return state


def with_grown_lanes(state: dict[str, Any], pipeline: Any,
                     lanes: Sequence[int] | None = None) -> dict[str, Any]:
    """``state`` (checked against ``pipeline``) with an entry for each lane ``pipeline``
    grew after it was saved (``Pipeline.change_lanes``, ``sources/lane_plan.py``), or
    for those of them among ``lanes`` (the ones that resume here).

    A new lane starts fresh at its first chunk, as every lane does at the start
    of a run: no window, nothing delivered, its ``next`` the schedule state
    there. A state that has every lane already is returned as it is.

    Raises:
        ValueError: The state's lane count is neither the pipeline's nor the one
            its own lane changes give.
    """
    source = pipeline.source
    total = lane_count(source)
    have = state["num_lanes"]
    if have == total:
        return state
    saved = lane_changes_from_json(state["fingerprint"].get("lane_changes"))
    if have != total_lanes(source.num_lanes, saved) or have > total:
        raise ValueError(f"the state has {have} lanes, this pipeline {total}")
    schedule = make_schedule(epoch_pipeline(pipeline, state_epoch(state)).source)
    plan = schedule.lanes
    new = [lane for lane in (range(have, total) if lanes is None else lanes) if lane >= have]
    firsts = {plan.first_chunk(lane): lane for lane in new if lane < plan.total}
    entries: dict[str, Any] = {str(lane): _fresh_entry(None) for lane in new}
    if firsts:
        begin = next_before(state, min(firsts))
        at: ScheduleState | None = (ScheduleState.from_json(begin) if begin is not None
                                    else schedule.initial_state())
        for g in sorted(firsts):
            at = schedule.jump(at, g)  # type: ignore[arg-type]
            if at is None or schedule.jump(at, g + 1) is None:
                break  # the stream ends first: those lanes never get a chunk
            entries[str(firsts[g])] = _fresh_entry(at.to_json())
    grown = {k: v for k, v in state.items() if k != "checksum"}
    grown["lanes"] = {**state["lanes"], **entries}
    grown["num_lanes"] = total
    grown["round_robin"] = None  # another set of lanes: loading picks the least served
    grown["checksum"] = state_checksum(grown)
    return grown


def _fresh_entry(nxt: list[int] | None) -> dict[str, Any]:
    """A lane's entry before its first chunk (``nxt``: the schedule state there)."""
    return {"window": [], "epoch_boundaries": [], "replay_cursor": None, "replay_count": 0,
            "next": nxt, "outputs": 0}


def check_lanes_present(state: Mapping[str, Any], lanes: Sequence[int]) -> None:
    """Refuse a state without an entry for each of ``lanes`` (the lanes that resume it).

    Raises:
        ValueError: Some lane is missing: the state is another rank's.
    """
    missing = [lane for lane in lanes if str(lane) not in state["lanes"]]
    if missing:
        raise ValueError(
            f"the state has no entry for lane(s) {missing} (it holds lanes "
            f"{sorted(int(k) for k in state['lanes'])}): it is one rank's state, and this "
            "iterator resumes other lanes (another world size or rank). If every rank saved its "
            "state, merge them with zephon_torch.checkpoint.merge_states() and load the result; "
            "if only one rank wrote the checkpoint (usually rank 0), its file lacks the others' "
            "lanes: save with loader.state_dict(gather=True) (zephon_torch.DataLoader gathers "
            "every rank's state into one, the default when Lightning saves), or merge_states() "
            "of all the ranks' states before writing"
        )


def check_resumable(state: Mapping[str, Any], pipeline: Any, *, epoch: int,
                    lanes: Sequence[int], schedule: WorkSchedule | None = None) -> None:
    """Check a state's lane entries against the schedule of its ``epoch`` (see
    ``state_checks.py``); ``lanes`` are those that resume from it.

    ``schedule``: the epoch's schedule when the caller has it (else it is made
    from ``pipeline``, the one the state's fingerprint describes).

    Raises:
        ValueError: A lane entry is not one the pipeline could have written.
    """
    if schedule is None:
        schedule = make_schedule(epoch_pipeline(pipeline, epoch).source)
    check_against_schedule(state, schedule, flush_every=pipeline.flush_every(), lanes=lanes)


class ResumePlan(NamedTuple):
    """Where a resumed run starts (see :func:`plan_resume`)."""

    start: ScheduleState | None  # the emitter's first chunk (None: every lane had ended)
    lane_next: dict[int, int]  # per lane, the global chunk of its next new chunk
    replay: list[ScheduleState]  # the chunks of the windows, emitted again first
    round_robin: int  # the index of the lane to deliver from first
    # per operator index, per lane: the parameters of its replayed epochs (resume_changes.py)
    earlier: dict[int, dict[int, list[tuple[int, dict[str, Any]]]]]


def plan_resume(state: Mapping[str, Any], *, lanes: Sequence[int], plan: LanePlan,
                accounting: Accounting,
                replay_targets: dict[int, tuple[tuple, int, int]]) -> ResumePlan:
    """Set each lane's progress and replay target from ``state``; the run's start.

    ``accounting`` is fresh; ``replay_targets`` (the replay filter's, empty)
    receives ``lane -> (cursor key, records to drop, last chunk of the window)``
    for each lane with a replay cursor.
    """
    replay: list[ScheduleState] = []
    lane_next: dict[int, int] = {}
    starts: list[ScheduleState] = []
    for lane in lanes:
        entry = state["lanes"][str(lane)]
        window = [ScheduleState.from_json(row[1:]) for row in entry["window"]]
        replay.extend(window)
        first_chunk = (int(entry["window"][0][0]) if entry["window"] else
                       None if entry["next"] is None else
                       plan.lane_of(int(entry["next"][0]))[1])
        # Epochs before the window are done.
        accounting.lanes[lane].resume_at(first_chunk, int(entry["outputs"]),
                                         exhausted=entry["next"] is None)
        if entry["replay_cursor"] is not None and window:
            window_end = max(int(row[0]) for row in entry["window"])
            replay_targets[lane] = (key_from_json(entry["replay_cursor"]),
                                    int(entry["replay_count"]), window_end)
        if entry["next"] is None:
            lane_next[lane] = sys.maxsize
        else:
            nxt = ScheduleState.from_json(entry["next"])
            lane_next[lane] = nxt.global_chunk
            starts.append(nxt)
    rr = state.get("round_robin")
    if rr and rr.get("lanes") == list(lanes):
        index = int(rr["index"]) % len(lanes)
    else:  # another topology: start with the lane that has delivered least
        outputs = [accounting.lanes[lane].outputs for lane in lanes]
        index = outputs.index(min(outputs))
    start = min(starts, key=lambda s: s.global_chunk) if starts else None
    return ResumePlan(start, lane_next, replay, index, plan_earlier(state, lanes))


def narrow_state(state: Mapping[str, Any], lanes: Sequence[int]) -> dict[str, Any]:
    """The part of ``state`` that concerns ``lanes``, with a fresh checksum.

    ``state`` may hold more lanes than ``lanes`` (a merged global state, a
    rank's state seen by one of its workers); lanes it lacks are simply not
    there. The round-robin position is kept when it was saved for exactly
    these lanes; otherwise it is dropped, and loading recomputes it from
    per-lane progress, as it did when ``state`` itself was loaded.
    """
    keys = {str(lane) for lane in lanes}
    if set(state["lanes"]) <= keys:
        return dict(state)
    narrowed = {k: v for k, v in state.items() if k != "checksum"}
    narrowed["lanes"] = {k: v for k, v in state["lanes"].items() if k in keys}
    rr = state.get("round_robin")
    if not (isinstance(rr, Mapping) and rr.get("lanes") == sorted(int(k) for k in keys)):
        narrowed["round_robin"] = None
    narrowed["checksum"] = state_checksum(narrowed)
    return narrowed


class ScheduleView:
    """The emitter's part of a state, for an iterator whose emitters run elsewhere.

    Under ``runner="lanes"`` each lane worker runs a source emitter over its
    own lanes, and the main process keeps the books. A state still needs what
    :func:`lane_entries` asks the emitter: the schedule state of a lane's next
    chunk when that chunk has not been registered yet (still to be replayed,
    or new). Those are pure functions of the schedule, so this view answers
    them from the chunks the books registered: a chunk's state is found by
    advancing the schedule from the nearest state known before it (a chunk
    registered for some lane, or where the run started), which is at most
    ``num_lanes`` chunks back once every lane has registered one.

    It also counts the replayed chunks, as the emitter does for ``stats()``.

    Args:
        schedule: The work schedule.
        start: Where the run's emitters start (None: the schedule's start,
            or, with ``ended``, nowhere: every lane had ended).
        replay: The start states of the chunks replayed first after a resume.
        ended: Every lane's stream had ended in the loaded state.
    """

    def __init__(self, schedule: WorkSchedule, start: ScheduleState | None,
                 replay: Sequence[ScheduleState] = (), *, ended: bool = False) -> None:
        self.schedule = schedule
        self.num_lanes = schedule.total_lanes
        self.finished = ended
        self._start = start if start is not None else schedule.initial_state()
        self._latest: dict[int, ScheduleState] = {}  # per lane: its last registered chunk
        self._pending = {s.global_chunk: s for s in replay}
        self._answers: dict[int, ScheduleState | None] = {}
        self.replayed = 0
        self.replayed_by_lane: dict[int, int] = {}

    def registered(self, chunk: Chunk) -> None:
        """A chunk the books registered (in the order its lane's chunks were emitted)."""
        start = chunk.start
        g = start.global_chunk
        if self._pending.pop(g, None) is not None:
            lane = chunk.lane_id
            self.replayed += len(chunk)
            self.replayed_by_lane[lane] = self.replayed_by_lane.get(lane, 0) + len(chunk)
        latest = self._latest.get(chunk.lane_id)
        if latest is None or latest.global_chunk < g:
            self._latest[chunk.lane_id] = start
        self._answers.pop(g, None)

    def pending_replay(self, global_chunk: int) -> ScheduleState | None:
        """The start state of a chunk still waiting to be replayed, if it is one."""
        return self._pending.get(global_chunk)

    def state_of(self, global_chunk: int) -> ScheduleState | None:
        """The schedule state at a global chunk not yet registered (None: past the end)."""
        pending = self._pending.get(global_chunk)
        if pending is not None:
            return pending
        if global_chunk in self._answers:
            return self._answers[global_chunk]
        base = self._start
        for known in self._latest.values():
            if base.global_chunk < known.global_chunk <= global_chunk:
                base = known
        if base.global_chunk > global_chunk:  # before anything known: walk from the start
            base = self.schedule.initial_state()
        state: ScheduleState | None = base
        advance = self.schedule.advance
        while state is not None and state.global_chunk < global_chunk:
            components, state = advance(state)
            if components is None:
                state = None
        if state is not None and advance(state)[0] is None:
            state = None  # the chunk itself is past the end
        if len(self._answers) > 4 * self.num_lanes:  # a few frontiers per lane at most
            self._answers.clear()
        self._answers[global_chunk] = state
        return state
