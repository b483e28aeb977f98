"""``batch``: group each lane's records into :class:`~zephon_torch.types.SampleBatch` es.

The accumulator is a
:class:`~zephon_torch.ops.accumulators.BatchingAccumulator`: it collects a
lane's records in stream order and hands over a micro-batch as soon as the
lane holds ``microbatch_size`` of them; the workers wrap each micro-batch in
one ``SampleBatch``. With ``microbatch_size=3`` and records ``a0 b0 c1 d0 e1``
(letter, lane)::

    push a0 b0 c1 d0 -> [[a0, b0, d0]]  -> SampleBatch(a0, b0, d0)
    push e1          -> []               (lane 1 holds c1 e1)
    flush()          -> drop_last=True:  c1 e1 reported by take_dropped()
                        drop_last=False: [[c1, e1]] -> SampleBatch(c1, e1)

Batches never mix lanes and keep the records' order. Tombstones and flush
sentinels never enter the accumulator: the runner forwards tombstones in
stream order beside the batches, and turns a flush sentinel into
``flush(reset=True, lane_id=...)`` (``drop_last=False``: the partial batch
leaves) or, with ``drop_last=True``, stalls it until
``try_epoch_reset(boundary, lane)`` holds, that is until every record from
before the boundary has left in a full batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zephon_torch.block import Block
from zephon_torch.block_views import BlockBatch
from zephon_torch.ops.accumulators import Accumulator, BatchingAccumulator
from zephon_torch.ops.base import Element, OpContext, Operator, OpTraits
from zephon_torch.types import SampleBatch, SampleRecord

__all__ = ["Batch"]


class Batch(Operator):
    """Group each lane's records into batches of ``microbatch_size``.

    Args:
        microbatch_size: Records per batch (positive). It defines the output,
            so it cannot be overridden as a performance knob.
        drop_last: Discard (as counted tombstones, via ``take_dropped``) the
            partial batch a lane holds at the end of the stream instead of
            emitting it, and stall flush sentinels rather than emit a partial
            batch mid-stream.

    Raises:
        ValueError: ``microbatch_size`` is not a positive integer.
    """

    name = "batch"
    # Batches are cut after the resume point (the replay filter stands right before
    # this stage), so both may change on resume: the next batch is cut the new way.
    resume_may_change = frozenset({"microbatch_size", "drop_last"})

    def __init__(self, microbatch_size: int, *, drop_last: bool = True) -> None:
        if (not isinstance(microbatch_size, int) or isinstance(microbatch_size, bool)
                or microbatch_size < 1):
            raise ValueError(
                f"batch microbatch_size must be a positive integer, got {microbatch_size!r}; "
                "it is the number of records (rows) per batch handed to the trainer"
            )
        self.microbatch_size = microbatch_size
        self.drop_last = bool(drop_last)

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> Accumulator:
        """Return a :class:`BatchingAccumulator` of ``microbatch_size``.

        ``ctx.microbatch_size`` is ignored: the batch size is a parameter.
        """
        return BatchingAccumulator(self.microbatch_size, drop_last=self.drop_last)

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Wrap one micro-batch (records of one lane, in order) in a ``SampleBatch``.

        Raises:
            TypeError: An element is not a ``SampleRecord``.
            ValueError: The records span several lanes, or one is a tombstone
                or a flush sentinel (the runner must handle those itself;
                silently batching them would hand them to training).
        """
        if not elems:
            return []
        lane = None
        for elem in elems:
            if not isinstance(elem, SampleRecord):
                raise TypeError(
                    f"batch expects SampleRecord elements, got {type(elem).__name__}"
                )
            meta = elem.meta
            if meta.is_sentinel:
                raise ValueError(
                    f"batch received a tombstone or flush sentinel at cursor "
                    f"{meta.as_cursor_key()} of lane {meta.lane_id}; the runner must route "
                    "these around the batch accumulator"
                )
            if lane is None:
                lane = meta.lane_id
            elif meta.lane_id != lane:
                raise ValueError(
                    f"batch micro-batch mixes lanes {lane} and {meta.lane_id}; batches are "
                    "per lane"
                )
        return [SampleBatch(elems)]

    def process_block(self, block: Block) -> list[Element]:
        """Wrap one micro-batch held as a block (one lane's data rows) in a batch view.

        The engine routes tombstone rows around this stage, so the block holds
        data only; the batch is a :class:`~zephon_torch.block_views.BlockBatch`, whose
        records are built only if someone asks for them.
        """
        if block.tomb is not None:
            where = block.cursor_key(int(block.tomb.argmax()))
            raise ValueError(
                f"batch received a tombstone at cursor {where} of lane {block.lane}; the "
                "runner must route tombstones around the batch accumulator"
            )
        return [BlockBatch(block)]

    def traits(self) -> OpTraits:
        """Batching keeps cursor order and produces :class:`SampleBatch` elements.

        Wrapping records in a batch is trivial, so it runs on the driver thread.
        """
        return OpTraits(produces_batches=True, inline=True)

    def config(self) -> dict[str, Any]:
        """The parameters that define the output."""
        return {**super().config(), "microbatch_size": self.microbatch_size,
                "drop_last": self.drop_last}
