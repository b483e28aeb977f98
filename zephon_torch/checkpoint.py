"""Checkpoints: states, their checks and merge.

**Progress** is kept by the iterator's books (``lane_progress.py``): per lane,
the registered chunks, the epochs done (the ``flush_every_k_chunks``
chunks between two flush sentinels of a lane; one chunk each when there
are no sentinels) and the cursor of the last record delivered. A state is
written from it (:func:`lane_state`).

**A state** holds, per lane: the *replay cursor* (the cursor key of the
last record delivered; for a batch, its last record), the *window* (the
schedule states of the registered chunks from the start of the earliest
incomplete epoch to the end of the cursor's epoch), the schedule state of
the lane's next chunk, and a few counters; plus the rank's round-robin
position, a format version, a fingerprint of the configuration and a
checksum. It is plain JSON, and its size depends on the window, never on
how far training got.

**Resume.** Each lane replays its window from the epoch boundary (so every
accumulator starts fresh exactly where it did live), then continues with new
chunks. The :class:`~zephon_torch.replay.ReplayFilter`, which the planner
puts right before ``batch``, drops the lane's replayed records until it has
dropped the one equal to the replay cursor, and only then lets records
through. Batching therefore rebuilds from an empty buffer at a point where,
live, the buffer was empty too (the cursor is the last record of a delivered
batch), so the continuation is exact. A worked example, batch size 3,
sentinel at boundary ``B`` between ``o2`` and ``n1``::

    live:    [o0 o1 o2 | n1 n2 n3 ...]  -> batches [o0 o1 o2] [n1 n2 n3]   (cursor = o2)
    resume:  replay from the epoch of o2: o0 o1 o2 dropped, n1 n2 n3 -> [n1 n2 n3]

and for a cross-epoch batch ``[o1 o2 n1]`` (cursor ``n1``): the epoch of
``o*`` is complete, so the window starts at ``B``; replay drops ``n1`` and
the next batch is ``[n2 n3 n4]``, as live.

**Data.** The fingerprint's ``datasets`` part covers each dataset's options
and its shards' names and sample counts; its ``data`` part holds, per
dataset, the content table of its shards (size and content digest of each
file, see :func:`~zephon_torch.sources.base.content_table`). A resume on
files rewritten in place (same names and line counts, other content) would
deliver some documents twice and others never, so it is refused, naming the
file, unless the state went through :func:`accept_changed_data`. States
saved before content tables existed have no ``data`` part and load as they
did (their content cannot be checked).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from zephon_torch.accounting import ProgressTracker
from zephon_torch.fingerprint import (
    data_changes,
    describe_difference,
    digest,
    fingerprint_parts,
    is_detail,
)
from zephon_torch.lane_progress import LaneProgress
from zephon_torch.ops.base import Operator, operator_class
from zephon_torch.replay import ReplayFilter  # a public name here since it was defined here
from zephon_torch.resume_changes import (
    EARLIER_KEY,
    changed_after_resume_point,
    changed_at_epoch_boundary,
    lane_earlier,
    resumed_state,
)
from zephon_torch.sources.lane_plan import LanePlan, lane_changes_from_json
from zephon_torch.sources.schedule import ScheduleState
from zephon_torch.sources.shard_growth import before_growth, growth_from_json
from zephon_torch.sources.weight_plan import changes_from_json
from zephon_torch.state_checks import check_fields

__all__ = [
    "ACCEPT_CHANGED_DATA",
    "STATE_VERSION",
    "NotCheckpointableError",
    "ProgressTracker",
    "ReplayFilter",
    "accept_changed_data",
    "check_state",
    "describe_difference",
    "differing_parts",
    "fingerprint_parts",
    "key_from_json",
    "key_to_json",
    "merge_states",
    "refuse_nondeterministic",
    "shards_appended_since",
    "state_checksum",
    "weights_changed_since",
]

#: Format version of :meth:`PipelineIterator.state_dict` states.
STATE_VERSION = 1
#: The key :func:`accept_changed_data` sets in a state.
ACCEPT_CHANGED_DATA = "accept_changed_data"


class NotCheckpointableError(RuntimeError):
    """An iterator whose position cannot be saved or restored exactly.

    Raised by ``state_dict()`` and ``load_state_dict()`` of iterators (and
    loaders) made with ``deterministic=False``: see :func:`refuse_nondeterministic`.
    """


def refuse_nondeterministic(action: str) -> NotCheckpointableError:
    """The error for ``action`` (``"state_dict()"``, ...) under ``deterministic=False``."""
    # Why the position cannot be exact: replay regenerates the window's records and
    # drops those up to the saved cursor, which only works if they come in the order
    # they came live. Completion order and latency flushes make that order (and the
    # batches cut from it) differ from run to run.
    return NotCheckpointableError(
        f"{action} is not available with deterministic=False: in that mode the stages "
        "forward results in completion order and may flush on a timer, so the order of the "
        "items (and the batches cut from them) differs from run to run, and no saved position "
        "can be replayed exactly. Iterate with deterministic=True (the default) to save and "
        "resume checkpoints"
    )


# ---------------------------------------------------------------------------- lane entries


def lane_state(progress: LaneProgress,
               next_state: Callable[[int, bool], ScheduleState | None],
               lanes: LanePlan, earlier: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One lane's entry of a state, from its progress (see the module doc).

    ``next_state(global_chunk, exhausted)`` gives the schedule state of a
    chunk not registered (yet, or again after a resume); None when the
    schedule has no more; ``lanes`` deals the chunks (``sources/lane_plan.py``).
    ``earlier``: the lane's ``earlier_ops`` in the
    loaded state (see :mod:`~zephon_torch.resume_changes`), kept as far as
    the window still needs them.
    """
    span = progress.window()
    window: list[int] = []
    cursor = None
    count = 0
    chunks = progress.chunks
    if span is not None:
        first, last = span
        window = sorted(c for c in chunks if first <= progress.epoch_of(c) <= last)
        if progress.cursor_epoch is not None and progress.cursor_epoch >= first:
            cursor = key_to_json(progress.cursor)
            count = sum(n for e, n in progress.delivered_in_epoch.items() if first <= e <= last)
    if progress.finished or progress.lane >= lanes.total:  # (a lane of a later growth)
        nxt: ScheduleState | None = None
    else:
        next_chunk = window[-1] + 1 if window else progress.registered_until
        if next_chunk in chunks:  # registered already (a later epoch): known
            nxt = chunks[next_chunk].start
        else:  # still to be replayed, or new (None when the schedule has no more)
            nxt = next_state(lanes.global_chunk(progress.lane, next_chunk), progress.exhausted)
    boundaries = []
    k = progress.flush_every
    if window and k:
        boundaries = sorted({(c // k) * k for c in window})
    entry = {
        "window": [[c, *chunks[c].start.to_json()] for c in window],
        "epoch_boundaries": boundaries,
        "replay_cursor": cursor,
        "replay_count": count,
        "next": None if nxt is None else nxt.to_json(),
        "outputs": progress.outputs,
    }
    first = window[0] if window else None if nxt is None else lanes.lane_of(nxt.global_chunk)[1]
    kept = lane_earlier(earlier, first)
    if kept:
        entry[EARLIER_KEY] = kept
    return entry


def key_to_json(key: tuple) -> list[Any]:
    chunk_id, offset, lineage, sample_id = key
    return [chunk_id, offset, list(lineage), list(sample_id)]


def key_from_json(value: Sequence[Any]) -> tuple:
    """A cursor key from its JSON form (lists back to tuples)."""
    chunk_id, offset, lineage, sample_id = value
    return (int(chunk_id), int(offset), tuple(int(i) for i in lineage),
            tuple(int(i) for i in sample_id))


# ---------------------------------------------------------------------------- states


def _lane_key_problem(lanes: Mapping[Any, Any]) -> str | None:
    """What is wrong with a state's lane keys (they must be strings), or None."""
    bad = [key for key in lanes if not isinstance(key, str)]
    if not bad:
        return None
    with contextlib.suppress(TypeError):  # keys of several types do not sort
        bad = sorted(bad)
    kinds = ", ".join(sorted({type(key).__name__ for key in bad}))
    return (
        f"lane keys must be strings as state_dict() writes them ('0', '1', ...); this state "
        f"has {kinds} key(s) {bad!r} (did a serializer turn the JSON object keys into "
        "numbers?). Turn them back with state['lanes'] = {str(k): v for k, v in "
        "state['lanes'].items()} and load it again"
    )


def state_checksum(state: Mapping[str, Any]) -> str:
    """Checksum of a state's content (everything but the checksum itself).

    Raises:
        ValueError: The content cannot be written as JSON (lane keys that are
            not strings, values that are not builtins).
    """
    body = {k: v for k, v in state.items() if k != "checksum"}
    try:
        text = json.dumps(body, sort_keys=True)
    except (TypeError, ValueError) as exc:  # keys that do not sort, objects JSON lacks
        lanes = body.get("lanes")
        problem = _lane_key_problem(lanes) if isinstance(lanes, Mapping) else None
        raise ValueError(
            f"corrupted state: {problem}" if problem else
            f"corrupted state: its content is not plain JSON ({type(exc).__name__}: {exc}); "
            "pass the dict state_dict() returned, or json.load of it"
        ) from exc
    return hashlib.sha256(text.encode()).hexdigest()


def check_state(state: Any, fingerprint: Mapping[str, Any], *,
                stage_names: Sequence[str] | None = None,
                deterministic: bool = True) -> dict[str, Any]:
    """Validate a state against this pipeline; raise ValueError saying what is wrong.

    Args:
        state: The state to load.
        fingerprint: The pipeline's ``fingerprint()``.
        stage_names: The pipeline's stage names, to name a changed operator.
        deterministic: The mode of the iterator that will resume the state.

    Raises:
        ValueError: The state is corrupted, was saved by another
            configuration or under ``deterministic=False``.
        NotCheckpointableError: ``deterministic`` is False.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"corrupted state: expected a dict, got {type(state).__name__}")
    version = state.get("version")
    if version != STATE_VERSION:
        raise ValueError(
            f"unknown state version {version!r}; this zephon_torch reads version "
            f"{STATE_VERSION}"
        )
    _check_mode(state)
    if not deterministic:
        raise refuse_nondeterministic("load_state_dict()")
    for key, kind in (("lanes", dict), ("fingerprint", dict), ("checksum", str),
                      ("num_lanes", int)):
        if not isinstance(state.get(key), kind):
            raise ValueError(f"corrupted state: {key!r} is missing or not a {kind.__name__}")
    problem = _lane_key_problem(state["lanes"])
    if problem:
        raise ValueError(f"corrupted state: {problem}; nothing was loaded")
    if state["checksum"] != state_checksum(state):
        raise ValueError(
            "corrupted state: the checksum does not match its content (a truncated or edited "
            "checkpoint?); nothing was loaded"
        )
    mine = fingerprint_parts(fingerprint, stage_names)
    theirs = state["fingerprint"]
    if not all(isinstance(key, str) for key in theirs):
        raise ValueError("corrupted state: the fingerprint's keys must be strings; nothing was "
                         "loaded")
    differ = differing_parts(mine, theirs, fingerprint)
    if differ:
        meaning = (_earlier_state_refusal(differ, mine, theirs, fingerprint, state["num_lanes"])
                   or _weights_refusal(differ))
        if meaning:
            raise ValueError(meaning)
        raise ValueError(
            "the state was saved by a different pipeline configuration: "
            f"{describe_difference(differ, mine, theirs, fingerprint)}. Resume with the same "
            "sources, operators, num_lanes, chunk_size, seed and flush_every_k_chunks; what "
            "may change (the batch size, a shuffle's buffer_size, micro-batch sizes, runner and "
            "workers) is listed in "
            "docs/checkpoints.md, \"What a resume may change\"" + _growth_hint(differ)
            + _lanes_hint(differ)
        )
    if "data" in theirs and state.get(ACCEPT_CHANGED_DATA) is not True:
        changed = data_changes(mine.get("data"), theirs["data"], fingerprint)
        if changed:
            raise ValueError(changed)
    # Every field, as untrusted input: keys, types, ranges (the schedule is checked at load).
    check_fields(state)
    # A shuffle's buffer_size changed: the state as this pipeline would have saved it.
    changed = resumed_state(state, mine, fingerprint)
    if changed is None:
        return dict(state)
    changed["checksum"] = state_checksum(changed)
    return changed


def differing_parts(mine: Mapping[str, Any], theirs: Mapping[str, Any],
                    fingerprint: Mapping[str, Any] | None = None) -> list[str]:
    """The parts (:func:`fingerprint_parts`) in which two configurations differ, sorted.

    Operator details and the ``data`` part (content tables) are left out:
    the digests decide. Given this pipeline's ``fingerprint``, an operator
    saved in an earlier form counts as the same when the operator says this
    pipeline's gives the output that form gave
    (:meth:`~zephon_torch.ops.base.Operator.earlier_config`: a shuffle saved
    before its buffer was split over the lanes, when this pipeline's shuffle
    gives each lane the buffer it had then).
    """
    differ = sorted(k for k in set(mine) | set(theirs)
                    if k != "data" and not is_detail(k) and mine.get(k) != theirs.get(k))
    if fingerprint is None:
        return differ
    if "shard_growth" in differ and shards_appended_since(fingerprint, theirs):
        differ = [k for k in differ if k not in _GROWTH_PARTS]
    return [k for k in differ if not _same_as_earlier_form(k, fingerprint, theirs)
            and not changed_after_resume_point(k, fingerprint, theirs)
            and not changed_at_epoch_boundary(k, fingerprint, theirs)
            and not (k == "weight_changes" and weights_changed_since(mine, theirs))
            and not (k == "lane_changes" and lanes_grown_since(mine, theirs))]


def lanes_grown_since(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> bool:
    """Whether this pipeline's lane changes (parts ``mine``) extend those of the state
    (``theirs``): the state's first, then one or more of its own (``sources/lane_plan.py``).

    Whether the new ones start where the state leaves nothing fixed is checked
    against the schedule (``state_checks.py``).
    """
    return _extends(mine, theirs, "lane_changes", lane_changes_from_json)


def weights_changed_since(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> bool:
    """Whether this pipeline's mixture weight changes (parts ``mine``) extend those of
    the state (``theirs``): the state's changes first, then one or more of its own.

    Whether the new ones start where the state leaves nothing fixed is checked
    against the schedule (``state_checks.py``).
    """
    return _extends(mine, theirs, "weight_changes", changes_from_json)


def _extends(mine: Mapping[str, Any], theirs: Mapping[str, Any], part: str,
             parse: Callable[[Any], list[Any]]) -> bool:
    """Whether the changes in fingerprint part ``part`` of ``mine`` are those of
    ``theirs`` followed by one or more (``parse`` reads a part; unreadable: no)."""
    try:
        ours = parse(mine.get(part))
        saved = parse(theirs.get(part))
    except ValueError:
        return False
    return len(ours) > len(saved) and ours[:len(saved)] == saved


#: The parts shards appended on a resume change (``sources/shard_growth.py``).
_GROWTH_PARTS = ("datasets", "blocks", "shard_growth")


def shards_appended_since(fingerprint: Mapping[str, Any], theirs: Mapping[str, Any]) -> bool:
    """Whether this pipeline (its ``fingerprint``) is the state's (parts ``theirs``) with
    shards appended: the state's growths first, then one or more of its own, and the
    datasets before those exactly the state's (names, sample counts, block layout).

    Where the new ones join against the state's position is checked against the
    schedule (``state_checks.py``); the contents of the old shards by
    :func:`~zephon_torch.fingerprint.data_changes`.
    """
    rows = fingerprint.get("shard_growth") or []
    try:
        saved = growth_from_json(theirs.get("shard_growth"))
    except ValueError:
        return False
    if len(rows) <= len(saved) or [list(r) for r in rows[:len(saved)]] != saved:
        return False
    before = fingerprint_parts(before_growth(fingerprint, len(saved)))
    return all(before.get(k) == theirs.get(k) for k in _GROWTH_PARTS)


def _growth_hint(differ: Sequence[str]) -> str:
    """What to do when the datasets differ: shards appended since join through
    ``append_shards`` (empty for other differences)."""
    if "datasets" not in differ and "shard_growth" not in differ:
        return ""
    return (". If shards were only appended (the old ones unchanged, in their order), build "
            "the pipeline over the grown files and resume on pipe.append_shards(state=state): "
            "the new shards join at the dataset's next pass")


def _lanes_hint(differ: Sequence[str]) -> str:
    """What to do when the lane counts differ (empty for other differences)."""
    if "num_lanes" not in differ and "lane_changes" not in differ:
        return ""
    return (". num_lanes decides which lane reads each chunk, so it stays as the state was "
            "saved; to resume on more ranks than the state has lanes, build the pipeline the "
            "state was saved by and resume on pipe.change_lanes(num_lanes, state=state): the "
            "new lanes take the chunks after the state's step")


def _weights_refusal(differ: Sequence[str]) -> str | None:
    """The refusal of a state whose mixture weights differ from this pipeline's, or None."""
    if "weights" not in differ and "weight_changes" not in differ:
        return None
    others = [k for k in differ if k not in ("weights", "weight_changes")]
    also = f" (and {', '.join(others)} differ(s): keep those as they were)" if others else ""
    return (
        "the state was saved by a pipeline with other mixture weights" + also + ". To run "
        "new weights from this step on, build the pipeline the state was saved by (its "
        "weights) and resume with pipe.change_weights(new_weights, state=state) in place of "
        "pipe (see docs/checkpoints.md, \"What a resume may change\"); a pipeline made with "
        "change_weights from one state resumes that state or an earlier one of the same run, "
        "and the states it saves, but no later state of the run before the change"
    )


def _same_as_earlier_form(key: str, fingerprint: Mapping[str, Any],
                          theirs: Mapping[str, Any]) -> bool:
    """Whether differing part ``key`` is an operator the state saved in an earlier form
    whose output this pipeline's operator gives (its class decides, see
    :meth:`~zephon_torch.ops.base.Operator.earlier_config`)."""
    index = key[len("ops["):-1]
    if not (key.startswith("ops[") and key.endswith("]") and index.isdigit()):
        return False
    ops = fingerprint.get("ops") or []
    num_lanes = fingerprint.get("num_lanes")
    if int(index) >= len(ops) or not isinstance(ops[int(index)], Mapping) \
            or not isinstance(num_lanes, int):
        return False
    config = ops[int(index)]
    kind = operator_class(config.get("op"))
    if kind is None:
        return False
    prefix = f"{key}."
    saved = {k[len(prefix):]: v for k, v in theirs.items() if k.startswith(prefix)}
    earlier = kind.earlier_config(config, saved, num_lanes=num_lanes)
    return earlier is not None and digest(earlier) == theirs.get(key)


def _earlier_state_refusal(differ: Sequence[str], mine: Mapping[str, Any],
                           theirs: Mapping[str, Any], fingerprint: Mapping[str, Any],
                           num_lanes: int) -> str | None:
    """The refusal an operator class of this pipeline words for a state saved by an
    earlier form of it (:meth:`~zephon_torch.ops.base.Operator.refuse_earlier_state`),
    or None: the generic refusal applies."""
    kinds: dict[type[Operator], None] = {}
    for config in fingerprint.get("ops") or []:
        kind = operator_class(config.get("op")) if isinstance(config, Mapping) else None
        if kind is not None:
            kinds[kind] = None
    for kind in kinds:
        refusal = kind.refuse_earlier_state(differ, mine, theirs, num_lanes=num_lanes)
        if refusal:
            return refusal
    return None


def _check_mode(state: Mapping[str, Any], where: str = "") -> None:
    """Refuse a state saved under ``deterministic=False`` (states without the key predate it)."""
    mode = state.get("deterministic", True)
    if mode is True:
        return
    if mode is not False:
        raise ValueError(f"corrupted state: {where}'deterministic' must be true or false, got "
                         f"{mode!r}; nothing was loaded")
    raise ValueError(
        f"{where}the state was saved by an iterator with deterministic=False, whose position "
        "cannot be replayed exactly (results went out in completion order), so it cannot be "
        "resumed: it records the mode, not a position. Start afresh, or resume from a "
        "checkpoint saved with deterministic=True"
    )


def accept_changed_data(state: Any) -> Any:
    """A copy of ``state`` that resumes even though the data changed since it was saved.

    Loading a state checks each file's size and content digest against the
    data now on disk (see the module doc) and refuses a resume on rewritten
    files. This marks the state so that check is skipped. The consequence is
    yours: the replayed window and the rest of the pass read the files as
    they are now, so documents that moved may be delivered twice or never
    (shard names, sample counts and the configuration must still match).

    ``state`` may be a pipeline state or anything holding some: a merged
    state, a ``zephon_torch.DataLoader`` or torchdata ``StatefulDataLoader``
    checkpoint, a ``ZephonDataModule`` state, a whole Lightning checkpoint.
    Every pipeline state inside is marked (with a fresh checksum); containers
    on the way to one are copied, everything else (model weights, for
    instance) is shared, not copied.

    Example:
        >>> it.load_state_dict(accept_changed_data(saved))  # doctest: +SKIP

    Raises:
        ValueError: There is no pipeline state inside, or one is corrupted
            (its checksum does not match).
    """
    found = 0

    def mark(value: Any) -> Any:
        nonlocal found
        if isinstance(value, Mapping) and {"version", "fingerprint", "lanes", "checksum"} <= set(
                value):
            if value.get("checksum") != state_checksum(value):
                raise ValueError("accept_changed_data: corrupted state: the checksum does not "
                                 "match its content; nothing was marked")
            found += 1
            marked = {k: v for k, v in value.items() if k != "checksum"}
            marked[ACCEPT_CHANGED_DATA] = True
            marked["checksum"] = state_checksum(marked)
            return marked
        if isinstance(value, Mapping):
            out = None
            for key, item in value.items():
                new = mark(item)
                if new is not item:
                    if out is None:
                        out = copy.copy(value) if isinstance(value, dict) else dict(value)
                    out[key] = new
            return value if out is None else out
        if isinstance(value, (list, tuple)):
            items = [mark(item) for item in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return items if isinstance(value, list) else tuple(items)
        return value

    result = mark(state)
    if not found:
        raise ValueError("accept_changed_data: no pipeline state in the value given; pass a "
                         "state_dict() or a checkpoint holding one")
    return result


def _fingerprints_apart(first: Any, other: Any, i: int) -> str:
    """How state ``i``'s fingerprint parts differ from state 0's, in words."""
    if not (isinstance(first, Mapping) and isinstance(other, Mapping)):
        return "a fingerprint is missing or malformed"
    differ = differing_parts(other, first)
    if not differ:
        return "the content of their files differs (data)"
    try:
        return (describe_difference(differ, other, first, {},
                                    sides=("in state 0", f"in state {i}"))
                + f" (values: state 0's -> state {i}'s)")
    except ValueError:  # a malformed data part: the names alone
        return f"{', '.join(differ)} differ(s)"


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Combine the states of several ranks into one global state.

    Any ``world_size`` up to ``num_lanes`` can load the result: each rank
    takes its own lanes. All states must come from the same pipeline
    configuration and hold disjoint lanes.
    """
    if not states:
        raise ValueError("merge_states needs at least one state")
    first = states[0]
    lanes: dict[str, Any] = {}
    for i, state in enumerate(states):
        _check_mode(state, f"merge_states: state {i}: ")
        for key in ("version", "num_lanes"):
            if state.get(key) != first.get(key):
                raise ValueError(f"merge_states: state {i} has a different {key!r}")
        if state.get("fingerprint") != first.get("fingerprint"):
            apart = _fingerprints_apart(first.get("fingerprint"), state.get("fingerprint"), i)
            raise ValueError(
                f"merge_states: state {i} was saved by another pipeline configuration than "
                f"state 0: {apart}; every rank must run the "
                "same pipeline over the same files (the same sources, file list and contents, "
                "operators, num_lanes, chunk_size and seed)"
            )
        if state.get("epoch", 0) != first.get("epoch", 0):
            raise ValueError(
                f"merge_states: state {i} was saved in epoch {state.get('epoch', 0)!r}, state 0 "
                f"in epoch {first.get('epoch', 0)!r}; merge the states of one checkpoint (all "
                "ranks save in the same epoch)"
            )
        problem = _lane_key_problem(state["lanes"]) if isinstance(state.get("lanes"),
                                                                   Mapping) else None
        if problem:
            raise ValueError(f"merge_states: state {i}: {problem}")
        if state.get("checksum") != state_checksum(state):
            raise ValueError(f"merge_states: state {i} is corrupted (checksum mismatch)")
        for lane, entry in state["lanes"].items():
            if lane in lanes:
                raise ValueError(f"merge_states: lane {lane} appears in two states")
            lanes[lane] = entry
    merged = {
        "version": first["version"],
        "deterministic": True,  # _check_mode refused any other
        "fingerprint": first["fingerprint"],
        "num_lanes": first["num_lanes"],
        "epoch": first.get("epoch", 0),
        "lanes": dict(sorted(lanes.items(), key=lambda kv: int(kv[0]))),
        "round_robin": None,  # a merged state has no single rank's position
    }
    if all(state.get(ACCEPT_CHANGED_DATA) is True for state in states):
        merged[ACCEPT_CHANGED_DATA] = True
    merged["checksum"] = state_checksum(merged)
    return merged
