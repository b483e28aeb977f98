"""Mixture weights that change at a global chunk: what a resume under new weights runs.

A mixture's schedule (``schedule.py``) picks global position ``n``'s dataset
by the largest deficit ``(n + 1) * w_c - count_c``. A run that re-weights
its mixture part-way (an annealing phase at the end of pretraining) does so
at a *change point*: a global chunk ``G``. Chunks before ``G`` are those of
the weights before it, exactly; from ``G`` on the round-robin restarts on the
new weights ``w'`` from the counts it had reached, ``count_c(G)`` after
``n(G)`` positions::

    deficit_c(n) = (n - n(G) + 1) * w'_c - (count_c - count_c(G))

so the chunks after ``G`` hold the new shares, interleaved as smoothly as a
fresh mixture's, whatever the old weights left behind (no catching up for
what the old shares gave). A dataset may go to weight 0 (left out from ``G``
on; its passes no longer end the stream) or from 0 to a positive weight.

:class:`MixtureWeights` is the weights a :class:`~zephon_torch.pipeline_sources.SourceConfig`
holds for such a pipeline: the original weights (a tuple of them, so that
everything that reads the weights sees what it always saw) and the
:class:`WeightChange` list. A pipeline's fingerprint keeps the original
weights as its ``weights`` part and the changes as a ``weight_changes`` part,
present only when there is one, so every other pipeline's fingerprint is what
it was. ``Pipeline.change_weights`` (``zephon_torch/reweight.py``) makes one
from a state; the change point it picks is :func:`change_point`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MixtureWeights", "WeightChange", "change_point", "changes_from_json",
           "changes_to_json", "epoch_weights", "next_before"]


@dataclass(frozen=True, slots=True)
class WeightChange:
    """New mixture weights from global chunk ``at_chunk`` on.

    Attributes:
        at_chunk: The first global chunk under the new weights.
        weights: The new weights, one per dataset, as given (normalised by
            the schedule; 0 leaves a dataset out from here).
        counts: Per dataset, the samples the schedule had taken before
            ``at_chunk`` (where the new deficits start from).
        epoch: The epoch the change was made in; later epochs run the new
            weights from their start (see :func:`epoch_weights`).
    """

    at_chunk: int
    weights: tuple[float, ...]
    counts: tuple[int, ...]
    epoch: int = 0

    def to_json(self) -> list[Any]:
        """``[at_chunk, counts, weights, epoch]``."""
        return [self.at_chunk, list(self.counts), list(self.weights), self.epoch]


class MixtureWeights(tuple):
    """A mixture's original weights (the tuple's items) and its later changes.

    ``proportional``: the original weights were ``None`` (shares proportional
    to the sizes, which the items then are), so the fingerprint keeps ``None``.
    """

    changes: tuple[WeightChange, ...]
    proportional: bool

    def __new__(cls, weights: Sequence[float], changes: Sequence[WeightChange] = (), *,
                proportional: bool = False) -> MixtureWeights:
        self = super().__new__(cls, (float(w) for w in weights))
        self.changes = tuple(changes)
        self.proportional = proportional
        return self

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (tuple(self), self.changes), {"proportional": self.proportional}

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MixtureWeights):
            return (tuple(self) == tuple(other) and self.changes == other.changes
                    and self.proportional == other.proportional)
        return not self.changes and not self.proportional and tuple(self) == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((tuple(self), self.changes, self.proportional))

    def __repr__(self) -> str:
        return f"MixtureWeights({list(self)!r}, changes={list(self.changes)!r})"

    def original_json(self) -> list[float] | None:
        """The original weights as the fingerprint's ``weights`` part keeps them."""
        return None if self.proportional else list(self)

    def current(self) -> tuple[float, ...]:
        """The weights in force after the last change."""
        return self.changes[-1].weights if self.changes else tuple(self)


def changes_to_json(weights: Any) -> list[list[Any]]:
    """The ``weight_changes`` part of a fingerprint (empty: the weights never changed)."""
    return [c.to_json() for c in getattr(weights, "changes", ())]


def changes_from_json(text: Any) -> list[WeightChange]:
    """The changes a state's ``weight_changes`` part holds (absent: none).

    Raises:
        ValueError: The part is not what :func:`changes_to_json` writes.
    """
    if text is None:
        return []
    try:
        rows = json.loads(text) if isinstance(text, str) else None
        return [WeightChange(int(g), tuple(float(w) for w in ws), tuple(int(c) for c in cs),
                             int(e)) for g, cs, ws, e in rows]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"corrupted state: its 'weight_changes' part {text!r:.200} is not a "
                         "list of [chunk, counts, weights, epoch]; nothing was loaded") from exc


def epoch_weights(weights: Any, epoch: int) -> Any:
    """The weights the schedule of ``epoch`` runs: the changes made in that epoch keep
    their chunk; those of earlier epochs hold from the epoch's first chunk on."""
    changes = getattr(weights, "changes", ())
    if not changes or all(c.epoch == epoch for c in changes):
        return weights
    earlier = [c for c in changes if c.epoch < epoch]
    base = earlier[-1].weights if earlier else tuple(weights)
    now = [c for c in changes if c.epoch == epoch]
    return MixtureWeights(base, now, proportional=weights.proportional and not earlier)


def change_point(state: Mapping[str, Any], num_lanes: int, *, action: str) -> int:
    """Where new weights start for ``state``: the highest global chunk of any lane's
    ``next``.

    Lane ``l`` has fixed every chunk of its own below its ``next`` one (done, or
    replayed from its window exactly as saved), and a resume regenerates the
    rest from the schedule states the state holds: its window rows and its
    ``next``, all made with the weights before. Starting the new weights at
    the highest ``next`` keeps every one of them a state of the changed
    schedule too (the counts at a chunk come from the chunks before it), so
    any subset of lanes (a rank of any world size, a lane worker) resumes
    from its own entries alone. The chunks between a lane's ``next`` and the
    point (fewer than ``num_lanes``) are new but still take the weights
    before. The point depends on the whole state, never on the world size, so
    every lane's entry is needed, and a stream that has ended for some lane
    has no point to change at.

    Raises:
        ValueError: Lanes missing, or a lane whose stream has ended; naming
            them and what to do. ``action`` names what was asked.
    """
    lanes = state.get("lanes") or {}
    missing = [lane for lane in range(num_lanes) if str(lane) not in lanes]
    if missing:
        raise ValueError(
            f"{action}: the state has no entry for lane(s) {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}: the point where the new weights start "
            "depends on every lane's position, so it needs the whole state. Merge every "
            "rank's state with zephon_torch.checkpoint.merge_states() (or save with "
            "loader.state_dict(gather=True)) and pass that"
        )
    ended = [lane for lane in range(num_lanes) if lanes[str(lane)].get("next") is None]
    if ended:
        raise ValueError(
            f"{action}: the saved stream has ended for lane(s) {ended[:8]} (no next chunk): "
            "new weights cannot start after the end of the stream. Resume with the weights "
            "the state was saved by, or start a new run"
        )
    return max(int(lanes[str(lane)]["next"][0]) for lane in range(num_lanes))


def next_before(state: Mapping[str, Any], global_chunk: int) -> list[int] | None:
    """The latest ``next`` schedule state of ``state``'s lanes at or before ``global_chunk``
    (as JSON), to walk the schedule from to it; None if every lane's is later.

    At a change point (:func:`change_point`) it is the ``next`` of the lane whose
    next chunk the point is, whatever the dealing of chunks to lanes.
    """
    best: list[int] | None = None
    for entry in (state.get("lanes") or {}).values():
        nxt = entry.get("next") if isinstance(entry, Mapping) else None
        if nxt is not None and int(nxt[0]) <= global_chunk and (
                best is None or int(nxt[0]) > int(best[0])):
            best = list(nxt)
    return best
