"""The bin engine of both packers: :class:`PackingAccumulator`, per lane, in stream order.

The accumulator is the packers' state. For each lane it measures the
documents that arrive (one vectorised check of a ragged token column, or one
document at a time on the general path), turns empty and refused documents
into tombstones, asks the lane's placer (:class:`~zephon_torch.ops._binpack.BinPlacer`)
where every piece goes, and hands the pieces of the rows that went out to a
:class:`~zephon_torch.ops.pack_rows.RowBuilder`. Rows and tombstones leave in
the order of the documents that sent them out; a flush empties every open
bin. The rules themselves (placement, oversized documents, accounting) are
described, with worked examples, in :mod:`zephon_torch.ops.packing`.

Example: ``first_fit``, ``max_length=8``: documents of 5, 0 and 3 tokens in
one block give a tombstone (reason ``"empty"``) for the second, then the row
``[d0 d2]`` as the third arrives (the bin is full).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.block import Block
from zephon_torch.block_columns import Ragged
from zephon_torch.block_views import RowView
from zephon_torch.ops._binpack import BinPlacer, Placement
from zephon_torch.ops.accumulators import Accumulator
from zephon_torch.ops.pack_options import (
    DEFAULT_BFD_WINDOW,
    MASK_FIELD,
    check_common,
    check_int,
    checked_length,
    tokens_of,
)
from zephon_torch.ops.pack_rows import Lane, RowBuilder, Segment
from zephon_torch.token_ids import INT32_MAX, first_outside, id_range_error, values_outside
from zephon_torch.types import SampleRecord
from zephon_torch.vocab import AUTO_TOKEN_FIELDS

__all__ = ["PackFlatAccumulator", "PackSequencesAccumulator", "PackingAccumulator"]

# --------------------------------------------------------------------------- accumulators


class PackingAccumulator(Accumulator):
    """The bin engine shared by both packers: per-lane bins, decided in stream order.

    In block mode (what the engine uses) :meth:`push_block` takes one lane's
    documents as a block and returns the rows that went out as one block of
    assembled rows (flat token rows for ``pack_flat``, segment lists for
    ``pack_sequences``), plus a block of tombstones for documents it drops
    (empty, or oversized with ``oversized="drop"``). Placement is one call of
    :class:`~zephon_torch.ops._binpack.BinPlacer` over the block's array of
    token counts; rows are assembled by gathers from the documents' ragged
    token column, with positions and padding from offsets and the
    contributors as a table. Nothing ready is held back, so
    ``has_pending_data(lane)`` is true exactly when the lane has open bins
    (or, for ``best_fit_decreasing``, a partial window).

    :meth:`push_many` is the same engine for records (tools, tests and the
    seed's accumulator contract): it returns micro-batches of assembled
    rows, tombstones passing through in place.

    Args:
        max_length: Tokens per row.
        num_bins: Bins that may be open per lane (``first_fit``/``best_fit``).
        algorithm: One of :data:`ALGORITHMS`.
        min_sequence_length: A bin whose room drops below this goes out.
        oversized: ``"split"``, ``"drop"`` or ``"truncate"``.
        tokens_field: Payload field holding the tokens, or ``"auto"``.
        microbatch_size: Most elements per micro-batch :meth:`push_many` returns.
        bfd_window: Documents per ``best_fit_decreasing`` window (default
            :data:`DEFAULT_BFD_WINDOW`); only for that algorithm.
        pad_token_id: Token id of the trailing padding (flat rows).
        emit_positions: Emit per-segment ``positions`` (flat rows).
    """

    reads_payload = True  # placement needs each document's token count
    takes_blocks = True
    flat = False

    def __init__(self, max_length: int, *, num_bins: int = 8, algorithm: str = "first_fit",
                 min_sequence_length: int = 1, oversized: str = "split",
                 tokens_field: str = "auto", microbatch_size: int = 64,
                 bfd_window: int | None = None, pad_token_id: int = 0,
                 emit_positions: bool = True) -> None:
        check_common(max_length, num_bins, algorithm, tokens_field, min_sequence_length,
                      oversized, bfd_window)
        check_int("microbatch_size", microbatch_size, 1, None, "pass a positive size")
        self.max_length = int(max_length)
        self.num_bins = int(num_bins)
        self.algorithm = algorithm
        self.min_sequence_length = int(min_sequence_length)
        self.oversized = oversized
        self.tokens_field = tokens_field
        self.microbatch_size = int(microbatch_size)
        self.bfd_window = DEFAULT_BFD_WINDOW if bfd_window is None else int(bfd_window)
        self.pad_token_id = int(pad_token_id)
        self.emit_positions = bool(emit_positions)
        self._lanes: dict[int, Lane] = {}

    # ------------------------------------------------------------------ blocks

    def push_block(self, block: Block) -> list[Block]:
        """Place one lane's documents; return the rows that went out (and any tombstones)."""
        n = len(block)
        if not n:
            return []
        field = self._token_column(block)
        if field is not None:
            sizes = block.fields[field].lengths()
            self._check_column(block, field)
        else:
            sizes = np.array([self._measure(block, i) for i in range(n)], dtype=np.int64)
        limit = self.max_length
        dropped = np.zeros(n, dtype=bool)
        reasons: list[str | None] = [None] * n
        empty = sizes == 0
        if empty.any():
            dropped |= empty
            for i in np.flatnonzero(empty).tolist():
                reasons[i] = "empty"
        keeps = sizes
        if (sizes > limit).any():
            if self.oversized == "drop":
                over = sizes > limit
                dropped |= over
                for i in np.flatnonzero(over).tolist():
                    reasons[i] = "oversized"
            elif self.oversized == "truncate":
                keeps = np.minimum(sizes, limit)
        rows: Block | None = None
        row_positions = np.zeros(0, dtype=np.int64)
        placed = np.flatnonzero(~dropped)
        if len(placed):
            state = self._lanes.get(block.lane)
            if state is None:
                state = self._lanes[block.lane] = Lane(self._placer())
            base = state.placer.admitted
            state.segments.append(Segment(base, block, placed, sizes[placed], keeps[placed],
                                           field))
            placement = state.placer.place(np.ascontiguousarray(keeps[placed],
                                                                 dtype=np.int64))
            if placement.rows:
                rows = self._rows(block.lane, state, placement)
                # A row goes out where the document whose placement sent it out was.
                row_positions = placed[placement.row_after - base]
            state.forget()
        if not dropped.any():
            return [] if rows is None else [rows]
        tombs = np.flatnonzero(dropped)
        dead = block.take(tombs).with_tombstones(np.ones(len(tombs), dtype=bool),
                                                 [reasons[i] for i in tombs.tolist()])
        if rows is None:
            return [dead]
        return _interleave(rows, row_positions, dead, tombs)

    def _token_column(self, block: Block) -> str | None:
        """The name of the block's token column when the fast path applies: a ragged
        column of integer ids that int32 rows can hold, and no loss mask."""
        fields = block.fields
        if fields is None or MASK_FIELD in fields:
            return None
        if self.tokens_field == "auto":  # the first present, as the record path takes
            name = next((f for f in AUTO_TOKEN_FIELDS if f in fields), None)
        else:
            name = self.tokens_field if self.tokens_field in fields else None
        column = fields.get(name) if name is not None else None
        if (isinstance(column, Ragged) and column.values.dtype.kind in "iu"
                and np.can_cast(column.values.dtype, np.int32, "same_kind")):
            return name
        return None

    def _measure(self, block: Block, row: int) -> int:
        """The general path for one document: its token count, checked (ids in range too)."""
        payload = block.payload(row)
        ids = block.ids[row].tolist()
        length = checked_length(RowView((ids[0], ids[1], ids[2]), payload), self.tokens_field)
        bad = values_outside(tokens_of(payload, self.tokens_field), 0, self._id_high())
        if bad is not None:
            raise self._id_error((ids[0], ids[1], ids[2]), bad[1], bad[0])
        return length

    # Token ids: a packed row holds ids 0..2**31-1 (pack_flat's rows are int32;
    # pack_sequences keeps each document's own array, so only the low bound applies).
    #: The plan's datasets by id (set by the operator), to name a bad id's file and row.
    datasets: Mapping[int, Any] | None = None

    def _id_high(self) -> int | None:
        return INT32_MAX if self.flat else None

    def _check_column(self, block: Block, field: str) -> None:
        """Every id of a ragged token column in range: a vectorised min/max of its values."""
        column: Ragged = block.fields[field]
        off = column.offsets
        start = int(off[0])
        where = first_outside(column.values[start:int(off[-1])], 0, self._id_high())
        if where is None:
            return
        row = int(np.searchsorted(off, start + where, side="right")) - 1
        ids = block.ids[row].tolist()
        value = int(column.values[start + where])
        raise self._id_error((ids[0], ids[1], ids[2]), value, start + where - int(off[row]))

    def _id_error(self, sample_id: tuple[int, int, int], value: int, position: int
                  ) -> ValueError:
        name = "pack_flat" if self.flat else "pack_sequences"
        where = ""
        dataset = (self.datasets or {}).get(sample_id[0])
        if dataset is not None:
            try:
                where = f" ({dataset.locate(sample_id[1], sample_id[2])})"
            except Exception:  # a location is a courtesy: never hide the real problem
                where = ""
        why = ("no vocabulary has a negative id (and -100 is the labels' ignore index)"
               if value < 0 else "pack_flat rows are int32, and a token id is never wrapped")
        return id_range_error(f"{name}: sample {sample_id}", value, position, 0,
                              self._id_high(), why, where)

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[Any]:
        # Flushing a placer emits every open bin and leaves it fresh: bins (or
        # the window) are the only per-lane state.
        lanes = sorted(self._lanes) if lane_id is None else [lane_id]
        out: list[Block] = []
        for lane in lanes:
            state = self._lanes.get(lane)
            if state is None:
                continue
            placement = state.placer.flush()
            if placement.rows:
                out.append(self._rows(lane, state, placement))
            state.forget()
            if state.held():
                raise RuntimeError(
                    f"packing: lane {lane} still holds {state.held()} documents after its "
                    "open bins were flushed, so they would be lost; this is a bug in "
                    "zephon_torch, please report it"
                )
            del self._lanes[lane]
        if self._record_mode:
            return self._group([r for b in out for r in b.records()])
        return out

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        if lane_id is None:
            return any(state.placer.pending for state in self._lanes.values())
        state = self._lanes.get(lane_id)
        return state is not None and state.placer.pending

    def _placer(self) -> BinPlacer:
        return BinPlacer(self.max_length, algorithm=self.algorithm, num_bins=self.num_bins,
                         min_sequence_length=self.min_sequence_length, window=self.bfd_window)

    def _rows(self, lane: int, state: Lane, placement: Placement) -> Block:
        """The block of the rows that went out; marks the documents they end as done."""
        builder = RowBuilder(flat=self.flat, max_length=self.max_length,
                             tokens_field=self.tokens_field, pad_token_id=self.pad_token_id,
                             emit_positions=self.emit_positions)
        return builder.rows(lane, state, placement)

    # ------------------------------------------------------------------ records

    _record_mode = False

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        """The engine for records: documents placed as blocks of consecutive documents of
        a lane, rows returned assembled; tombstones (and stray sentinels) pass through."""
        self._record_mode = True
        ready: list[Any] = []
        run: list[SampleRecord] = []

        def place() -> None:
            if run:
                for out in self.push_block(Block.from_records(run)):
                    ready.extend(out.records())
                run.clear()

        for elem in elems:
            if not isinstance(elem, SampleRecord):
                raise TypeError(
                    f"packing takes SampleRecord elements, got {type(elem).__name__}; "
                    "place pack_flat/pack_sequences before batch()"
                )
            if elem.meta.is_sentinel:
                place()
                ready.append(elem)
                continue
            if run and run[-1].meta.lane_id != elem.meta.lane_id:
                place()
            run.append(elem)
        place()
        return self._group(ready)

    def _group(self, ready: list[SampleRecord]) -> list[list[Any]]:
        """Cut ready elements into single-lane micro-batches, keeping each lane's order."""
        if not ready:
            return []
        by_lane: dict[int, list[SampleRecord]] = {}
        for elem in ready:
            by_lane.setdefault(elem.meta.lane_id, []).append(elem)
        size = self.microbatch_size
        return [elems[i:i + size] for elems in by_lane.values()
                for i in range(0, len(elems), size)]


def _interleave(rows: Block, row_positions: np.ndarray, dead: Block,
                dead_positions: np.ndarray) -> list[Block]:
    """Rows and tombstones in the order of the input positions they belong to."""
    positions = np.concatenate([row_positions, dead_positions])
    kinds = np.concatenate([np.zeros(len(rows), dtype=bool), np.ones(len(dead), dtype=bool)])
    index = np.concatenate([np.arange(len(rows)), np.arange(len(dead))])
    order = np.argsort(positions, kind="stable")
    kinds, index = kinds[order], index[order]
    out: list[Block] = []
    cut = np.flatnonzero(kinds[1:] != kinds[:-1]) + 1
    for start, stop in zip([0, *cut.tolist()], [*cut.tolist(), len(kinds)]):
        source = dead if kinds[start] else rows
        out.append(source.take(index[start:stop]))
    return out


class PackFlatAccumulator(PackingAccumulator):
    """The accumulator of :class:`PackFlat`: flat rows that record their trailing padding."""

    flat = True


class PackSequencesAccumulator(PackingAccumulator):
    """The accumulator of :class:`PackSequences` (bins hold segments, no padding)."""
