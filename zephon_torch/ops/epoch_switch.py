"""An accumulator whose parameters change at an epoch boundary of each lane.

A resume may change some parameters of an operator before the resume point
(:attr:`~zephon_torch.ops.base.Operator.resume_may_change_at_epoch`: a
shuffle's ``buffer_size``) from each lane's next epoch boundary on: the epochs
the lane replays must run as they ran, with the saved values. The operator's
context then carries, per lane, ``(until_chunk, params)`` pairs
(:attr:`~zephon_torch.ops.base.OpContext.earlier_params`), and
:func:`switching_accumulator` gives it one accumulator per parameter set and a
router between them::

    lane 0, until 8 -> {buffer_size: 32}
      chunks 0..7  ──► accumulator of op.with_params({buffer_size: 32})
      chunks 8..   ──► accumulator of op itself

Every epoch of a lane goes whole to one accumulator (epochs start at
multiples of ``flush_every_k_chunks`` and ``until_chunk`` is one), and a flush
sentinel separates it from the next, so each accumulator sees exactly the
epochs the run it stands for would have given it, and the lane's output is
theirs, epoch after epoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zephon_torch.block import Block
from zephon_torch.ops.accumulators import Accumulator, lane_of

if TYPE_CHECKING:
    from zephon_torch.ops.base import OpContext, Operator

__all__ = ["SwitchingAccumulator", "switching_accumulator"]


def switching_accumulator(op: Operator, *, deterministic: bool, ctx: OpContext) -> Accumulator:
    """``op``'s accumulator for a context with ``earlier_params`` (see the module doc).

    Each distinct parameter set gets one accumulator, from
    ``op.with_params(params)``; chunks past every ``until_chunk`` of their lane
    go to ``op``'s own.

    Raises:
        ValueError: ``op`` refuses one of the parameter sets.
    """
    plain = dataclasses.replace(ctx, earlier_params={})
    current = op.accumulator(deterministic=deterministic, ctx=plain)
    accs: list[Accumulator] = []
    made: dict[str, int] = {}
    routes: dict[int, list[tuple[int, int]]] = {}
    for lane, pairs in ctx.earlier_params.items():
        route = []
        for until, params in pairs:
            key = repr(sorted(params.items()))
            if key not in made:
                made[key] = len(accs)
                accs.append(op.with_params(params).accumulator(deterministic=deterministic,
                                                               ctx=plain))
            route.append((int(until), made[key]))
        routes[int(lane)] = sorted(route)
    return SwitchingAccumulator(current, accs, routes)


class SwitchingAccumulator(Accumulator):
    """Routes each lane's elements, by chunk, to the accumulator of their epoch.

    Args:
        current: The accumulator of the operator as it is now.
        earlier: The accumulators of the saved parameter sets.
        routes: Per lane, ``(until_chunk, index into earlier)`` ascending: a
            chunk below ``until_chunk`` (and at or above the previous one) goes
            to that accumulator; a chunk past all of them, or of a lane without
            a route, to ``current``.
    """

    def __init__(self, current: Accumulator, earlier: Sequence[Accumulator],
                 routes: Mapping[int, Sequence[tuple[int, int]]]) -> None:
        self._all = [*earlier, current]
        self._current = len(earlier)
        self._routes = {lane: list(route) for lane, route in routes.items()}
        self.takes_blocks = all(acc.takes_blocks for acc in self._all)
        self.reads_payload = any(acc.reads_payload for acc in self._all)

    def _target(self, lane: int, chunk_id: int) -> int:
        for until, index in self._routes.get(lane, ()):
            if chunk_id < until:
                return index
        return self._current

    def push_block(self, block: Block) -> list[Block]:
        if not len(block):
            return []
        target = self._target(block.lane, int(block.chunk_ids[0]))
        return self._all[target].push_block(block)

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        # Between two sentinels a lane's elements are of one epoch: one target each.
        parts: dict[int, list[Any]] = {}
        for elem in elems:
            lane = lane_of(elem)
            meta = elem.records[0].meta if hasattr(elem, "records") else elem.meta
            parts.setdefault(self._target(lane, meta.chunk_id), []).append(elem)
        out: list[list[Any]] = []
        for target in sorted(parts):
            out.extend(self._all[target].push_many(parts[target]))
        return out

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        if lane_id is not None:
            return [mb for acc in self._all for mb in acc.flush(reset=reset, lane_id=lane_id)]
        # End of stream: a lane holds data in one of them at most, so each lane's
        # remainder comes out as from one accumulator (only each lane's order counts).
        out: list[list[Any]] = []
        for acc in self._all:
            out.extend(acc.flush(reset=reset))
        return out

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        return any(acc.has_pending_data(lane_id) for acc in self._all)

    def poll(self) -> list[list[Any]]:
        return [mb for acc in self._all for mb in acc.poll()]

    def take_dropped(self) -> list[Any]:
        return [elem for acc in self._all for elem in acc.take_dropped()]
