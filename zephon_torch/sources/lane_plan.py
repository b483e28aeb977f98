"""More lanes from a global chunk on: how a run grows past the ``num_lanes`` it began with.

A run's lanes bound its world size (a rank needs a lane). A run that began
with 8 lanes and must resume on 16 or 1,024 ranks grows its lanes at a
*change point*, a global chunk ``G`` (``Pipeline.change_lanes``,
``zephon_torch/relane.py``): chunks before ``G`` are dealt as before; from
``G`` on, the next ``L'`` lanes take them in turn::

    global chunk g < G:   lane g % L,             its chunk_id counted on
    global chunk g >= G:  lane (g - G) % L',      chunk_id = chunks the lane
                                                  had before G + (g - G) // L'

    G = 10, L = 2 -> L' = 4:
    global chunk   ... 8  9 | 10 11 12 13 14 15 ...
    lane           ... 0  1 |  0  1  2  3  0  1 ...
    chunk_id       ... 4  4 |  5  5  0  0  6  6 ...

An old lane keeps its identity and its state (its open bins, shuffle buffer
and partial batch carry on; its chunk ids keep counting), so nothing of the
stream before ``G`` changes: every window a state holds replays as saved.
A new lane starts fresh at its first chunk, as every lane does at the start
of a run. Lanes only grow: taking lanes away would end the streams of the
lanes left out with what they hold, which a run with fewer ranks never needs
(a rank runs as many lanes as it owns).

Per-lane settings stay those of the first lane count: a shuffle's share
per lane is ``ceil(buffer_size / num_lanes)`` of the pipeline as built, so a
rank with as many lanes as before holds as much as before, and the old
lanes' buffers do not change size part-way.

A :class:`LaneChange` records ``(at_chunk, num_lanes, epoch)``. A pipeline's
fingerprint keeps its ``num_lanes`` part and adds a ``lane_changes`` part only
when there is a change, so every other pipeline's fingerprint, state and
output is what it was. Later epochs (``zephon_torch/epochs.py``) run with the
lanes of the last change from their start (:func:`epoch_lane_changes`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LaneChange", "LanePlan", "check_lane_changes", "epoch_lane_changes",
           "lane_changes_from_json", "lane_changes_to_json", "lane_count", "total_lanes"]


@dataclass(frozen=True, slots=True)
class LaneChange:
    """``num_lanes`` lanes from global chunk ``at_chunk`` on (see the module doc).

    Attributes:
        at_chunk: The first global chunk dealt over the new lane count.
        num_lanes: The lane count from there (more than before).
        epoch: The epoch the change was made in; later epochs run with these
            lanes from their start.
    """

    at_chunk: int
    num_lanes: int
    epoch: int = 0

    def to_json(self) -> list[int]:
        """``[at_chunk, num_lanes, epoch]``."""
        return [self.at_chunk, self.num_lanes, self.epoch]


def lane_changes_to_json(changes: Sequence[LaneChange]) -> list[list[int]]:
    """The changes as JSON-able lists (the fingerprint's ``lane_changes`` part)."""
    return [c.to_json() for c in changes]


def lane_changes_from_json(value: Any) -> list[LaneChange]:
    """The changes of a fingerprint's ``lane_changes`` part (``None``: none).

    Raises:
        ValueError: The part is not a list of ``[at_chunk, num_lanes, epoch]``.
    """
    if value is None:
        return []
    if isinstance(value, str):  # a fingerprint part as the state stores it
        value = json.loads(value)
    try:
        return [LaneChange(int(at), int(n), int(e)) for at, n, e in value]
    except (TypeError, ValueError):
        raise ValueError(f"corrupted state: the fingerprint's 'lane_changes' {value!r} is not a "
                         "list of [at_chunk, num_lanes, epoch]; nothing was loaded") from None


def check_lane_changes(num_lanes: int, changes: Sequence[LaneChange]) -> None:
    """Refuse changes that do not grow the lanes at increasing chunks.

    Raises:
        ValueError: Naming the change and what to do.
    """
    lanes, at = num_lanes, 0
    for c in changes:
        if not isinstance(c, LaneChange):
            raise ValueError(f"lane_changes must hold LaneChange values, got {c!r}")
        if c.num_lanes <= lanes:
            raise ValueError(
                f"a lane change to {c.num_lanes} lanes at global chunk {c.at_chunk} does not "
                f"grow the {lanes} lanes in force there: lanes only grow (a rank may own "
                "several lanes, so fewer ranks never need fewer lanes)")
        if c.at_chunk < at:
            raise ValueError(f"lane changes must come in chunk order: {c.at_chunk} after {at}")
        lanes, at = c.num_lanes, c.at_chunk


def total_lanes(num_lanes: int, changes: Sequence[LaneChange]) -> int:
    """The lanes a pipeline has in all: those of its last change, else ``num_lanes``."""
    return changes[-1].num_lanes if changes else num_lanes


def lane_count(source: Any) -> int:
    """The lanes of a pipeline's source config in all (its ``num_lanes``, grown or not)."""
    return total_lanes(source.num_lanes, getattr(source, "lane_changes", ()))


def epoch_lane_changes(changes: Sequence[LaneChange], epoch: int) -> tuple[LaneChange, ...]:
    """The changes as epoch ``epoch`` runs them: those of earlier epochs from its first
    chunk (the last of them is what counts), its own where they were made, later
    ones not at all."""
    earlier = [c for c in changes if c.epoch < epoch]
    own = [c for c in changes if c.epoch == epoch]
    start = [LaneChange(0, earlier[-1].num_lanes, epoch)] if earlier else []
    return tuple(start + own)


class LanePlan:
    """Which lane each global chunk goes to, and its lane-local chunk id.

    Args:
        num_lanes: The lanes the run began with.
        changes: Where the lanes grew (``at_chunk`` ascending), as the epoch
            at hand runs them.
    """

    def __init__(self, num_lanes: int, changes: Sequence[LaneChange] = ()) -> None:
        check_lane_changes(num_lanes, changes)
        self.num_lanes = num_lanes
        #: ``(first global chunk, lane count)`` of each regime, in order.
        self.regimes: list[tuple[int, int]] = [(0, num_lanes)]
        for c in changes:
            if c.at_chunk == self.regimes[-1][0]:
                self.regimes[-1] = (c.at_chunk, c.num_lanes)  # the regime before is empty
            else:
                self.regimes.append((c.at_chunk, c.num_lanes))
        self.total = self.regimes[-1][1]
        self._seen: dict[tuple[int, int], int] = {}
        self.simple = len(self.regimes) == 1 and self.regimes[0][0] == 0

    def _regime(self, global_chunk: int) -> int:
        regimes = self.regimes
        k = len(regimes) - 1
        while regimes[k][0] > global_chunk:
            k -= 1
        return k

    def _chunks_in(self, k: int, lane: int) -> int:
        """The chunks of ``lane`` in regime ``k`` (which has a successor)."""
        start, count = self.regimes[k]
        length = self.regimes[k + 1][0] - start
        return max(0, -(-(length - lane) // count)) if lane < count else 0

    def _before(self, k: int, lane: int) -> int:
        """The chunks ``lane`` had before regime ``k`` (kept: asked for every chunk)."""
        key = (k, lane)
        found = self._seen.get(key)
        if found is None:
            found = self._seen[key] = sum(self._chunks_in(i, lane) for i in range(k))
        return found

    def lane_of(self, global_chunk: int) -> tuple[int, int]:
        """``(lane_id, chunk_id)`` of a global chunk."""
        if self.simple:
            n = self.total
            return global_chunk % n, global_chunk // n
        k = self._regime(global_chunk)
        start, count = self.regimes[k]
        j = global_chunk - start
        lane = j % count
        return lane, self._before(k, lane) + j // count

    def global_chunk(self, lane: int, chunk_id: int) -> int:
        """The global chunk of ``lane``'s chunk ``chunk_id`` (the inverse of :meth:`lane_of`)."""
        if self.simple:
            return chunk_id * self.total + lane
        seen = 0
        for k, (start, count) in enumerate(self.regimes):
            if lane >= count:
                continue
            here = self._chunks_in(k, lane) if k + 1 < len(self.regimes) else None
            if here is None or chunk_id < seen + here:
                return start + lane + (chunk_id - seen) * count
            seen += here
        raise ValueError(f"lane {lane} is not one of the plan's {self.total} lanes")

    def next_chunk(self, lane: int, global_chunk: int) -> int:
        """The first global chunk at or after ``global_chunk`` that goes to ``lane``
        (``-1``: none, the lane is not one of the plan's)."""
        regimes = self.regimes
        k = self._regime(global_chunk)
        for i in range(k, len(regimes)):
            start, count = regimes[i]
            if lane >= count:
                continue
            j0 = max(global_chunk, start) - start
            found = start + j0 + (lane - j0) % count
            if i + 1 == len(regimes) or found < regimes[i + 1][0]:
                return found
        return -1

    def first_chunk(self, lane: int) -> int:
        """The global chunk of ``lane``'s first chunk."""
        return self.global_chunk(lane, 0)

    def describe(self, lane: int) -> str:
        """``lane``'s first global chunks, for messages."""
        firsts = [self.global_chunk(lane, i) for i in range(3)]
        return ", ".join(str(g) for g in firsts) + ", ..."
