"""Parameters a resume may change from each lane's next epoch boundary on.

An operator after the resume point (``batch``) may change on resume as it is:
it never sees a replayed record (see ``checkpoint.changed_after_resume_point``).
One before it, a shuffle, sees the whole replayed window, which must be
computed as it was or records would be delivered twice or never. Its
parameters in :attr:`~zephon_torch.ops.base.Operator.resume_may_change_at_epoch`
(the shuffle's ``buffer_size``) may still change, from each lane's next epoch
boundary on. That is the definition of "a run that made this change at this
step": per lane, the epochs up to the one of its cursor (the last record the
caller received from it; each epoch of a lane is shuffled on its own) run with
the saved values, every later epoch with the new ones; a lane that delivered
nothing of its window's epochs (or nothing at all) takes the new values at
once::

    lane 0, K = 2, window chunks 4 5, cursor in chunk 4
      chunks  0 1 │ 2 3 │ 4 5 │ 6 7 │ 8 ...
      size    32  │ 32  │ 32  │ 64  │ 64        (saved 32, resumed with 64)
                                ▲ until_chunk = 6

The cursor's epoch decides, not the window's last chunk: how far the saved
run had read ahead never moves the switch.

A state records this per lane as ``earlier_ops``: ``{"ops[i]": [[until_chunk,
{param: saved value}], ...]}``, the lane's chunks before ``until_chunk`` (and
from the previous pair's on) running with those values. Loading a state under
a changed value (:func:`resumed_state`) writes the state as the changed
pipeline would have saved it: its fingerprint that of this pipeline, and each
lane with a cursor the pair of its next boundary. The accumulators receive the
pairs through ``OpContext.earlier_params`` (:func:`resume_contexts`), and a
state saved later keeps the pairs its window still needs (:func:`lane_earlier`),
so it resumes exactly too; once a lane's window has passed ``until_chunk`` its
entry has none, and a state saved with the new value and resumed with it is
plain.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from zephon_torch.fingerprint import DIGEST_MARK, digest
from zephon_torch.ops.base import OpContext, operator_class
from zephon_torch.ops.fused import parts_of
from zephon_torch.replay import ReplayFilter

__all__ = ["EARLIER_KEY", "changed_at_epoch_boundary", "lane_earlier", "plan_earlier",
           "resume_contexts", "resumed_state", "saved_config_matches"]

#: The lane entry's key for the parameters its earlier epochs ran with.
EARLIER_KEY = "earlier_ops"


def _op_index(key: str) -> int | None:
    """``i`` of an operator part ``"ops[i]"``; None for any other part."""
    index = key[len("ops["):-1]
    if key.startswith("ops[") and key.endswith("]") and index.isdigit():
        return int(index)
    return None


def saved_config_matches(key: str, config: Mapping[str, Any], theirs: Mapping[str, Any],
                         params: frozenset[str]) -> dict[str, Any] | None:
    """The saved values of ``params`` when operator part ``key`` of a state is this
    pipeline's ``config`` with them (its digest, exactly); None when it is not.

    ``theirs``: the state's fingerprint parts, whose details hold each parameter's
    JSON text (a digest for a long value, which cannot be substituted).
    """
    saved = {k[len(key) + 1:]: v for k, v in theirs.items() if k.startswith(f"{key}.")}
    if saved.get("op") != config.get("op") or set(saved) != set(config) or not params:
        return None
    then = dict(config)
    values = {}
    for param in params:
        text = saved.get(param)
        if param not in config or not isinstance(text, str) or text.startswith(DIGEST_MARK):
            return None
        try:
            then[param] = values[param] = json.loads(text)
        except ValueError:
            return None
    return values if digest(then) == theirs.get(key) else None


def changed_at_epoch_boundary(key: str, fingerprint: Mapping[str, Any],
                              theirs: Mapping[str, Any]) -> bool:
    """Whether differing part ``key`` is an operator whose state's config differs from
    this pipeline's only in parameters it may change at an epoch boundary
    (:attr:`~zephon_torch.ops.base.Operator.resume_may_change_at_epoch`), in a plan
    with flush sentinels (``flush_every_k_chunks > 0``: epochs to switch at)."""
    index = _op_index(key)
    ops = fingerprint.get("ops") or []
    every = fingerprint.get("flush_every_k_chunks")
    if index is None or index >= len(ops) or not isinstance(ops[index], Mapping) \
            or not isinstance(every, int) or every <= 0:
        return False
    kind = operator_class(ops[index].get("op"))
    if kind is None:
        return False
    return saved_config_matches(key, ops[index], theirs,
                                kind.resume_may_change_at_epoch) is not None


def changed_after_resume_point(key: str, fingerprint: Mapping[str, Any],
                               theirs: Mapping[str, Any]) -> bool:
    """Whether differing part ``key`` is an operator after the resume point whose
    state's config differs from this pipeline's only in parameters a resume may change
    (:attr:`~zephon_torch.ops.base.Operator.resume_may_change`: the batch size).

    The operator must stand at or after the first stage that produces batches (the
    replay filter precedes it, so it never sees a replayed record), be of the same
    class, and its config with the state's values of those parameters must have the
    state's digest exactly.
    """
    index = _op_index(key)
    ops = fingerprint.get("ops") or []
    if index is None or index >= len(ops) or not isinstance(ops[index], Mapping):
        return False
    kinds = [operator_class(c.get("op")) if isinstance(c, Mapping) else None for c in ops]
    cut = next((i for i, k in enumerate(kinds)
                if k is not None and getattr(k, "name", None) == "batch"), None)
    kind = kinds[index]
    if kind is None or not kind.resume_may_change or cut is None or index < cut:
        return False
    return saved_config_matches(key, ops[index], theirs, kind.resume_may_change) is not None


def _refuse(lane: str, value: Any, why: str) -> ValueError:
    shown = json.dumps(value)[:120] if value is not None else "null"
    return ValueError(f"corrupted state: lane {lane}: {EARLIER_KEY!r} is {shown}: {why}; "
                      "nothing was loaded")


def _check_earlier(state: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> None:
    """Refuse a lane's ``earlier_ops`` that this pipeline could not have written."""
    ops = fingerprint.get("ops") or []
    every = fingerprint.get("flush_every_k_chunks")
    for lane, entry in state["lanes"].items():
        earlier = entry.get(EARLIER_KEY)
        if earlier is None:
            continue
        if not isinstance(earlier, Mapping) or not earlier:
            raise _refuse(lane, earlier, "not a non-empty dict of operator -> [[until_chunk, "
                                         "{parameter: value}], ...]")
        for key, pairs in earlier.items():
            index = _op_index(key) if isinstance(key, str) else None
            kind = (operator_class(ops[index].get("op"))
                    if index is not None and index < len(ops) else None)
            if kind is None or not kind.resume_may_change_at_epoch:
                raise _refuse(lane, earlier, f"{key!r} is no operator of this pipeline whose "
                                             "parameters may change on resume")
            if not isinstance(pairs, list) or not pairs:
                raise _refuse(lane, earlier, f"{key!r} holds no [[until_chunk, {{...}}], ...]")
            last = 0
            for pair in pairs:
                ok = (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int
                      and isinstance(pair[1], Mapping) and pair[1]
                      and set(pair[1]) <= kind.resume_may_change_at_epoch)
                if not ok:
                    raise _refuse(lane, earlier, f"{json.dumps(pair)[:60]} is not [until_chunk, "
                                                 f"{{parameter: value}}] with parameters among "
                                                 f"{sorted(kind.resume_may_change_at_epoch)}")
                until = pair[0]
                if until <= last or not isinstance(every, int) or every <= 0 \
                        or until % every:
                    raise _refuse(lane, earlier, f"chunk {until} is not an epoch boundary "
                                                 f"after {last} (every {every} chunks)")
                last = until


def resumed_state(state: Mapping[str, Any], mine: Mapping[str, Any],
                  fingerprint: Mapping[str, Any]) -> dict[str, Any] | None:
    """``state`` (fields checked) as this pipeline would have saved it, when some
    operator of it changed parameters it may change at an epoch boundary (the
    lanes then carry the earlier values) or after the resume point (the batch
    size: only the fingerprint changes); None when none did (the state is this
    pipeline's as it is).

    The content changes, so the caller writes a fresh checksum.

    Raises:
        ValueError: A lane's ``earlier_ops`` this pipeline could not have written.
    """
    _check_earlier(state, fingerprint)
    theirs = state["fingerprint"]
    ops = fingerprint.get("ops") or []
    changed: dict[str, dict[str, Any]] = {}
    after: dict[str, None] = {}
    for key in sorted(k for k in theirs if _op_index(k) is not None):
        index = _op_index(key)
        if theirs[key] == mine.get(key) or index is None or index >= len(ops):
            continue
        if changed_after_resume_point(key, fingerprint, theirs):
            after[key] = None  # acts after the cursor: nothing to carry
            continue
        kind = operator_class(ops[index].get("op"))
        if kind is None or not changed_at_epoch_boundary(key, fingerprint, theirs):
            continue
        values = saved_config_matches(key, ops[index], theirs, kind.resume_may_change_at_epoch)
        if values is not None:
            changed[key] = values
    if not changed and not after:
        return None
    renamed = [*changed, *after]
    parts = {k: v for k, v in theirs.items()
             if not any(k == key or k.startswith((f"{key}.", f"{key}#")) for key in renamed)}
    parts.update({k: v for k, v in mine.items()
                  if any(k == key or k.startswith((f"{key}.", f"{key}#")) for key in renamed)})
    every = int(fingerprint["flush_every_k_chunks"])
    lanes = {}
    for lane, entry in state["lanes"].items():
        entry = dict(entry)
        cursor = entry["replay_cursor"]
        if cursor is not None:  # else nothing of the window was delivered: new at once
            until = (int(cursor[0]) // every + 1) * every
            earlier = {key: [list(p) for p in pairs]
                       for key, pairs in (entry.get(EARLIER_KEY) or {}).items()}
            for key, values in changed.items():
                pairs = earlier.setdefault(key, [])
                if not pairs or pairs[-1][0] < until:  # else the range is empty
                    pairs.append([until, dict(values)])
            if earlier:
                entry[EARLIER_KEY] = earlier
        lanes[lane] = entry
    out = {k: v for k, v in state.items() if k != "checksum"}
    out["fingerprint"] = parts
    out["lanes"] = lanes
    return out


def lane_earlier(earlier: Mapping[str, Any] | None, first_chunk: int | None
                 ) -> dict[str, list[list[Any]]]:
    """The pairs of a lane's ``earlier_ops`` a state whose replay starts at
    ``first_chunk`` still needs (those ending after it); None: it replays nothing."""
    if not earlier or first_chunk is None:
        return {}
    kept = {key: [list(p) for p in pairs if p[0] > first_chunk]
            for key, pairs in earlier.items()}
    return {key: pairs for key, pairs in kept.items() if pairs}


def plan_earlier(state: Mapping[str, Any], lanes: Sequence[int]
                 ) -> dict[int, dict[int, list[tuple[int, dict[str, Any]]]]]:
    """Per operator index, per lane of ``lanes``: the ``(until_chunk, params)`` pairs
    of the state's ``earlier_ops`` (a checked state)."""
    out: dict[int, dict[int, list[tuple[int, dict[str, Any]]]]] = {}
    for lane in lanes:
        entry = state["lanes"].get(str(lane)) or {}
        for key, pairs in (entry.get(EARLIER_KEY) or {}).items():
            index = _op_index(key)
            if index is not None:
                out.setdefault(index, {})[lane] = [(int(u), dict(p)) for u, p in pairs]
    return out


def resume_contexts(compiled: Sequence[Any], ctxs: Sequence[OpContext],
                    earlier: Mapping[int, Mapping[int, Sequence[tuple[int, Any]]]]
                    ) -> list[OpContext]:
    """``ctxs`` with each stage's ``earlier_params`` (``earlier``: from
    :func:`plan_earlier`, by the user's operator index)."""
    if not earlier:
        return list(ctxs)
    out = list(ctxs)
    index = 0
    for s, stage in enumerate(compiled):
        if isinstance(stage.op, ReplayFilter):
            continue
        for _ in parts_of(stage.op):
            if index in earlier:
                out[s] = dataclasses.replace(out[s], earlier_params=dict(earlier[index]))
            index += 1
    return out
