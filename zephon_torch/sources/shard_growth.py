"""Shards appended to a dataset during a run: they join at the next pass boundary.

A corpus grows during a multi-week run: new files match the same glob, or the
file list gets longer. A dataset's stream (``schedule.py``) is pass 0, pass
1, ..., each over its shards in a seeded order, so new shards cannot enter a
pass that has started without moving samples that pass still has to deliver.
They join at the dataset's *next pass boundary* after the resume point: the
pass the saved run is in is read exactly as it would have been, and from pass
``P`` on each pass runs over the grown shard list, in the seeded order a fresh
pipeline over that list gives pass ``P``::

    old shards a b c (30 samples), d appended (10), resume in pass 1 -> P = 2
      positions   0 ... 29 | 30 ... 59 | 60 ... 99 | 100 ... 139
      pass        0        | 1         | 2         | 3
      shards      a b c    | a b c     | a b c d   | a b c d

Position ``k`` of the stream lies in the last *segment* that starts at or
before it: segment ``i`` holds the first ``shards_i`` shards from pass
``pass_i`` (position ``start_i``) on, so pass ``p`` of it starts at
``start_i + (p - pass_i) * size_i``. A dataset that never grew has one
segment and is read as it always was.

:class:`ShardGrowth` is one growth: the shard count before it, the pass the
new shards join at and the epoch it was made in. A dataset carries its
growths as ``shard_growth`` (:func:`with_growth`); a pipeline's fingerprint
keeps them as a ``shard_growth`` part, present only when there is one, so
every other fingerprint is what it was. ``Pipeline.append_shards``
(``zephon_torch/append.py``) makes one from a state.

Why not at once: joining the pass in progress would have to place the new
samples among the positions the pass has not reached, in an order no fresh
pipeline gives; it is left out (``docs/checkpoints.md``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ShardGrowth", "before_growth", "growth_from_json", "growth_of", "growth_to_json",
           "join_pass", "segments", "with_growth"]


@dataclass(frozen=True, slots=True)
class ShardGrowth:
    """Shards appended to a dataset, read from pass ``from_pass`` on.

    Attributes:
        shards_before: The dataset's shard count before the growth (its
            shards ``0 .. shards_before - 1`` are the old ones, unchanged).
        from_pass: The first pass over the grown shard list.
        epoch: The epoch the growth was made in; later epochs read the grown
            list from their first pass.
    """

    shards_before: int
    from_pass: int
    epoch: int = 0


def growth_of(dataset: Any) -> tuple[ShardGrowth, ...]:
    """The growths a dataset carries (none for a dataset as built)."""
    return tuple(getattr(dataset, "shard_growth", ()))


def with_growth(dataset: Any, growth: Sequence[ShardGrowth]) -> Any:
    """A shallow copy of ``dataset`` carrying ``growth`` (``dataset`` itself when equal)."""
    if tuple(growth) == growth_of(dataset):
        return dataset
    out = copy.copy(dataset)
    out.shard_growth = tuple(growth)
    return out


def join_pass(position: int, size: int) -> int:
    """The first pass that starts at or after stream ``position`` (``size`` samples a pass)."""
    return -(-position // size) if size > 0 else 0


def segments(growth: Sequence[ShardGrowth], sizes: Sequence[int]
             ) -> list[tuple[int, int, int, int]]:
    """``(first pass, first position, shard count, samples a pass)`` per segment (see the
    module doc); ``sizes``: the samples of each shard of the grown list.

    Raises:
        ValueError: The growths do not fit the shards (counts not rising, passes
            going back).
    """
    out: list[tuple[int, int, int, int]] = []
    counts = [g.shards_before for g in growth] + [len(sizes)]
    passes = [0] + [g.from_pass for g in growth]
    start = 0
    for i, (count, first) in enumerate(zip(counts, passes)):
        if (i and (count <= counts[i - 1] or first < passes[i - 1])) or count < 1 \
                or count > len(sizes):
            raise ValueError(f"shard growth {list(growth)!r} does not fit a dataset of "
                             f"{len(sizes)} shard(s): each growth adds shards, at a later pass")
        size = int(sum(sizes[:count]))
        if out:
            prev_pass, prev_start, _, prev_size = out[-1]
            start = prev_start + (first - prev_pass) * prev_size
        out.append((first, start, count, size))
    return out


def growth_to_json(datasets: Sequence[Any]) -> list[list[int]]:
    """The ``shard_growth`` part of a fingerprint: ``[dataset, shards_before, from_pass,
    epoch]`` per growth (empty: no dataset grew)."""
    return [[d, g.shards_before, g.from_pass, g.epoch]
            for d, dataset in enumerate(datasets) for g in growth_of(dataset)]


def growth_from_json(text: Any) -> list[list[int]]:
    """The rows a state's ``shard_growth`` part holds (absent: none).

    Raises:
        ValueError: The part is not what :func:`growth_to_json` writes.
    """
    if text is None:
        return []
    try:
        rows = json.loads(text) if isinstance(text, str) else None
        out = [[int(d), int(n), int(p), int(e)] for d, n, p, e in rows]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"corrupted state: its 'shard_growth' part {text!r:.200} is not a "
                         "list of [dataset, shards_before, from_pass, epoch]; nothing was "
                         "loaded") from exc
    return out


def before_growth(fingerprint: Mapping[str, Any], keep: int) -> dict[str, Any]:
    """``fingerprint`` (a pipeline's) as it was with only its first ``keep`` growths:
    each dataset cut to its shard count before the first growth dropped, the block
    layout of the dropped shards left out."""
    rows = fingerprint.get("shard_growth") or []
    cut: dict[int, int] = {}
    for d, before, _, _ in rows[keep:]:
        cut.setdefault(int(d), int(before))
    out = {k: v for k, v in fingerprint.items() if k != "shard_growth"}
    if rows[:keep]:
        out["shard_growth"] = rows[:keep]
    datasets = []
    for d, info in enumerate(fingerprint.get("datasets") or []):
        if d in cut and isinstance(info, Mapping):
            info = dict(info)
            info["shards"] = list(info.get("shards") or [])[:cut[d]]
            if isinstance(info.get("content"), str):
                info["content"] = " ".join(info["content"].split()[:cut[d]])
        datasets.append(info)
    out["datasets"] = datasets
    if "blocks" in fingerprint:
        blocks = [row for row in fingerprint["blocks"]
                  if not (row[0] in cut and row[1] >= cut[row[0]])]
        if blocks:
            out["blocks"] = blocks
        else:
            del out["blocks"]
    return out


def shards_problem(label: str, names: Sequence[str], now: Sequence[Any],
                   then: Sequence[Any]) -> str | None:
    """What keeps a dataset's shards now (``names``, content table entries ``now``) from
    being the state's (``then``) with shards appended, or None: the old shards all
    there, in their place, with their sample counts (contents are checked apart)."""
    tags = [e.name_tag for e in now]
    for k, old in enumerate(then):
        if k < len(now) and tags[k] == old.name_tag:
            if now[k].samples != old.samples:
                return (f"{label}: shard {k} {names[k]!r} has {now[k].samples} samples now, "
                        f"{old.samples} in the state: it changed in place. Only new shards "
                        "may be added; restore the file the state was saved with")
            continue
        if old.name_tag in tags:
            j = tags.index(old.name_tag)
            return (f"{label}: the state's shard {k} is shard {j} ({names[j]!r}) now: the "
                    "shards were reordered (a new file sorts before an old one?). Appended "
                    "shards must come after the old ones in the dataset's shard order "
                    "(sorted paths: name new files so that they sort last)")
        gone = sum(1 for e in then if e.name_tag not in tags)
        return (f"{label}: {gone} shard(s) of the state are gone (removed or renamed; the "
                f"first is its shard {k}). Shards may only be appended: restore them")
    return None
