"""Positions kept after every item, cheaply: the state built only when it is asked for.

``zephon_torch.DataLoader`` keeps the iterator's position after every batch
it produces (it prefetches, and must answer ``state_dict()`` for the last
batch the caller received, not the last one made). Building the whole
JSON-able state each time (every lane's entry, then a checksum over its JSON
text) cost about a quarter of the in-process loader's time on a cheap job.

A :class:`StateSnapshot` is that position, taken for the price of the lanes
whose books changed since the last one: :class:`SnapshotBook` keeps the lane
entries of the last snapshot (``resume.lane_entries``, the very function
``PipelineIterator.state_dict()`` uses) and rebuilds only the entries of the
lanes the books name in ``Accounting.changed``; everything a lane's entry
reads besides its own books (the loaded state, the lanes still replaying, the
emitter and whether it has finished) is compared at each snapshot, and a
change rebuilds every entry. Entries are never edited once made, so snapshots
share them. :meth:`StateSnapshot.state` then assembles the state
(``resume.make_state``, checksum included), once, and hands out a fresh copy
at each call: the same dict ``state_dict()`` would have returned at that
point.

Why an unchanged lane's entry stays right: it reads the lane's progress
(changed only through the books' events, which mark the lane), whether the
lane is replaying and the loaded state (compared), and, when the lane's next
chunk is not registered yet, the schedule state of that chunk from the
emitter: a pure function of the chunk while it is not emitted (a pending
replay, or the schedule walked to it), and emitting it registers it, which
marks the lane.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zephon_torch.accounting import Accounting
from zephon_torch.checkpoint import key_to_json
from zephon_torch.runners import resume
from zephon_torch.sources.lane_plan import LanePlan

__all__ = ["SnapshotBook", "StateSnapshot", "fresh_copy"]


def fresh_copy(value: Any) -> Any:
    """``value`` with every dict and list copied (what a state holds: JSON builtins)."""
    kind = type(value)
    if kind is dict:
        return {k: fresh_copy(v) for k, v in value.items()}
    if kind is list:
        return [fresh_copy(v) for v in value]
    return value


class StateSnapshot:
    """An iterator's position after one item; :meth:`state` is its ``state_dict()``.

    Made by :class:`SnapshotBook` (or :meth:`ready`, from a state already
    built); it holds the lane entries of that moment, which nobody edits.
    """

    __slots__ = ("_built", "_parts", "epoch", "lanes", "num_lanes", "round_robin")

    def __init__(self, lanes: dict[str, dict[str, Any]], *, parts: dict[str, Any],
                 num_lanes: int, round_robin: dict[str, Any] | None, epoch: int) -> None:
        self.lanes = lanes
        self._parts = parts
        self.num_lanes = num_lanes
        self.round_robin = round_robin
        self.epoch = epoch
        self._built: dict[str, Any] | None = None

    @classmethod
    def ready(cls, state: dict[str, Any]) -> StateSnapshot:
        """A snapshot of a state already built (a loaded state, narrowed)."""
        snapshot = cls(state["lanes"], parts=state["fingerprint"], num_lanes=state["num_lanes"],
                       round_robin=state.get("round_robin"), epoch=state.get("epoch", 0))
        snapshot._built = state
        return snapshot

    def state(self) -> dict[str, Any]:
        """The state (``PipelineIterator.state_dict()``'s dict), a fresh copy at each call."""
        if self._built is None:
            self._built = resume.make_state(
                deterministic=True, parts=dict(self._parts), num_lanes=self.num_lanes,
                lanes=fresh_copy(self.lanes), round_robin=fresh_copy(self.round_robin),
                epoch=self.epoch)
        return fresh_copy(self._built)


class SnapshotBook:
    """The lane entries of an iterator's last snapshot, brought up to date per snapshot.

    A lane's entry is ``resume.lane_entries``' own, made again when what
    shapes it (its replay window, the chunks registered, where its schedule
    goes on) has changed; between two such changes, a delivery moves only
    the entry's ``replay_cursor``, ``replay_count`` and ``outputs``, which
    :meth:`_moved` sets as ``checkpoint.lane_state`` does.

    Args:
        lanes: The iterator's lanes, in order.
        num_lanes: The pipeline's lane count.
    """

    def __init__(self, lanes: Sequence[int], num_lanes: int) -> None:
        self.lanes = list(lanes)
        self.num_lanes = num_lanes
        self._entries: dict[str, dict[str, Any]] = {}
        # Per lane: what shaped its last entry made by lane_entries, and that entry.
        self._shapes: dict[int, tuple[tuple, dict[str, Any]]] = {}
        # What every entry read besides its lane's books, as of the last snapshot.
        self._accounting: Accounting | None = None
        self._loaded: Mapping[str, Any] | None = None
        self._replaying: frozenset[int] = frozenset()
        self._emitter: Any = None
        self._finished: bool | None = None
        self._plan: LanePlan | None = None

    def take(self, accounting: Accounting, loaded: Mapping[str, Any], replaying: set[int],
             emitter: Any, *, parts: dict[str, Any], round_robin: dict[str, Any],
             epoch: int, plan: LanePlan) -> StateSnapshot:
        """The position now (the caller holds the iterator still, its books settled).

        The arguments are what ``PipelineIterator.state_dict()`` passes to
        ``resume.lane_entries`` and ``resume.make_state``.
        """
        changed = accounting.changed
        finished = bool(emitter.finished)
        self._plan = plan  # how the epoch deals its chunks (``sources/lane_plan.py``)
        if (accounting is not self._accounting or loaded is not self._loaded
                or emitter is not self._emitter or finished != self._finished
                or replaying != self._replaying):
            self._accounting, self._loaded, self._emitter = accounting, loaded, emitter
            self._finished, self._replaying = finished, frozenset(replaying)
            self._shapes = {}
            stale = self.lanes
            entries: dict[str, dict[str, Any]] = {}
        else:
            stale = list(changed)  # the books' lanes: this iterator's
            entries = dict(self._entries) if stale else self._entries
        changed.clear()
        if stale:
            saved = loaded["lanes"]
            for lane in stale:
                entries[str(lane)] = self._entry(accounting, lane, saved, loaded, replaying,
                                                 emitter)
            self._entries = entries
        return StateSnapshot(entries, parts=parts, num_lanes=self.num_lanes,
                             round_robin=round_robin, epoch=epoch)

    def _entry(self, accounting: Accounting, lane: int, saved: Mapping[str, Any],
               loaded: Mapping[str, Any], replaying: set[int], emitter: Any
               ) -> dict[str, Any]:
        """``resume.lane_entries``' entry of ``lane`` now."""
        progress = accounting.lanes[lane]
        key = str(lane)
        if lane in replaying or (key in saved and progress.outputs == saved[key]["outputs"]):
            # Still at the loaded position: the loaded entry (lane_entries says so).
            return resume.lane_entries(accounting, [lane], loaded, replaying, emitter,
                                       self._plan)[key]
        shape = (progress.window(), progress.chunks_version, progress.registered_until,
                 progress.exhausted)
        known = self._shapes.get(lane)
        if known is not None and known[0] == shape:
            return self._moved(known[1], progress, shape[0])
        entry = resume.lane_entries(accounting, [lane], loaded, replaying, emitter,
                                    self._plan)[key]
        self._shapes[lane] = (shape, entry)
        return entry

    @staticmethod
    def _moved(entry: dict[str, Any], progress: Any, span: tuple[int, int] | None
               ) -> dict[str, Any]:
        """``entry`` (of the same shape) with the lane's cursor, count and outputs of now,
        as ``checkpoint.lane_state`` writes them."""
        cursor = None
        count = 0
        if span is not None:
            first, last = span
            if progress.cursor_epoch is not None and progress.cursor_epoch >= first:
                cursor = key_to_json(progress.cursor)
                count = sum(n for e, n in progress.delivered_in_epoch.items()
                            if first <= e <= last)
        return {**entry, "replay_cursor": cursor, "replay_count": count,
                "outputs": progress.outputs}
