"""Accumulators: the single-threaded, stream-ordered half of an operator.

An accumulator receives a stage's input in stream order (never from two
threads at once), buffers it, and returns the micro-batches that are ready
for ``process_many``. Every piece of state that spans calls lives here, keyed
by lane, so that a flush sentinel of one lane resets that lane alone.

Example, ``CountingAccumulator(3)`` fed elements of lanes 0 and 1::

    push_many([a0, b1, c0])   -> []             (lane 0 holds a0 c0, lane 1 b1)
    push_many([d0, e1])       -> [[a0, c0, d0]]  (lane 0 reached 3)
    flush(reset=True, lane_id=1) -> [[b1, e1]]   (lane 1 only; lane 0 untouched)
    flush()                   -> []             (end of stream: nothing left)

Determinism: with ``max_latency_ms=None`` (what every built-in operator uses
when ``deterministic=True``) boundaries depend only on counts, never on time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from zephon_torch.block import Block
from zephon_torch.types import SampleBatch, SampleRecord

__all__ = [
    "Accumulator",
    "BatchingAccumulator",
    "CountingAccumulator",
    "PassthroughAccumulator",
    "lane_of",
]


def lane_of(elem: SampleRecord | SampleBatch) -> int:
    """The lane of a record, or of a (single-lane) batch."""
    if type(elem) is SampleRecord:
        return elem.meta.lane_id
    if isinstance(elem, SampleBatch):
        return elem.lane_ids[0] if elem.lane_ids else -1
    return elem.meta.lane_id


class Accumulator:
    """Base class: decides micro-batch boundaries and holds cross-call state.

    Attributes:
        reads_payload: False (the default) declares that ``push_many`` looks
            only at metadata; True that it inspects payloads. The runners
            hand every accumulator real payloads (the process runner copies
            a worker's results into the main process whole), so the flag is
            a declaration kept from the operator contract, not a switch.
    """

    reads_payload: bool = False
    #: True when :meth:`push_block` is implemented: the engine then feeds this
    #: accumulator blocks (one lane's records as columns) instead of records,
    #: and the micro-batches it returns (from ``push_block`` and ``flush``)
    #: are blocks too.
    takes_blocks: bool = False
    #: True when a push may return small micro-batches first (a lane's first push
    #: cut to grow, see :class:`CountingAccumulator`): a local stage then runs the
    #: later ones of a push as they are released, after the first has moved on.
    ramps: bool = False

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        """Consume elements in stream order; return the micro-batches now ready."""
        raise NotImplementedError

    def push_block(self, block: Block) -> list[Block]:
        """Consume a block (one lane's rows, in stream order); return the micro-batches ready.

        Only called when :attr:`takes_blocks` is true.
        """
        raise NotImplementedError

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        """Emit what is buffered.

        ``flush()`` at end of stream emits every lane's remainder.
        ``flush(reset=True, lane_id=l)`` at a flush sentinel emits lane ``l``'s
        remainder and leaves that lane exactly as a fresh accumulator would
        be, every other lane untouched.
        """
        raise NotImplementedError

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        """Whether a flush (of ``lane_id``, or of any lane) would emit anything."""
        raise NotImplementedError

    def try_epoch_reset(self, boundary_chunk_id: int, lane_id: int) -> bool:
        """Whether a stalled sentinel at ``boundary_chunk_id`` may now be released.

        True means this lane's future output equals that of a fresh
        accumulator fed only what it still buffers. The default is the
        conservative answer: only when nothing is pending.
        """
        return not self.has_pending_data(lane_id)

    def poll(self) -> list[list[Any]]:
        """Micro-batches due by time alone (latency bounds); none by default."""
        return []

    def take_dropped(self) -> list[Any]:
        """Elements discarded since the last call (e.g. a ``drop_last`` remainder).

        The runner turns them into tombstones so that no sample is lost
        silently.
        """
        return []


class PassthroughAccumulator(Accumulator):
    """Emits whatever arrives, at once, as one micro-batch; holds nothing."""

    takes_blocks = True

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        return [list(elems)] if elems else []

    def push_block(self, block: Block) -> list[Block]:
        return [block] if len(block) else []

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        return []

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        return False


class CountingAccumulator(Accumulator):
    """Buffers per lane and emits a lane's micro-batch when it holds ``max_batch``.

    Args:
        max_batch: Elements per micro-batch (positive).
        max_latency_ms: If set, :meth:`poll` also emits a partial micro-batch
            whose oldest element has waited this long. Time-dependent, so
            operators pass ``None`` when ``deterministic=True``.
        drop_last: At end of stream, discard partial micro-batches instead of
            emitting them (they are reported by :meth:`take_dropped`).
        ramp_from: If set, what a lane's first push brings is cut into
            micro-batches of this many elements, then twice as many each
            time, up to ``max_batch``, the last taking the rest of the push
            (none of it is held back); later pushes are cut at the full size.
            The first results of a lane (and of a resume) come after little
            work, consecutive micro-batches of one lane read the same parts
            of its files, and the steady state runs at the full size. Only
            for operators whose output does not depend on where micro-batches
            are cut.
    """

    def __init__(self, max_batch: int, *, max_latency_ms: float | None = None,
                 drop_last: bool = False, ramp_from: int | None = None) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        if max_latency_ms is not None and max_latency_ms < 0:
            raise ValueError(f"max_latency_ms must be >= 0 or None, got {max_latency_ms!r}")
        if ramp_from is not None and (not isinstance(ramp_from, int)
                                      or isinstance(ramp_from, bool) or ramp_from < 1):
            raise ValueError(f"ramp_from must be a positive integer or None, got {ramp_from!r}")
        self.max_batch = max_batch
        # Lanes whose first push has been cut (see ``ramp_from``).
        self._ramped: set[int] = set()
        self._ramp_from = ramp_from if ramp_from is not None and ramp_from < max_batch else None
        self.ramps = self._ramp_from is not None
        self.max_latency_ms = max_latency_ms
        self.drop_last = drop_last
        self._buffers: dict[int, list[Any]] = {}
        self._since: dict[int, float] = {}
        self._dropped: list[Any] = []
        # Block mode: per lane, the blocks held and their total rows.
        self._blocks: dict[int, list[Block]] = {}
        self._rows: dict[int, int] = {}

    takes_blocks = True

    def push_block(self, block: Block) -> list[Block]:
        """Hold the lane's rows; emit micro-batches of exactly ``max_batch`` rows."""
        n = len(block)
        if not n:
            return []
        lane = block.lane
        held = self._blocks.get(lane)
        if held is None:
            held = self._blocks[lane] = []
            self._rows[lane] = 0
            if self.max_latency_ms is not None:
                self._since[lane] = time.monotonic()
        if self._ramp_from is not None and lane not in self._ramped:
            return self._push_block_ramping(lane, block)
        size = self.max_batch
        have = self._rows[lane] + n
        if have < size:
            held.append(block)
            self._rows[lane] = have
            return []
        whole = Block.concat([*held, block]) if held else block
        cut = have - have % size
        ready = [whole.slice(i, i + size) for i in range(0, cut, size)]
        if cut < have:
            self._blocks[lane] = [whole.slice(cut, have)]
            self._rows[lane] = have - cut
            if self.max_latency_ms is not None:
                self._since[lane] = time.monotonic()
        else:
            del self._blocks[lane], self._rows[lane]
        return ready

    def _ramp_cuts(self, lane: int, have: int) -> list[int]:
        """Where a lane's first push of ``have`` elements is cut (see ``ramp_from``)."""
        self._ramped.add(lane)
        cuts, start, size = [], 0, self._ramp_from or self.max_batch
        while have - start > size:
            start += size
            cuts.append(start)
            size = min(self.max_batch, size * 2)
        return [*cuts, have]

    def _push_block_ramping(self, lane: int, block: Block) -> list[Block]:
        """:meth:`push_block` for a lane's first push: cut in growing micro-batches."""
        held = self._blocks.pop(lane)
        whole = Block.concat([*held, block]) if held else block
        del self._rows[lane]
        self._since.pop(lane, None)
        starts = [0, *self._ramp_cuts(lane, len(whole))]
        return [whole.slice(a, b) for a, b in pairwise(starts)]

    def _take_blocks(self, lane: int) -> Block | None:
        held = self._blocks.pop(lane, None)
        self._rows.pop(lane, None)
        return Block.concat(held) if held else None

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        if not elems:
            return []
        if self.max_latency_ms is None:
            lane = lane_of(elems[0])
            if all(e.meta.lane_id == lane for e in elems) if type(elems[0]) is SampleRecord \
                    else all(lane_of(e) == lane for e in elems):
                return self._push_lane(lane, elems)
        ready: list[list[Any]] = []
        buffers = self._buffers
        size = self.max_batch
        timed = self.max_latency_ms is not None
        for elem in elems:
            lane = elem.meta.lane_id if type(elem) is SampleRecord else lane_of(elem)
            buf = buffers.get(lane)
            if buf is None:
                buf = buffers[lane] = []
            if timed and not buf:
                self._since[lane] = time.monotonic()
            buf.append(elem)
            if len(buf) >= size:
                ready.append(buf)
                buffers[lane] = []
        # (A push of several lanes' records is cut at the full size.)
        self._ramped.update(buffers)
        return ready

    def _push_lane(self, lane: int, elems: Sequence[Any]) -> list[list[Any]]:
        """All elements of one lane (the common case): slice instead of appending."""
        buf = self._buffers.get(lane)
        if buf:
            buf.extend(elems)
        else:
            buf = list(elems)
        if self._ramp_from is not None and lane not in self._ramped:
            starts = [0, *self._ramp_cuts(lane, len(buf))]
            self._buffers[lane] = []
            return [buf[a:b] for a, b in pairwise(starts)]
        size = self.max_batch
        if len(buf) < size:
            self._buffers[lane] = buf
            return []
        cut = len(buf) - len(buf) % size
        ready = [buf[i:i + size] for i in range(0, cut, size)]
        self._buffers[lane] = buf[cut:]
        return ready

    def poll(self) -> list[list[Any]]:
        if self.max_latency_ms is None:
            return []
        now = time.monotonic()
        limit = self.max_latency_ms / 1000.0
        ready: list[Any] = []
        for lane, buf in self._buffers.items():
            if buf and now - self._since.get(lane, now) >= limit:
                ready.append(buf)
                self._buffers[lane] = []
        for lane in [lane for lane in self._blocks
                     if now - self._since.get(lane, now) >= limit]:
            block = self._take_blocks(lane)
            self._since.pop(lane, None)
            if block is not None:
                ready.append(block)
        return ready

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        lanes = sorted({*self._buffers, *self._blocks}) if lane_id is None else [lane_id]
        out: list[Any] = []
        for lane in lanes:
            buf: Any = self._buffers.pop(lane, None)
            block = self._take_blocks(lane)
            if block is not None:
                buf = block
            self._since.pop(lane, None)
            if buf is None or not len(buf):
                continue
            if self.drop_last and lane_id is None:
                if type(buf) is Block:
                    self._dropped.append(buf)
                else:
                    self._dropped.extend(buf)
            else:
                out.append(buf)
        return out

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        if lane_id is None:
            return any(self._buffers.values()) or bool(self._blocks)
        return bool(self._buffers.get(lane_id)) or lane_id in self._blocks

    def take_dropped(self) -> list[Any]:
        dropped, self._dropped = self._dropped, []
        return dropped


class BatchingAccumulator(CountingAccumulator):
    """The accumulator behind ``batch()``: counting, plus a chunk-aware epoch reset.

    With ``drop_last=True`` a flush sentinel cannot emit a partial batch, so
    the runner stalls it; :meth:`try_epoch_reset` releases it as soon as no
    record from before the boundary remains in the lane's buffer (the buffer
    then holds only records of the new epoch, which is what a fresh
    accumulator fed those records would hold).
    """

    def __init__(self, batch_size: int, *, drop_last: bool = True) -> None:
        super().__init__(batch_size, drop_last=drop_last)

    def try_epoch_reset(self, boundary_chunk_id: int, lane_id: int) -> bool:
        held = self._blocks.get(lane_id)
        if held:
            return all(int(b.chunk_ids.min()) >= boundary_chunk_id for b in held)
        buf = self._buffers.get(lane_id)
        if not buf:
            return True
        return all(_chunk_of(elem) >= boundary_chunk_id for elem in buf)


def _chunk_of(elem: Any) -> int:
    if isinstance(elem, SampleBatch):
        return min(elem.chunk_ids) if elem.chunk_ids else 0
    return elem.meta.chunk_id
