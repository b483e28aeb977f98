"""Fusing consecutive elementwise stages into one.

A chain such as ``fetch → decode_text → map_transform → tokenize`` is four
stages, and each would pay for its own accumulator, reorder slots and, under
the process runner, its own round trip through a worker. Elementwise
operators (:attr:`OpTraits.elementwise`: each input's outputs depend on that
input alone, in input order, and the default accumulator cuts the stream) do
not care where micro-batches begin and end, so the planner runs a run of them
as one stage: one micro-batch goes through every operator on one worker.

The outputs are those of the unfused chain. Tombstones made by one operator
of the run flow on inside the micro-batch, where the next operators pass them
through, so they keep their stream position exactly as the engine's control
slots would have kept it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from zephon_torch.block import Block
from zephon_torch.ops.base import Element, OpContext, Operator, OpTraits, check_elements

__all__ = ["FusedOperator", "parts_of"]


class FusedOperator(Operator):
    """Several elementwise operators run back to back on each micro-batch.

    Args:
        parts: ``(stage_name, operator)`` pairs in pipeline order; every
            operator must be elementwise.

    Raises:
        ValueError: Fewer than two parts, or a part that is not elementwise.
    """

    name = "fused"

    def __init__(self, parts: Sequence[tuple[str, Operator]]) -> None:
        if len(parts) < 2:
            raise ValueError(f"a fused stage needs at least two operators, got {len(parts)}")
        for stage_name, op in parts:
            if not op.traits().elementwise:
                raise ValueError(f"stage {stage_name!r} ({type(op).__name__}) is not "
                                 "elementwise and cannot be fused")
        self.parts = list(parts)
        self.ops = [op for _, op in self.parts]
        self.default_microbatch_size = max(op.default_microbatch_size for op in self.ops)
        firsts = [op.first_microbatch_size for op in self.ops]
        self.first_microbatch_size = None if None in firsts else min(firsts)  # type: ignore[misc]
        #: Where the stage runs (``"local"`` or ``"remote"``, with the same
        #: ``Remote`` options): the parts agree.
        self.placement = getattr(self.ops[0], "placement", "local")
        self.remote_options = getattr(self.ops[0], "remote_options", None)

    def setup(self, ctx: OpContext) -> None:
        """Set up every part, each under its own stage name."""
        for stage_name, op in self.parts:
            op.setup(dataclasses.replace(ctx, stage_name=stage_name))

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Run the micro-batch through each part in turn."""
        out: Sequence[Element] = elems
        for op in self.ops:
            out = op.process_many(out)
        return list(out) if type(out) is not list else out

    def process_block(self, block: Block) -> Block:
        """Run the block through each part: its block path, or its records.

        Consecutive parts without a block path share one view of the rows as
        records; the block is rebuilt once, before the next block path or at
        the end.
        """
        lane = block.lane
        records: list[Element] | None = None
        for name, op in self.parts:
            if op.has_block_path():
                if records is not None:
                    block, records = Block.from_records(records, lane=lane), None
                block = op.process_block(block)
            else:
                records = check_elements(
                    op.process_many(block.records() if records is None else records), name)
        return block if records is None else Block.from_records(records, lane=lane)

    def traits(self) -> OpTraits:
        """Elementwise; order, pointers and fan-out as the parts say."""
        traits = [op.traits() for op in self.ops]
        return OpTraits(
            preserves_cursor_order=all(t.preserves_cursor_order for t in traits),
            accepts_pointers=traits[0].accepts_pointers,
            fan_out=any(t.fan_out for t in traits),
            elementwise=True,
        )

    def config(self) -> dict[str, Any]:
        """The parts' configurations, in order."""
        return {**super().config(), "parts": [op.config() for op in self.ops]}

    def __repr__(self) -> str:
        return f"FusedOperator({' + '.join(name for name, _ in self.parts)})"


def parts_of(op: Operator) -> list[Operator]:
    """The operators a stage runs: the parts of a fused stage, else ``[op]``."""
    return list(op.ops) if isinstance(op, FusedOperator) else [op]
