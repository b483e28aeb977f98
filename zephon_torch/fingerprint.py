"""The fingerprint of a pipeline, its parts, and how two of them differ, in words.

A pipeline's **fingerprint** (:func:`pipeline_fingerprint`) is the
configuration that defines its output, as JSON-able builtins: the datasets
(their options, shards, sample counts and content tables), the source
settings (weights, lanes, chunk size, seed, flush period, passes, read
order; ``weight_changes`` only when a resume changed the mixture weights,
``sources/weight_plan.py``; ``shard_growth`` only when shards were appended,
``sources/shard_growth.py``) and each operator's ``config()``. Runner, worker counts and
micro-batch sizes are not in it: they never change the output.

A state keeps it as **parts** (:func:`fingerprint_parts`): a short digest per
part, which decides whether two configurations match, plus each operator's
parameters as *details* (never compared), so that a mismatch can name the
operator and the parameter that changed (:func:`describe_difference`), and
the datasets' content tables, so that a rewritten file can be named
(:func:`data_changes`). :mod:`zephon_torch.checkpoint` checks states with
them; an operator that migrates an earlier form of its state describes it
with :func:`describe_ops_part`, :func:`param_changes` and :func:`op_label`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from zephon_torch.sources.base import parse_content_table
from zephon_torch.sources.lane_plan import lane_changes_to_json
from zephon_torch.sources.schedule import block_layout
from zephon_torch.sources.shard_growth import growth_to_json
from zephon_torch.sources.weight_plan import MixtureWeights, changes_to_json

__all__ = [
    "DIGEST_MARK",
    "STATE_SIDES",
    "data_changes",
    "describe_difference",
    "describe_ops_part",
    "digest",
    "fingerprint_digest",
    "fingerprint_parts",
    "is_detail",
    "op_label",
    "param_changes",
    "pipeline_fingerprint",
]


def pipeline_fingerprint(source: Any, ops: Sequence[Any], flush_every: int) -> dict[str, Any]:
    """The configuration that defines the output of ``ops`` over ``source``.

    Args:
        source: The pipeline's ``SourceConfig``.
        ops: The user's operators (their ``config()`` enters).
        flush_every: The effective flush-sentinel period (see
            :func:`zephon_torch.planner.flush_every`).
    """
    src = source
    fingerprint = {
        "datasets": [d.describe() for d in src.datasets],
        "weights": (None if src.weights is None else
                    src.weights.original_json() if isinstance(src.weights, MixtureWeights)
                    else list(src.weights)),
        "num_lanes": src.num_lanes,
        "chunk_size": src.chunk_size,
        "seed": src.seed,
        "flush_every_k_chunks": flush_every,
        "passes": src.passes,
        "shuffle": src.shuffle,
        "exhausted": src.exhausted,
        "ops": [op.config() for op in ops],
    }
    changes = changes_to_json(src.weights)
    if changes:  # weights changed on a resume (weight_plan.py): only then a part
        fingerprint["weight_changes"] = changes
    lanes = lane_changes_to_json(getattr(src, "lane_changes", ()))
    if lanes:  # lanes grown on a resume (lane_plan.py): only then a part
        fingerprint["lane_changes"] = lanes
    growth = growth_to_json(src.datasets)
    if growth:  # shards appended on a resume (shard_growth.py): only then a part
        fingerprint["shard_growth"] = growth
    if src.shuffle:  # a shuffled pass follows the shards' read blocks
        layout = block_layout(src.datasets)
        if layout:  # only shards of several blocks: the others keep their order
            fingerprint["blocks"] = layout
    return fingerprint


def fingerprint_digest(fingerprint: Mapping[str, Any]) -> str:
    """A short hash of a fingerprint (:func:`pipeline_fingerprint`)."""
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
                parts[f"ops[{i}]"] = digest(op)
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
        elif key in ("weight_changes", "shard_growth", "lane_changes"):
            # The values: a state can be extended.
            parts[key] = json.dumps(value)
        else:
            parts[key] = digest(value)
    return parts


def _dataset_parts(datasets: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``datasets`` and ``data`` parts of a fingerprint (see the module doc).

    ``datasets`` digests everything but the content tables, exactly as it did
    before they existed, so older states still match; ``data`` keeps each
    dataset's options digest and content table as they are, so that a
    mismatch can name the shard.
    """
    structure = [{k: v for k, v in d.items() if k != "content"} for d in datasets]
    data = [{"options": digest({k: v for k, v in d.items() if k not in ("shards", "content")}),
             "shards": d.get("content")} for d in datasets]
    return {"datasets": digest(structure), "data": data}


def digest(value: Any) -> str:
    """The short digest of a JSON-able value that decides whether two parts match."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: Parameter values longer than this (as JSON) are kept as a digest in a state.
_SHOWN_LENGTH = 40
#: How a state's operator detail kept as a digest starts.
DIGEST_MARK = "sha256:"


def _shown(value: Any) -> str:
    """A parameter's value as a state keeps it: its JSON text, or a digest if long."""
    text = json.dumps(value, sort_keys=True, default=str)
    if len(text) <= _SHOWN_LENGTH:
        return text
    return DIGEST_MARK + hashlib.sha256(text.encode()).hexdigest()[:16]


def is_detail(key: str) -> bool:
    """Whether a fingerprint part is an operator detail (kept for messages, never compared)."""
    return key.startswith("ops[") and not key.endswith("]")


#: Where the two sides of a difference come from, by default: a state and this pipeline.
STATE_SIDES = ("in the state", "now")


def describe_difference(differ: Sequence[str], mine: Mapping[str, Any],
                        theirs: Mapping[str, Any], fingerprint: Mapping[str, Any], *,
                        sides: tuple[str, str] = STATE_SIDES) -> str:
    """``differ`` (:func:`~zephon_torch.checkpoint.differing_parts`) in words: which
    operator and parameter (``theirs -> mine``), which datasets and shards (named from
    ``fingerprint``, ``mine``'s); ``sides`` names where ``theirs`` and ``mine`` come from."""
    named = [describe_ops_part(k, mine, theirs) if k.startswith("ops") else k
             for k in differ]
    detail = (_datasets_detail(mine.get("data"), theirs.get("data"), fingerprint, sides)
              if "datasets" in differ else "")
    return f"{', '.join(named)} differ(s){detail}"


def describe_ops_part(key: str, mine: Mapping[str, str], theirs: Mapping[str, Any]) -> str:
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
        return f"{key} {op_label(key, mine)} (not in the state's pipeline)"
    if key not in mine:
        label = op_label(key, theirs)
        return f"{key} (only in the state's pipeline{': ' + label if label else ''})"
    label = op_label(key, mine)
    if not there:  # a state saved before operators' details were kept
        return f"{key} {label} (its parameters)"
    if there.get("op") != here.get("op"):
        return f"{key} {label} (the operator was {op_label(key, theirs)})"
    changes = param_changes(here, there, skip={"op"})
    return f"{key} {label} ({', '.join(changes) or 'its parameters'})"


def param_changes(here: Mapping[str, Any], there: Mapping[str, str], *,
                  skip: set[str]) -> list[str]:
    """An operator's changed parameters, ``state's -> this pipeline's``, but those in ``skip``."""
    changes = []
    for param in sorted((set(here) | set(there)) - skip):
        old, new = there.get(param), here.get(param)
        if old == new:
            continue
        if old is None or new is None:
            changes.append(f"{param} {'added' if old is None else 'removed'}")
        elif old.startswith(DIGEST_MARK) or new.startswith(DIGEST_MARK):
            changes.append(f"{param} changed")
        else:
            changes.append(f"{param} {old} -> {new}")
    return changes


def op_label(key: str, parts: Mapping[str, Any]) -> str:
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
                     sides: tuple[str, str] = STATE_SIDES) -> str:
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
                       sides: tuple[str, str] = STATE_SIDES) -> list[str]:
    """How two content tables differ in shard names and sample counts (``sides``:
    where ``then`` and ``now`` come from, as :data:`STATE_SIDES`)."""
    old, new_side = sides
    ours = sides == STATE_SIDES  # a state against this pipeline: the words of old
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


def data_changes(mine: Any, theirs: Any, fingerprint: Mapping[str, Any]) -> str | None:
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
