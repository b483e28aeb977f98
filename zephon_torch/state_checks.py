"""Loaded states checked field by field: a state is untrusted input.

A state's checksum catches a truncated or damaged file, not an edit: anyone
can recompute it (:func:`~zephon_torch.checkpoint.state_checksum` is public).
So every field of a state is checked before anything runs, in two passes:

* :func:`check_fields` (from :func:`~zephon_torch.checkpoint.check_state`):
  the keys (none missing, none unknown), the types (a bool, float, string or
  None where an integer belongs is refused) and the ranges (integers >= 0 and
  within int64, lanes of the pipeline written as ``state_dict()`` writes
  them, a round-robin position within its lanes);
* :func:`check_against_schedule` (from ``load_state_dict``): each lane's
  entry against the work schedule of the state's epoch. A window row or a
  ``next`` is a schedule state ``[global_chunk, count_0, ...]``; its global
  chunk must be one of the lane's (``g % num_lanes == lane``) and its counts
  those the schedule has there (they sum to ``g * chunk_size``, each within
  the smooth round-robin's reach of its weight's share, and the stream has
  not ended there). The window is consecutive chunks of the lane starting at
  one of its epoch boundaries and spanning at most two of its epochs (what a
  resume may replay), ``next`` is the chunk after it, and the replay cursor is
  a record of the window whose sample is the one the schedule puts at its
  chunk and offset in that epoch (an edited epoch or cursor shows there).

Example: two lanes, chunks of 4, ``flush_every_k_chunks=2``. Lane 1's chunk
``c`` is global chunk ``2c + 1``, so its window rows are ``[c, 2c + 1, 4(2c +
1)]`` (one dataset); ``next = [10**30, 0]`` is refused (the counts say global
chunk 0, and 10**30 is not within the schedule), as is ``next`` of lane 0's
chunk ``[4, 16]`` on lane 1, or a window of chunks ``[0, 1, 2, 3, 4]`` (three
epochs of 2 chunks: at most two are ever replayed).

The checks are arithmetic on the state (one chunk generated per lane for
the cursor's sample), so loading stays cheap. None of them refuses a state
the pipeline wrote: what it writes is described in ``checkpoint.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zephon_torch.epochs import state_epoch
from zephon_torch.sources.lane_plan import (
    LanePlan,
    epoch_lane_changes,
    lane_changes_from_json,
    total_lanes,
)
from zephon_torch.sources.schedule import ScheduleState, WorkSchedule
from zephon_torch.sources.shard_growth import growth_from_json, growth_of
from zephon_torch.sources.weight_plan import change_point, changes_from_json, next_before

__all__ = [
    "LANE_KEYS",
    "MAX_INT",
    "OPTIONAL_LANE_KEYS",
    "OPTIONAL_STATE_KEYS",
    "STATE_KEYS",
    "check_against_schedule",
    "check_fields",
    "check_shard_growth",
]

#: The largest integer a state holds (int64): chunk ids, counts, offsets, epochs.
MAX_INT = 2**63 - 1
#: Keys every state has ...
STATE_KEYS = ("version", "fingerprint", "num_lanes", "lanes", "checksum")
#: ... and those it may have (older states lack ``deterministic``, ``epoch`` and
#: ``round_robin``; ``accept_changed_data`` marks a state, see ``checkpoint.py``).
OPTIONAL_STATE_KEYS = ("deterministic", "epoch", "round_robin", "accept_changed_data")
#: Keys of every lane entry ...
LANE_KEYS = ("window", "next", "replay_cursor", "replay_count", "outputs")
#: ... and those it may have (older states lack ``epoch_boundaries``).
OPTIONAL_LANE_KEYS = ("epoch_boundaries", "earlier_ops")  # earlier_ops: resume_changes.py

_NOTHING = "; nothing was loaded (resume from another checkpoint)"


class _Refused(ValueError):
    """A field of a state that cannot be loaded (raised as a plain ValueError's message)."""


def _shown(value: Any, limit: int = 80) -> str:
    """``value`` as a message shows it: its repr, cut when long (a 30,000-row window)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} items)" if isinstance(value, (list, tuple, dict)) else ""
    return f"{text[:limit]}...{size}"


def _refuse(where: str, field: str, value: Any, allowed: str) -> _Refused:
    return _Refused(f"corrupted state: {where}{field} is {_shown(value)}, {allowed}{_NOTHING}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(where: str, field: str, value: Any, low: int = 0, high: int = MAX_INT) -> int:
    """``value`` if it is an integer in ``[low, high]``, else the refusal naming it."""
    if not _is_int(value):
        raise _refuse(where, field, value, f"not an integer (expected an integer in [{low}, "
                      f"{high}])")
    if not low <= value <= high:
        raise _refuse(where, field, value, f"outside the allowed range [{low}, {high}]")
    return value


def _int_list(where: str, field: str, value: Any, *, length: int | None = None,
              min_length: int = 0) -> list[int]:
    """``value`` if it is a list of integers in ``[0, MAX_INT]`` (of ``length``), else refused."""
    if not isinstance(value, list):
        raise _refuse(where, field, value, "not a list")
    if length is not None and len(value) != length:
        raise _refuse(where, field, value, f"of {len(value)} item(s) where {length} are expected")
    if len(value) < min_length:
        raise _refuse(where, field, value, f"of {len(value)} item(s) where at least "
                      f"{min_length} are expected")
    for i, item in enumerate(value):
        _int(where, f"{field}[{i}]", item)
    return value


def _keys(where: str, entry: Mapping[str, Any], required: Sequence[str],
          optional: Sequence[str]) -> None:
    missing = [key for key in required if key not in entry]
    if missing:
        raise _Refused(f"corrupted state: {where}the key(s) {missing} are missing (a state has "
                       f"{list(required)}){_NOTHING}")
    unknown = [key for key in entry if key not in required and key not in optional]
    if unknown:
        raise _Refused(f"corrupted state: {where}unknown key(s) {_shown(unknown)} (a state "
                       f"holds {list(required) + list(optional)} only: was it edited, or "
                       f"written by another program?){_NOTHING}")


# ---------------------------------------------------------------------------- fields


def check_fields(state: Mapping[str, Any]) -> None:
    """Check a state's keys, types and ranges (its checksum and fingerprint already matched).

    Raises:
        ValueError: Naming the field, its value and what is allowed.
    """
    try:
        _check_fields(state)
    except _Refused as exc:
        raise ValueError(str(exc)) from None


def _check_fields(state: Mapping[str, Any]) -> None:
    _keys("", state, STATE_KEYS, OPTIONAL_STATE_KEYS)
    _int("", "'version'", state["version"])  # its value was checked; a bool is no version
    num_lanes = _int("", "'num_lanes'", state["num_lanes"], 1)
    state_epoch(state)
    mark = state.get("accept_changed_data", True)
    if not isinstance(mark, bool):
        raise _refuse("", "'accept_changed_data'", mark, "not true or false")
    lanes = state["lanes"]
    numbers = []
    for key, entry in lanes.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()
                and str(int(key)) == key):
            raise _refuse("", "a lane key", key, f"not a lane number as state_dict() writes "
                          f"it ('0' to '{num_lanes - 1}')")
        lane = int(key)
        if lane >= num_lanes:
            raise _refuse("", "a lane key", key, f"outside the state's lanes 0 to "
                          f"{num_lanes - 1} (num_lanes={num_lanes})")
        if not isinstance(entry, Mapping):
            raise _refuse("", f"lane {key}'s entry", entry, "not a dict")
        _check_lane(f"lane {key}: ", entry)
        numbers.append(lane)
    _check_round_robin(state.get("round_robin"), sorted(numbers))


def _check_lane(where: str, entry: Mapping[str, Any]) -> None:
    _keys(where, entry, LANE_KEYS, OPTIONAL_LANE_KEYS)
    window = entry["window"]
    if not isinstance(window, list):
        raise _refuse(where, "'window'", window, "not a list of [chunk, global_chunk, "
                      "counts...] rows")
    for i, row in enumerate(window):
        _int_list(where, f"'window'[{i}]", row, min_length=3)
    if entry["next"] is not None:
        _int_list(where, "'next'", entry["next"], min_length=2)
    _int(where, "'replay_count'", entry["replay_count"])
    _int(where, "'outputs'", entry["outputs"])
    _int_list(where, "'epoch_boundaries'", entry.get("epoch_boundaries", []))
    cursor = entry["replay_cursor"]
    if cursor is None:
        return
    if not (isinstance(cursor, list) and len(cursor) == 4):
        raise _refuse(where, "'replay_cursor'", cursor, "not None nor [chunk, offset, lineage, "
                      "sample_id]")
    _int(where, "'replay_cursor' chunk", cursor[0])
    _int(where, "'replay_cursor' offset", cursor[1])
    _int_list(where, "'replay_cursor' lineage", cursor[2])
    _int_list(where, "'replay_cursor' sample_id", cursor[3], length=3)
    if not window:
        raise _refuse(where, "'replay_cursor'", cursor, "but the window is empty (a cursor is "
                      "a record of the window)")


def _check_round_robin(rr: Any, lanes: list[int]) -> None:
    """``round_robin``: None, or the position among exactly the state's lanes."""
    if rr is None:
        return
    if not isinstance(rr, Mapping) or set(rr) != {"lanes", "index"}:
        raise _refuse("", "'round_robin'", rr, "not None nor {'lanes': [...], 'index': i}")
    if rr["lanes"] != lanes:
        raise _refuse("", "'round_robin' lanes", rr["lanes"], f"not the state's lanes {lanes} "
                      "(the round-robin position is among the lanes the state holds, in order)")
    _int("", "'round_robin' index", rr["index"], 0, len(lanes) - 1)


# ---------------------------------------------------------------------------- the schedule


def check_against_schedule(state: Mapping[str, Any], schedule: WorkSchedule, *,
                           flush_every: int, lanes: Sequence[int]) -> None:
    """Check each lane entry of a state (fields already checked) against ``schedule``.

    Args:
        state: The state, after :func:`check_fields`.
        schedule: The work schedule of the state's epoch.
        flush_every: The pipeline's flush-sentinel period K (0: none).
        lanes: The lanes that will resume from the state: their entries are
            checked, their cursor against the sample the schedule puts there
            (the other lanes are checked where they resume, so a rank's
            checks cost its share of the lanes, not all of them).

    Raises:
        ValueError: Naming the lane, the field, its value and what is allowed.
    """
    check_weight_changes(state, schedule)
    check_shard_growth(state, schedule)
    check_lane_growth(state, schedule)
    try:
        entries = state["lanes"]
        for lane in lanes:  # each rank checks the lanes it resumes: work as its share
            entry = entries.get(str(lane))
            if entry is not None:
                _LaneCheck(schedule, flush_every, lane, entry).run(sample=True)
    except _Refused as exc:
        raise ValueError(str(exc)) from None


def check_weight_changes(state: Mapping[str, Any], schedule: WorkSchedule) -> None:
    """Refuse mixture weights that change where ``state`` has fixed chunks.

    The changes of ``schedule`` that the state's ``weight_changes`` part does
    not hold are new: each must start at or after the state's change point
    (``weight_plan.change_point``: every schedule state the state holds comes
    before it), with the counts the schedule has there.

    Raises:
        ValueError: Naming the change, the point and what to do.
    """
    saved = changes_from_json(state["fingerprint"].get("weight_changes"))
    new = [(c.at_chunk, c.counts) for c in schedule.weight_changes if c not in saved]
    if not new:
        return
    point = change_point(state, int(state["num_lanes"]),
                         action="resuming under new mixture weights")
    for at, counts in new:
        if at < point:
            raise ValueError(
                f"the pipeline's mixture weights change at global chunk {at}, but the state "
                f"goes on to chunk {point} under the weights before (a later state of the "
                "run than the one the change was made from): "
                "make the change from this state, pipe.change_weights(new_weights, "
                "state=state) on the pipeline the state was saved by"
            )
        before = next_before(state, at)
        state_there = ScheduleState.from_json(before if before is not None else
                                              schedule.initial_state().to_json())
        while state_there.global_chunk < at:
            components, state_there = schedule.advance(state_there)
            if components is None:
                break
        if state_there.global_chunk != at or state_there.counts != counts:
            raise ValueError(
                f"the pipeline's mixture weights change at global chunk {at} from counts "
                f"{list(counts)}, but the schedule before it reaches "
                f"{list(state_there.counts)} there: the change was made for another run or "
                "configuration; make it from this state with pipe.change_weights(new_weights, "
                "state=state) on the pipeline the state was saved by"
            )


def check_lane_growth(state: Mapping[str, Any], schedule: WorkSchedule) -> None:
    """Refuse lanes that grow where ``state`` has fixed positions under the lanes before.

    The lane changes of ``schedule`` (``sources/lane_plan.py``) that the state's
    ``lane_changes`` part does not hold are new: each must start at or after
    every ``next`` chunk of the lanes the state was saved with (a later state
    of the run went on under the old dealing past the point).

    Raises:
        ValueError: Naming the change, the state's point and what to do.
    """
    saved = epoch_lane_changes(lane_changes_from_json(state["fingerprint"].get("lane_changes")),
                               state_epoch(state))  # as the state's epoch ran them
    new = [c for c in schedule.lane_changes if c not in saved]
    if not new:
        return
    old = total_lanes(schedule.num_lanes, saved)
    lanes = state["lanes"]
    reached = [int(lanes[str(lane)]["next"][0]) for lane in range(old)
               if str(lane) in lanes and lanes[str(lane)].get("next") is not None]
    point = max(reached, default=0)
    for change in new:
        if change.at_chunk < point:
            raise ValueError(
                f"the pipeline's lanes grow to {change.num_lanes} at global chunk "
                f"{change.at_chunk}, but the state goes on to chunk {point} with "
                f"{old} lanes (a later state of the run than the one the change was made "
                "from): make the change from this state, pipe.change_lanes(num_lanes, "
                "state=state) on the pipeline the state was saved by"
            )


def check_shard_growth(state: Mapping[str, Any], schedule: WorkSchedule) -> None:
    """Refuse appended shards that join where ``state`` has fixed positions.

    The growths of ``schedule`` (``sources/shard_growth.py``) that the state's
    ``shard_growth`` part does not hold are new: the pass each joins at must
    start at or after the position its dataset has reached at the state's
    change point (every chunk the state has registered, replays or
    regenerates before it reads the old shards only).

    Raises:
        ValueError: Naming the dataset, the pass and what to do.
    """
    saved = growth_from_json(state["fingerprint"].get("shard_growth"))
    for d, stream in enumerate(schedule.streams):
        for i, growth in enumerate(growth_of(stream.dataset)):
            if [d, growth.shards_before, growth.from_pass, growth.epoch] in saved:
                continue
            if growth.epoch != state_epoch(state):
                raise ValueError(
                    f"dataset {stream.dataset.name!r} (datasets[{d}]): the pipeline's shards "
                    f"were appended in epoch {growth.epoch}, and this state was saved in epoch "
                    f"{state_epoch(state)} before them: resume it on the pipeline over the "
                    "files it was saved with, or make the growth from this state, "
                    "pipe.append_shards(state=state)"
                )
            point = change_point(state, int(state["num_lanes"]),
                                 action="resuming with appended shards")
            reached = int(next_before(state, point)[1 + d])  # type: ignore[index]
            assert stream.segments is not None
            joins = stream.segments[i + 1][1]
            if joins < reached:
                raise ValueError(
                    f"dataset {stream.dataset.name!r} (datasets[{d}]): the pipeline's appended "
                    f"shards join at pass {growth.from_pass} (stream position {joins}), but "
                    f"the state has read to position {reached} over the old shards (a later "
                    "state of the run than the one the pipeline was made from): make it from "
                    "this state, pipe.append_shards(state=state) on the pipeline over the "
                    "grown files"
                )


def _grown(plan: LanePlan) -> str:
    """How the lanes grew, for messages (empty when they did not)."""
    grown = [f"{count} from global chunk {at}" for at, count in plan.regimes[1:]]
    return f", grown to {', '.join(grown)}" if grown else ""


class _LaneCheck:
    """One lane entry against the schedule (see the module doc)."""

    def __init__(self, schedule: WorkSchedule, flush_every: int, lane: int,
                 entry: Mapping[str, Any]) -> None:
        self.schedule = schedule
        self.k = flush_every
        self.lane = lane
        self.entry = entry
        self.where = f"lane {lane}: "
        self.plan = schedule.lanes

    def epoch_of(self, chunk: int) -> int:
        return chunk // self.k if self.k else chunk

    def run(self, *, sample: bool) -> None:
        window = self.entry["window"]
        chunks = [row[0] for row in window]
        if window:
            self.check_window(chunks)  # its length first: the rows are checked one by one
        elif self.entry.get("epoch_boundaries"):
            raise _refuse(self.where, "'epoch_boundaries'", self.entry["epoch_boundaries"],
                          "but the window is empty ([] expected)")
        for i, row in enumerate(window):
            self.schedule_state(f"'window'[{i}]", row[1:], chunk=row[0])
        nxt = self.entry["next"]
        if nxt is not None:
            self.schedule_state("'next'", nxt)
            self.check_next(nxt[0], chunks)
        cursor = self.entry["replay_cursor"]
        count = self.entry["replay_count"]
        if cursor is None:
            if window and self.epoch_of(chunks[-1]) != self.epoch_of(chunks[0]):
                raise _refuse(self.where, "'window'", window, "two epochs without a replay "
                              "cursor (the window reaches past its first epoch only up to the "
                              "cursor's)")
            if count:
                raise _refuse(self.where, "'replay_count'", count, "but there is no replay "
                              "cursor (0 expected: nothing to drop)")
            return
        if count < 1:
            raise _refuse(self.where, "'replay_count'", count, "below 1 (the records to drop "
                          "on replay include the cursor itself)")
        self.check_cursor(cursor, window, sample=sample)

    def schedule_state(self, field: str, value: list[int], chunk: int | None = None) -> None:
        """A window row's or ``next``'s ``[global_chunk, counts...]`` against the schedule."""
        schedule = self.schedule
        where = self.where
        g, counts = value[0], value[1:]
        if len(counts) != schedule.component_count:
            raise _refuse(where, field, [chunk, *value] if chunk is not None else value,
                          f"with {len(counts)} dataset count(s) where the pipeline has "
                          f"{schedule.component_count} dataset(s)")
        owner, its_chunk = self.plan.lane_of(g)
        if owner != self.lane:
            raise _refuse(where, f"{field} global chunk", g, f"a chunk of lane "
                          f"{owner}, not of lane {self.lane} (lane {self.lane}'s "
                          f"chunks are {self.plan.describe(self.lane)} with num_lanes="
                          f"{self.plan.num_lanes}{_grown(self.plan)})")
        if chunk is not None and chunk != its_chunk:
            raise _refuse(where, f"{field} chunk", chunk, f"not the lane's chunk of global "
                          f"chunk {g} (that is chunk {its_chunk})")
        problem = _counts_problem(schedule, g, counts)
        if problem:
            raise _refuse(where, field, [chunk, *value] if chunk is not None else value,
                          problem)

    def check_window(self, chunks: list[int]) -> None:
        where, k = self.where, self.k
        window = self.entry["window"]
        if chunks != list(range(chunks[0], chunks[0] + len(chunks))):
            raise _refuse(where, "'window'", window, f"not consecutive chunks of the lane "
                          f"(chunks {_shown(chunks, 40)})")
        if k and chunks[0] % k:
            raise _refuse(where, "'window'", window, f"starting at chunk {chunks[0]}, not at "
                          f"one of the lane's epoch boundaries (a multiple of "
                          f"flush_every_k_chunks={k}): a replay starts where every stage was "
                          "fresh")
        span = self.epoch_of(chunks[-1]) - self.epoch_of(chunks[0]) + 1
        if span > 2:
            unit = f"{k} chunk(s) each (flush_every_k_chunks={k})" if k else "one chunk each"
            raise _refuse(where, "'window'", window, f"{len(chunks)} rows over {span} of the "
                          f"lane's epochs ({unit}), where a state replays at most 2 epochs "
                          f"({2 * max(k, 1)} chunks)")
        boundaries = self.entry.get("epoch_boundaries")
        expected = sorted({(c // k) * k for c in chunks}) if k else []
        if boundaries is not None and boundaries != expected:
            raise _refuse(where, "'epoch_boundaries'", boundaries, f"not those of the window "
                          f"({expected} with flush_every_k_chunks={k})")

    def check_next(self, g: int, chunks: list[int]) -> None:
        where, k = self.where, self.k
        chunk = self.plan.lane_of(g)[1]
        if chunks and chunk != chunks[-1] + 1:
            raise _refuse(where, "'next' global chunk", g, f"lane chunk {chunk}, but the "
                          f"window ends at chunk {chunks[-1]}: the next chunk is "
                          f"{chunks[-1] + 1} (global chunk "
                          f"{self.plan.global_chunk(self.lane, chunks[-1] + 1)})")
        if not chunks and k and chunk % k:
            raise _refuse(where, "'next' global chunk", g, f"lane chunk {chunk}, inside the "
                          f"lane's epoch {chunk // k} with no window: without one, a lane "
                          f"resumes at an epoch boundary (a multiple of "
                          f"flush_every_k_chunks={k})")

    def check_cursor(self, cursor: list[Any], window: list[list[int]], *, sample: bool) -> None:
        where = self.where
        chunk, offset, _, sample_id = cursor
        first, last = window[0][0], window[-1][0]
        if not first <= chunk <= last:
            raise _refuse(where, "'replay_cursor' chunk", chunk, f"outside the window (chunks "
                          f"{first} to {last}): the cursor is a record the window replays")
        if self.epoch_of(last) != max(self.epoch_of(first), self.epoch_of(chunk)):
            raise _refuse(where, "'window'", window, f"reaching past the replay cursor's epoch "
                          f"(cursor in chunk {chunk}): a window ends with the cursor's epoch")
        size = self.schedule.chunk_size
        if offset >= size:
            raise _refuse(where, "'replay_cursor' offset", offset, f"outside a chunk of "
                          f"{size} sample(s) (chunk_size={size}: offsets 0 to {size - 1})")
        if not sample:
            return
        row = window[chunk - first]
        made, _ = self.schedule.chunk(ScheduleState.from_json(row[1:]))
        if made is None or offset >= len(made):
            length = 0 if made is None else len(made)
            raise _refuse(where, "'replay_cursor' offset", offset, f"past the end of chunk "
                          f"{chunk}, which holds {length} sample(s)")
        there = [int(made.dataset_ids[offset]), int(made.shard_ids[offset]),
                 int(made.local_ids[offset])]
        if list(sample_id) != there:
            raise _refuse(where, "'replay_cursor' sample_id", sample_id, f"not the sample the "
                          f"schedule puts at chunk {chunk}, offset {offset} in this epoch "
                          f"({there}, as [dataset, shard, sample]): the state's epoch, window "
                          "or cursor was edited")


def _counts_problem(schedule: WorkSchedule, g: int, counts: Sequence[int]) -> str | None:
    """Why ``[g, *counts]`` is no schedule state that starts a chunk, or None.

    Every chunk but the last takes ``chunk_size`` pointers, so the state at
    global chunk ``g`` has counted ``n = g * chunk_size`` of them. Over the
    datasets with a weight, the smooth weighted round-robin keeps each
    ``n * w - count`` above -1 (a pick takes one from the largest, which is at
    least ``1/m`` with ``m`` datasets) and so below ``m - 1``; datasets with
    no weight count 0. A chunk exists there only while some dataset is below
    its passes (``"stop"``: while none went past them).
    """
    n = g * schedule.chunk_size
    if sum(counts) != n:
        return (f"whose counts add up to {sum(counts)} samples, where {n} come before global "
                f"chunk {g} (chunk_size={schedule.chunk_size})")
    # After a weight change the round-robin counts from the change's point.
    before, start, weights, _ = schedule.regime(g)
    active = [c for c, w in enumerate(weights) if w > 0]
    if not active:
        return "but the pipeline's datasets are empty: its schedule has no chunk"
    m = len(active)
    slack = 1e-6 + 1e-12 * n
    for c, (count, weight) in enumerate(zip(counts, weights)):
        if weight <= 0:
            if count != start[c]:
                return (f"where dataset {c}, which has no weight, counts {count} samples "
                        f"({start[c]})")
            continue
        share = start[c] + (n - before) * weight
        if not share - (m - 1) - slack < count < share + 1 + slack:
            return (f"where dataset {c} counts {count} samples; at global chunk {g} its weight "
                    f"{weight:.6g} gives about {share:.1f}")
    limits = schedule.limits
    if all(counts[c] >= limits[c] for c in active):
        return f"past the end of the schedule (each dataset has had its {_passes(limits)})"
    if schedule.exhausted == "stop":
        over = [c for c in active if counts[c] > limits[c]]
        if over:
            return (f"past the end of the schedule (dataset {over[0]} counts "
                    f"{counts[over[0]]} samples, more than its passes hold, "
                    f"{int(limits[over[0]])}, with exhausted='stop')")
    return None


def _passes(limits: Sequence[float]) -> str:
    return "samples: " + ", ".join("unbounded" if lim == float("inf") else str(int(lim))
                                   for lim in limits)
