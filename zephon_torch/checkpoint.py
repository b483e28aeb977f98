"""Checkpoint support: the replay filter the planner inserts before ``batch``.

After ``load_state_dict``, each lane replays its inflight chunks from its
last epoch boundary; the replay filter drops that lane's replayed records
until it has dropped the one whose cursor equals the lane's replay cursor,
then lets everything through. On a fresh run it is a passthrough.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zephon_torch.ops.accumulators import Accumulator, PassthroughAccumulator
from zephon_torch.ops.base import OpContext, Operator, OpTraits

__all__ = ["ReplayFilter"]


class ReplayFilter(Operator):
    """Drops a lane's replayed records up to its replay cursor (a passthrough when fresh)."""

    name = "replay_filter"

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> Accumulator:
        return PassthroughAccumulator()

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return list(elems)

    def traits(self) -> OpTraits:
        return OpTraits(inline=True)
