"""Checkpoints: states, their checks and merge, and the replay filter.

**Progress** is kept by the iterator's books (``accounting.py``): per lane,
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
accumulator starts fresh exactly where it did live), then continues with
new chunks. The :class:`ReplayFilter`, which the planner puts right before
``batch``, drops the lane's replayed records until it has dropped the one
equal to the replay cursor, and only then lets records through. Batching
therefore rebuilds from an empty buffer at a point where, live, the buffer
was empty too (the cursor is the last record of a delivered batch), so the
continuation is exact. A worked example, batch size 3, sentinel at
boundary ``B`` between ``o2`` and ``n1``::

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

import numpy as np

from zephon_torch.accounting import LaneProgress, ProgressTracker
from zephon_torch.block import ID_CHUNK, Block
from zephon_torch.ops.accumulators import Accumulator
from zephon_torch.ops.base import OpContext, Operator, OpTraits
from zephon_torch.ops.shuffle import BUFFER_SPLIT, lane_buffer_size
from zephon_torch.sources.base import parse_content_table
from zephon_torch.sources.schedule import ScheduleState
from zephon_torch.state_checks import check_fields
from zephon_torch.types import SampleBatch, SampleRecord

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
    "merge_states",
    "refuse_nondeterministic",
    "state_checksum",
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
               num_lanes: int) -> dict[str, Any]:
    """One lane's entry of a state, from its progress (see the module doc).

    ``next_state(global_chunk, exhausted)`` gives the schedule state of a
    chunk not registered (yet, or again after a resume); None when the
    schedule has no more.
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
            cursor = _key_to_json(progress.cursor)
            count = sum(n for e, n in progress.delivered_in_epoch.items() if first <= e <= last)
    if progress.finished:
        nxt: ScheduleState | None = None
    else:
        next_chunk = window[-1] + 1 if window else progress.registered_until
        if next_chunk in chunks:  # registered already (a later epoch): known
            nxt = chunks[next_chunk].start
        else:  # still to be replayed, or new (None when the schedule has no more)
            nxt = next_state(next_chunk * num_lanes + progress.lane, progress.exhausted)
    boundaries = []
    k = progress.flush_every
    if window and k:
        boundaries = sorted({(c // k) * k for c in window})
    return {
        "window": [[c, *chunks[c].start.to_json()] for c in window],
        "epoch_boundaries": boundaries,
        "replay_cursor": cursor,
        "replay_count": count,
        "next": None if nxt is None else nxt.to_json(),
        "outputs": progress.outputs,
    }


def _key_to_json(key: tuple) -> list[Any]:
    chunk_id, offset, lineage, sample_id = key
    return [chunk_id, offset, list(lineage), list(sample_id)]


def key_from_json(value: Sequence[Any]) -> tuple:
    """A cursor key from its JSON form (lists back to tuples)."""
    chunk_id, offset, lineage, sample_id = value
    return (int(chunk_id), int(offset), tuple(int(i) for i in lineage),
            tuple(int(i) for i in sample_id))


# ---------------------------------------------------------------------------- replay filter


class ReplayFilterAccumulator(Accumulator):
    """Drops each lane's replayed records up to its replay cursor.

    Per lane: ``(cursor key, records expected to be dropped, last chunk id of
    the window)``. Until the cursor is met, every record is dropped (and
    reported through ``on_drop``, so progress counts it as delivered); a
    record from beyond the window, or the end of the stream, while still
    dropping means replay diverged.
    """

    takes_blocks = True

    def __init__(self, targets: Mapping[int, tuple[tuple, int, int]],
                 on_drop: Callable[[Any], None] | None) -> None:
        self._targets = {lane: list(t) for lane, t in targets.items()}
        self._dropped = dict.fromkeys(targets, 0)
        self._on_drop = on_drop

    def push_block(self, block: Block) -> list[Block]:
        """Drop a replaying lane's rows up to and including its cursor; pass the rest."""
        lane = block.lane
        target = self._targets.get(lane)
        if target is None or not len(block):
            return [block] if len(block) else []
        cursor, expected, window_end = target
        hit = _find_key(block, cursor)
        if hit is None:
            late = np.flatnonzero(block.ids[:, ID_CHUNK] > window_end)
            if len(late):
                self._diverged(lane, f"a record of chunk {int(block.ids[late[0], ID_CHUNK])}, "
                                     f"past the replayed window (last chunk {window_end}), "
                                     "arrived first")
            self._drop_rows(block)
            return []
        dropped, rest = block.split_at(hit + 1)
        late = np.flatnonzero(dropped.ids[:hit, ID_CHUNK] > window_end)
        if len(late):
            self._diverged(lane, f"a record of chunk {int(dropped.ids[late[0], ID_CHUNK])}, "
                                 f"past the replayed window (last chunk {window_end}), "
                                 "arrived first")
        self._drop_rows(dropped)
        del self._targets[lane]
        if self._dropped[lane] != expected:
            self._diverged(lane, f"the cursor came after {self._dropped[lane]} "
                                 f"records instead of {expected}")
        return [rest] if len(rest) else []

    def _drop_rows(self, block: Block) -> None:
        self._dropped[block.lane] += len(block)
        if self._on_drop is not None:
            self._on_drop(block)

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        if not self._targets:
            return [list(elems)] if elems else []
        out = []
        for elem in elems:
            records = elem.records if isinstance(elem, SampleBatch) else (elem,)
            lane = records[0].meta.lane_id if records else -1
            target = self._targets.get(lane)
            if target is None:
                out.append(elem)
                continue
            cursor, expected, window_end = target
            last = records[-1].meta
            if last.chunk_id > window_end and last.as_cursor_key() != cursor:
                self._diverged(lane, f"a record of chunk {last.chunk_id}, past the replayed "
                                     f"window (last chunk {window_end}), arrived first")
            for record in records:
                self._dropped[lane] += 1
                if self._on_drop is not None:
                    self._on_drop(record)
            if last.as_cursor_key() == cursor:
                del self._targets[lane]
                if self._dropped[lane] != expected:
                    self._diverged(lane, f"the cursor came after {self._dropped[lane]} "
                                         f"records instead of {expected}")
        return [out] if out else []

    def _diverged(self, lane: int, why: str) -> None:
        raise RuntimeError(
            f"replay diverged on lane {lane}: {why}. The data or the code changed since the "
            "checkpoint in a way the fingerprint does not cover, or the state was edited (its "
            "'epoch', for one, which only the order of the replayed records can show); resume "
            "from an earlier checkpoint or start this lane afresh"
        )

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        # Holds nothing, and its dropping state spans epochs: a flush is a no-op,
        # except that the end of the stream must not come while still dropping.
        if not reset and lane_id is None and self._targets:
            lane = min(self._targets)
            self._diverged(lane, "the stream ended before the replay cursor was met")
        return []

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        return False

    def pending_lanes(self) -> set[int]:
        """The lanes still dropping replayed records (their cursor not met yet)."""
        return set(self._targets)


def _find_key(block: Block, key: tuple) -> int | None:
    """The row of ``block`` whose cursor key is ``key``, or None."""
    chunk_id, offset, lineage, sample_id = key
    ids = block.ids
    match = ((ids[:, 3] == chunk_id) & (ids[:, 4] == offset) & (ids[:, 0] == sample_id[0])
             & (ids[:, 1] == sample_id[1]) & (ids[:, 2] == sample_id[2]))
    for row in np.flatnonzero(match).tolist():
        if (block.lineage[row] if block.lineage is not None else ()) == tuple(lineage):
            return row
    return None


class ReplayFilter(Operator):
    """The planner's filter before ``batch``: a passthrough unless resuming."""

    name = "replay_filter"

    def __init__(self) -> None:
        self.targets: dict[int, tuple[tuple, int, int]] = {}
        self.on_drop: Callable[[SampleRecord], None] | None = None

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> Accumulator:
        return ReplayFilterAccumulator(self.targets, self.on_drop)

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return list(elems)

    def process_block(self, block: Block) -> Block:
        return block

    def traits(self) -> OpTraits:
        return OpTraits(inline=True)

    def config(self) -> dict[str, Any]:
        return {"op": "replay_filter"}

    def __getstate__(self) -> dict[str, Any]:
        return {"targets": {}, "on_drop": None}  # workers never run it


# ---------------------------------------------------------------------------- states


def fingerprint_parts(fingerprint: Mapping[str, Any],
                      stage_names: Sequence[str] | None = None) -> dict[str, Any]:
    """A short digest per part of a fingerprint (so a mismatch can say what differs).

    Besides the digests, which decide whether two configurations match, each
    operator's parameters are kept as *details* (``"ops[i].<param>"``: the
    value's JSON text when short, else a digest; ``"ops[i].op"``: the class
    path; ``"ops[i]#name"``: the stage name when ``stage_names`` is given), so
    that a mismatch can name the operator and the parameter that changed.
    Details are never compared: the digests decide. The ``data`` part is no
    digest but the datasets' content tables (see :func:`_dataset_parts`), so
    that a change can name the file.
    """
    parts = {}
    for key, value in fingerprint.items():
        if key == "ops":
            for i, op in enumerate(value):
                parts[f"ops[{i}]"] = _digest(op)
                if isinstance(op, Mapping):
                    for param, setting in op.items():
                        # The class path stays whole: it names the operator in messages.
                        parts[f"ops[{i}].{param}"] = (str(setting) if param == "op"
                                                      else _shown(setting))
                if stage_names is not None and i < len(stage_names):
                    parts[f"ops[{i}]#name"] = str(stage_names[i])
            parts["ops.count"] = str(len(value))
        elif key == "datasets":
            parts.update(_dataset_parts(value))
        else:
            parts[key] = _digest(value)
    return parts


def _dataset_parts(datasets: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``datasets`` and ``data`` parts of a fingerprint (see the module doc).

    ``datasets`` digests everything but the content tables, exactly as it did
    before they existed, so older states still match; ``data`` keeps each
    dataset's options digest and content table as they are, so that a
    mismatch can name the shard.
    """
    structure = [{k: v for k, v in d.items() if k != "content"} for d in datasets]
    data = [{"options": _digest({k: v for k, v in d.items() if k not in ("shards", "content")}),
             "shards": d.get("content")} for d in datasets]
    return {"datasets": _digest(structure), "data": data}


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: Parameter values longer than this (as JSON) are kept as a digest in a state.
_SHOWN_LENGTH = 40
_DIGEST_MARK = "sha256:"


def _shown(value: Any) -> str:
    """A parameter's value as a state keeps it: its JSON text, or a digest if long."""
    text = json.dumps(value, sort_keys=True, default=str)
    if len(text) <= _SHOWN_LENGTH:
        return text
    return _DIGEST_MARK + hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_detail(key: str) -> bool:
    """Whether a fingerprint part is an operator detail (kept for messages, never compared)."""
    return key.startswith("ops[") and not key.endswith("]")


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
        meaning = _shuffle_meaning_change(differ, mine, theirs, state["num_lanes"])
        if meaning:
            raise ValueError(meaning)
        raise ValueError(
            "the state was saved by a different pipeline configuration: "
            f"{describe_difference(differ, mine, theirs, fingerprint)}. Resume with the same "
            "sources, operators, num_lanes, chunk_size, seed and flush_every_k_chunks"
        )
    if "data" in theirs and state.get(ACCEPT_CHANGED_DATA) is not True:
        changed = _data_changes(mine.get("data"), theirs["data"], fingerprint)
        if changed:
            raise ValueError(changed)
    # Every field, as untrusted input: keys, types, ranges (the schedule is checked at load).
    check_fields(state)
    return dict(state)


#: Where the two sides of a difference come from, by default: a state and this pipeline.
_STATE_SIDES = ("in the state", "now")


def differing_parts(mine: Mapping[str, Any], theirs: Mapping[str, Any],
                    fingerprint: Mapping[str, Any] | None = None) -> list[str]:
    """The parts (:func:`fingerprint_parts`) in which two configurations differ, sorted.

    Operator details and the ``data`` part (content tables) are left out:
    the digests decide. Given this pipeline's ``fingerprint``, a shuffle
    saved before its buffer was split over the lanes counts as the same when
    this pipeline's shuffle gives each lane the buffer it had then.
    """
    differ = sorted(k for k in set(mine) | set(theirs)
                    if k != "data" and not _is_detail(k) and mine.get(k) != theirs.get(k))
    if fingerprint is None:
        return differ
    return [k for k in differ if not _same_as_unsplit_shuffle(k, fingerprint, theirs)]


def describe_difference(differ: Sequence[str], mine: Mapping[str, Any],
                        theirs: Mapping[str, Any], fingerprint: Mapping[str, Any], *,
                        sides: tuple[str, str] = _STATE_SIDES) -> str:
    """``differ`` (:func:`differing_parts`) in words: which operator and parameter
    (``theirs -> mine``), which datasets and shards (named from ``fingerprint``,
    ``mine``'s); ``sides`` names where ``theirs`` and ``mine`` come from."""
    named = [_describe_ops_part(k, mine, theirs) if k.startswith("ops") else k
             for k in differ]
    detail = (_datasets_detail(mine.get("data"), theirs.get("data"), fingerprint, sides)
              if "datasets" in differ else "")
    return f"{', '.join(named)} differ(s){detail}"


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


def _describe_ops_part(key: str, mine: Mapping[str, str], theirs: Mapping[str, Any]) -> str:
    """A differing operators part, named: which operator, and which parameters changed how.

    ``mine`` holds this pipeline's parts, ``theirs`` the state's; values read
    ``state's -> this pipeline's``.
    """
    if key == "ops.count":
        return f"ops.count ({theirs.get(key)} operators -> {mine.get(key)})"
    index = key[len("ops["):-1]
    if key != f"ops[{index}]" or not index.isdigit():
        return key
    prefix = f"{key}."
    here = {k[len(prefix):]: v for k, v in mine.items() if k.startswith(prefix)}
    there = {k[len(prefix):]: str(v) for k, v in theirs.items() if k.startswith(prefix)}
    if key not in theirs:
        return f"{key} {_op_label(key, mine)} (not in the state's pipeline)"
    if key not in mine:
        label = _op_label(key, theirs)
        return f"{key} (only in the state's pipeline{': ' + label if label else ''})"
    label = _op_label(key, mine)
    if not there:  # a state saved before operators' details were kept
        return f"{key} {label} (its parameters)"
    if there.get("op") != here.get("op"):
        return f"{key} {label} (the operator was {_op_label(key, theirs)})"
    changes = _param_changes(here, there, skip={"op"})
    return f"{key} {label} ({', '.join(changes) or 'its parameters'})"


def _param_changes(here: Mapping[str, Any], there: Mapping[str, str], *,
                   skip: set[str]) -> list[str]:
    """An operator's changed parameters, ``state's -> this pipeline's``, but those in ``skip``."""
    changes = []
    for param in sorted((set(here) | set(there)) - skip):
        old, new = there.get(param), here.get(param)
        if old == new:
            continue
        if old is None or new is None:
            changes.append(f"{param} {'added' if old is None else 'removed'}")
        elif old.startswith(_DIGEST_MARK) or new.startswith(_DIGEST_MARK):
            changes.append(f"{param} changed")
        else:
            changes.append(f"{param} {old} -> {new}")
    return changes


def _same_as_unsplit_shuffle(key: str, fingerprint: Mapping[str, Any],
                             theirs: Mapping[str, Any]) -> bool:
    """Whether differing part ``key`` is a shuffle saved unsplit that this one equals.

    A state saved while a shuffle's ``buffer_size`` was each lane's buffer
    has no ``buffer_split`` in that operator's config. This pipeline's
    shuffle gives the same order exactly when it has the same parameters and
    its lanes' share (:func:`~zephon_torch.ops.shuffle.lane_buffer_size`)
    is the old ``buffer_size``: then the old config, rebuilt from this one,
    has the state's digest.
    """
    index = key[len("ops["):-1]
    if not (key.startswith("ops[") and key.endswith("]") and index.isdigit()):
        return False
    ops = fingerprint.get("ops") or []
    if int(index) >= len(ops) or f"{key}.buffer_split" in theirs:
        return False
    config = dict(ops[int(index)])
    if config.get("buffer_split") != BUFFER_SPLIT:
        return False
    try:
        share = lane_buffer_size(config["buffer_size"], fingerprint["num_lanes"])
    except (KeyError, TypeError, ValueError):
        return False
    del config["buffer_split"]
    config["buffer_size"] = share
    return _digest(config) == theirs.get(key)


def _shuffle_meaning_change(differ: Sequence[str], mine: Mapping[str, Any],
                            theirs: Mapping[str, Any], num_lanes: int) -> str | None:
    """The refusal of a state saved while a shuffle's ``buffer_size`` was each lane's.

    Such a state's shuffle has no ``buffer_split`` entry
    (:data:`~zephon_torch.ops.shuffle.BUFFER_SPLIT`) in its config. The
    generic message would tell the user to resume with the same operators,
    which they did; this one says what changed and what to do. None when no
    differing shuffle of the state predates the split.
    """
    old = [key for key in differ
           if key.startswith("ops[") and key.endswith("]") and key in theirs
           and f"{key}.buffer_split" in mine and f"{key}.buffer_split" not in theirs
           and f"{key}.buffer_size" in theirs
           and theirs.get(f"{key}.op") == mine.get(f"{key}.op")]
    if not old:
        return None
    shown = []
    for key in old:
        size = str(theirs[f"{key}.buffer_size"])
        prefix = f"{key}."
        here = {k[len(prefix):]: v for k, v in mine.items() if k.startswith(prefix)}
        there = {k[len(prefix):]: str(v) for k, v in theirs.items() if k.startswith(prefix)}
        # Any other parameter that changed too must be named, or the advice misleads.
        changed = _param_changes(here, there, skip={"op", "buffer_size", "buffer_split"})
        shown.append(f"{key} {_op_label(key, mine)} held buffer_size={size} rows in each of the "
                     f"{num_lanes} lanes" + (f", which is shuffle(buffer_size="
                                             f"{int(size) * num_lanes}) now" if size.isdigit()
                                             else "")
                     + (f"; also {', '.join(changed)}" if changed else ""))
    others = [_describe_ops_part(k, mine, theirs) if k.startswith("ops") else k
              for k in differ if k not in old]
    also = f" The configuration also differs: {', '.join(others)}." if others else ""
    return (
        f"the state was saved by a zephon_torch from before shuffle's buffer_size became the "
        f"pipeline's whole buffer, shared by the lanes ({'; '.join(shown)}); this pipeline "
        f"shuffles in another order, so the state cannot resume it and nothing was loaded."
        f"{also} To resume the state exactly, build the shuffle with that buffer_size (the "
        "same rows per lane as then) and keep it for the rest of the run; else finish the run "
        "with the version that saved the state, or start afresh without it (see 'From an "
        "earlier zephon_torch: the shuffle buffer' in docs/migration.md)"
    )


def _op_label(key: str, parts: Mapping[str, Any]) -> str:
    """Operator ``key``'s name (``"ops[i]"``) from parts: the stage name, else the class name."""
    name = parts.get(f"{key}#name")
    if name:
        return str(name)
    return str(parts.get(f"{key}.op", "")).rsplit(".", 1)[-1]


def _dataset_tables(mine: Any, theirs: Any, fingerprint: Mapping[str, Any]
                    ) -> list[tuple[str, list[str], Any, Any]] | None:
    """Per dataset: (label, current shard names, current entries, saved entries).

    Entries are None where a dataset has no content table. None overall when
    the state has no usable ``data`` part (an older state).

    Raises:
        ValueError: The state's ``data`` part is malformed.
    """
    if not isinstance(theirs, list) or not isinstance(mine, list):
        return None
    described = fingerprint.get("datasets") or []
    out = []
    for i, (now, then) in enumerate(zip(mine, theirs)):
        if not (isinstance(then, Mapping) and isinstance(then.get("options"), str)
                and isinstance(then.get("shards"), (str, type(None)))):
            raise ValueError(f"corrupted state: its fingerprint's 'data' entry {i} is "
                             "malformed; nothing was loaded (resume from another checkpoint)")
        info = described[i] if i < len(described) else {}
        label = f"dataset {info.get('name', '?')!r} (datasets[{i}])"
        names = [str(s[0]) for s in info.get("shards", [])]
        try:
            entries = (None if now["shards"] is None else parse_content_table(now["shards"]),
                       None if then["shards"] is None else parse_content_table(then["shards"]))
        except ValueError:
            raise ValueError(f"corrupted state: the content table of {label} is malformed; "
                             "nothing was loaded (resume from another checkpoint)") from None
        out.append((label, names, *entries))
    return out


def _datasets_detail(mine: Any, theirs: Any, fingerprint: Mapping[str, Any],
                     sides: tuple[str, str] = _STATE_SIDES) -> str:
    """What differs in the datasets' structure, naming datasets and shards ("" if unknown)."""
    tables = _dataset_tables(mine, theirs, fingerprint)
    if tables is None:
        return ""
    notes = []
    if len(mine) != len(theirs):
        notes.append(f"the state has {len(theirs)} dataset(s), this pipeline {len(mine)}")
    for (label, names, now, then), m, t in zip(tables, mine, theirs):
        what = []
        if m["options"] != t["options"]:
            what.append("its options differ (kind, name, component_id, passes, columns or "
                        "field)")
        if now is not None and then is not None:
            what.extend(_shard_differences(names, now, then, sides))
        if what:
            notes.append(f"{label}: {'; '.join(what)}")
    return f" ({'; '.join(notes)})" if notes else ""


def _shard_differences(names: list[str], now: list[Any], then: list[Any],
                       sides: tuple[str, str] = _STATE_SIDES) -> list[str]:
    """How two content tables differ in shard names and sample counts (``sides``:
    where ``then`` and ``now`` come from, as :data:`_STATE_SIDES`)."""
    old, new_side = sides
    ours = sides == _STATE_SIDES  # a state against this pipeline: the words of old
    if [(e.name_tag, e.samples) for e in now] == [(e.name_tag, e.samples) for e in then]:
        return []
    named = [names[k] if k < len(names) else f"shard {k}" for k in range(len(now))]
    saved = {e.name_tag: e for e in then}
    current = {e.name_tag for e in now}
    what = []
    if len(now) != len(then):
        what.append(f"{len(then)} shard(s) {old}, {len(now)} {new_side}")
    new = [repr(named[k]) for k, e in enumerate(now) if e.name_tag not in saved]
    if new:
        what.append(f"{'new' if ours else 'only ' + new_side}: {', '.join(new[:3])}"
                    f"{' ...' if len(new) > 3 else ''}")
    gone = sum(1 for e in then if e.name_tag not in current)
    if gone:
        what.append(f"{gone} shard(s) of the state are gone (renamed or removed)" if ours
                    else f"{gone} shard(s) only {old}")
    counts = [f"{named[k]!r} has {e.samples} samples{'' if ours else ' ' + new_side}, "
              f"{saved[e.name_tag].samples} {old}"
              for k, e in enumerate(now)
              if e.name_tag in saved and saved[e.name_tag].samples != e.samples]
    what.extend(counts[:3])
    if len(counts) > 3:
        what.append(f"and {len(counts) - 3} more shard(s) with other sample counts")
    if not what:
        what.append("its shards are in another order")
    return what


def _data_changes(mine: Any, theirs: Any, fingerprint: Mapping[str, Any]) -> str | None:
    """The "data changed" message when a shard's size or content differs, else None."""
    tables = _dataset_tables(mine, theirs, fingerprint)
    changes = []
    for label, names, now, then in tables or ():
        if now is None or then is None:
            continue
        for k, (a, b) in enumerate(zip(now, then)):
            if a.size is not None and b.size is not None and a.size != b.size:
                what = f"{b.size} bytes then, {a.size} now"
            elif a.digest is not None and b.digest is not None and a.digest != b.digest:
                what = (f"same size ({a.size} bytes) and {a.samples} samples, other content "
                        "(its first or last bytes, or where its lines start, changed)")
            else:
                continue
            name = names[k] if k < len(names) else f"shard {k}"
            changes.append(f"{label} shard {k} {name!r}: {what}")
    if not changes:
        return None
    more = f"; and {len(changes) - 3} more shard(s)" if len(changes) > 3 else ""
    return (
        f"the data changed since the state was saved: {'; '.join(changes[:3])}{more}. The "
        "files were rewritten in place (same names and sample counts); resuming on them would "
        "deliver some documents twice and never deliver others. Restore the files the state "
        "was saved with, or, to resume on the changed data anyway, accepting those duplicates "
        "and omissions, load zephon_torch.checkpoint.accept_changed_data(state) instead"
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
