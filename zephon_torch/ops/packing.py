"""Sequence packing: ``pack_flat`` (flat token rows) and ``pack_sequences`` (bins of segments).

Both operators share one bin engine, :class:`PackingAccumulator`. It sees each
lane's documents in stream order, decides which bin every piece of a document
goes into, and emits a closed bin as a lightweight *bin plan*: a record whose
meta is already the packed record's final meta and whose payload lists the
pieces as ``(source payload, start, stop)`` slices. ``process_many`` then does
the array work on the workers (concatenate, pad, positions, loss mask). The
decisions depend only on each lane's sequence of documents, never on time or
on how upstream grouped them into micro-batches. They are made by the
placement kernel of :mod:`zephon_torch.ops._binpack` (compiled C, or its
pure-Python twin where no compiler was available: the same decisions), one
call per lane and ``push_many`` over the documents' token counts.

Placement, for a piece of ``n`` tokens in rows of ``max_length``:

* ``"first_fit"``: the first open bin (in opening order) with room for it;
* ``"best_fit"``: the open bin with the least room that still fits it (ties go
  to the earliest opened);
* ``"wrap"``: one open row; documents are concatenated and cut at row
  boundaries, so a document may continue in the next row (``num_bins`` does
  not apply);
* ``"best_fit_decreasing"``: the lane's documents are held until
  ``bfd_window`` of them have arrived (or a flush sentinel ends the epoch);
  then the window's pieces are sorted longest first (ties in stream order)
  and placed by best fit into as many bins as they need (ties to the earliest
  opened; ``num_bins`` does not apply), and all the window's bins go out
  together, in opening order, as the document that completed the window
  arrives. The packer holds up to ``bfd_window`` documents per lane (their
  payloads, or their shared-memory handles under the process runner).

When a piece fits no open bin it opens a new one; if ``num_bins`` bins are
open already, the fullest goes out first (ties: the earliest opened). A bin
goes out as soon as its room drops below ``min_sequence_length``, and
:meth:`~PackingAccumulator.flush` emits the open bins in opening order. One
refinement: a piece that would leave less than ``min_sequence_length`` of room
even in a fresh bin (a full ``max_length`` piece of a split document, for
instance) goes out at once as its own row instead of pushing a partly filled
bin out early; the output is the same row it would have made, and the open
bins keep filling.

Example: ``first_fit``, ``max_length=8``, ``num_bins=2``, document lengths
``5, 4, 3, 2, 6, 7``::

    doc  len  decision                                   open bins (used)   emitted
    d0   5    no bin open: open A                        A=5
    d1   4    A has room 3: open B                       A=5 B=4
    d2   3    fits A; A is full (room 0 < 1): emit A     B=4                [d0 d2]
    d3   2    fits B                                     B=6
    d4   6    fits nothing; 1 bin open < 2: open C       B=6 C=6
    d5   7    fits nothing; 2 open: emit fullest (B,     C=6 D=7            [d1 d3]+pad 2
              the earliest of the tied), open D
    flush     emit C, D in opening order                                    [d4]+2, [d5]+1

The same lengths need four rows whatever the algorithm (27 tokens). On
``3, 6, 2, 5, 2, 4`` (22 tokens), ``first_fit`` with 2 bins makes four rows
(10 padding tokens) while ``best_fit_decreasing`` with ``bfd_window=6``
sorts the window to ``6 (d1), 5 (d3), 4 (d5), 3 (d0), 2 (d2), 2 (d4)``: d1,
d3 and d5 open A, B and C (room 2, 3, 4); d0 fills B, d2 fills A, d4 goes to
C, the least room that fits: rows ``[d1 d2]``, ``[d3 d0]``, ``[d5 d4]+2``.

Documents longer than ``max_length`` (``oversized``): ``"split"`` cuts them
into pieces of ``max_length`` tokens (the last shorter), each piece being the
child ``meta.child(i)`` of its document; ``"drop"`` turns the document into a
tombstone (reason ``"oversized"``); ``"truncate"`` keeps the first
``max_length`` tokens and counts the discarded tail in the row's packing
metadata (``"truncated_tokens"``). Under ``"wrap"``, a document cut at a row
boundary is split the same way (children in emission order). A document of no
tokens becomes a tombstone (reason ``"empty"``), and tombstones arriving from
upstream pass straight through, in order.

Token ids are checked as documents arrive (one vectorised minimum/maximum
per block of a ragged token column): a negative id is an error in both
packers (no vocabulary has one; ``-100`` is the labels' ignore index), and so
is an id above ``2**31 - 1`` in ``pack_flat``, whose rows are int32. The
error names the value, the sample, its file and row; an id is never wrapped.
``pack_sequences`` keeps each document's own array, so int64 ids stay exact.

Accounting of a packed record: its meta is ``first_piece_meta.child(0)``
(unique, because a piece heads at most one row) with one
:class:`~zephon_torch.types.ContributorRef` per piece. Only the piece that
ends a document closes it (``is_last_child=True``); earlier pieces of a split
document are listed with ``is_last_child=False``. ``component_sample_counts``
counts a document in the row that holds its last piece;
``component_token_counts`` adds up the tokens of every piece in the row, per
component.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from zephon_torch.block import Block, Contributors, Ragged, RowView
from zephon_torch.ops._binpack import (
    BinPlacer,
    Placement,
    copy_runs,
    native_enabled,
    ramps,
)
from zephon_torch.ops.accumulators import Accumulator
from zephon_torch.ops.base import Element, OpContext, Operator, OpTraits
from zephon_torch.token_ids import INT32_MAX, first_outside, id_range_error, values_outside
from zephon_torch.types import SampleRecord
from zephon_torch.vocab import AUTO_TOKEN_FIELDS, LOSS_MASK_FIELD, find_token_field

__all__ = [
    "ALGORITHMS",
    "DEFAULT_BFD_WINDOW",
    "OVERSIZED_MODES",
    "PLAN_KEY",
    "PackFlat",
    "PackFlatAccumulator",
    "PackSequences",
    "PackSequencesAccumulator",
    "PackingAccumulator",
    "assemble_flat_row",
    "assemble_segments",
]

#: Placement algorithms understood by both packers.
ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_decreasing")
#: Documents per ``best_fit_decreasing`` window unless ``bfd_window`` says otherwise.
DEFAULT_BFD_WINDOW = 4096
#: What to do with a document longer than ``max_length``.
OVERSIZED_MODES = ("split", "drop", "truncate")
#: Payload key of a bin plan: the list of ``(payload, start, stop)`` pieces.
PLAN_KEY = "_pack_plan"

# Per-token payload fields cut together with the tokens when a document is split.
_MASK_FIELD = LOSS_MASK_FIELD
_INT32 = np.iinfo(np.int32)


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, low: int, high: int | None, fix: str) -> None:
    bad_type = isinstance(value, bool) or not isinstance(value, (int, np.integer))
    if bad_type or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}; {fix}")


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"unknown {name} {value!r}; use one of {options}")


def _check_common(max_length: Any, num_bins: Any, algorithm: Any, tokens_field: Any,
                  min_sequence_length: Any, oversized: Any, bfd_window: Any) -> None:
    _check_int("max_length", max_length, 1, None,
               "pass the row length in tokens (the model's sequence length + 1 for pack_flat)")
    _check_int("num_bins", num_bins, 1, None, "pass how many bins may be open per lane (e.g. 8)")
    _check_choice("algorithm", algorithm, ALGORITHMS)
    if not isinstance(tokens_field, str) or not tokens_field:
        raise ValueError(
            f"tokens_field must be a field name or 'auto', got {tokens_field!r}"
        )
    _check_int("min_sequence_length", min_sequence_length, 1, max_length,
               "it must lie between 1 and max_length (1 emits a bin only when it is full)")
    _check_choice("oversized", oversized, OVERSIZED_MODES)
    if bfd_window is not None:
        if algorithm != "best_fit_decreasing":
            raise ValueError(
                f"bfd_window={bfd_window!r} applies only to algorithm='best_fit_decreasing', "
                f"not {algorithm!r}; remove it or choose that algorithm"
            )
        _check_int("bfd_window", bfd_window, 1, None,
                   "pass how many documents each best-fit-decreasing window holds (e.g. 4096)")


# --------------------------------------------------------------------------- token access


def _tokens(payload: Any, tokens_field: str) -> Any:
    field = find_token_field(payload, tokens_field)
    return payload if field is None else payload[field]


def _checked_length(record: SampleRecord, tokens_field: str) -> int:
    """Token count of a document, after checking that its tokens form a 1-D id array."""
    payload = record.payload
    try:
        tokens = _tokens(payload, tokens_field)
    except ValueError as exc:
        raise ValueError(f"record {record.meta.sample_id}: {exc}") from None
    if isinstance(tokens, np.ndarray):
        ok = tokens.ndim == 1 and tokens.dtype.kind in "iu"
    elif hasattr(tokens, "detach") and hasattr(tokens, "dim"):  # a torch tensor
        ok = tokens.dim() == 1 and not tokens.is_floating_point()
    else:
        ok = isinstance(tokens, (list, tuple))
    if not ok:
        raise ValueError(
            f"record {record.meta.sample_id}: the tokens must be a 1-D sequence of integer "
            f"ids, got {type(tokens).__name__} {getattr(tokens, 'shape', '')}; tokenize first"
        )
    length = len(tokens)
    mask = payload.get(_MASK_FIELD) if isinstance(payload, dict) else None
    if mask is not None and len(mask) != length:
        raise ValueError(
            f"record {record.meta.sample_id}: {_MASK_FIELD!r} has {len(mask)} entries for "
            f"{length} tokens; it must be aligned with the tokens"
        )
    return length


# --------------------------------------------------------------------------- documents


def _add_tokens(totals: dict[int, int], counts: Mapping[int, int], size: int) -> None:
    """Attribute ``size`` tokens of a document to its components.

    A document of one component (the usual case) gives it all of them; one
    holding several shares them in proportion to its sample counts, the
    rounding remainder going to the lowest component ids so the sum is exact.
    """
    if len(counts) == 1:
        for comp in counts:
            totals[comp] = totals.get(comp, 0) + size
        return
    whole = sum(counts.values())
    if whole <= 0:
        return
    shares = {comp: size * k // whole for comp, k in counts.items()}
    rest = size - sum(shares.values())
    for comp in sorted(shares)[:rest]:
        shares[comp] += 1
    for comp, share in shares.items():
        totals[comp] = totals.get(comp, 0) + share


class _Segment:
    """Documents of one lane that arrived in one block: what their open bins need.

    ``rows`` are the documents' rows in ``block``; document ``base + k`` (the
    placer's sequence number) is row ``rows[k]``, of ``sizes[k]`` tokens of
    which ``keeps[k]`` are packed (fewer under ``oversized="truncate"``).
    """

    __slots__ = ("base", "block", "done", "field", "keeps", "remaining", "rows", "sizes",
                 "tokens")

    def __init__(self, base: int, block: Block, rows: np.ndarray, sizes: np.ndarray,
                 keeps: np.ndarray, field: str | None) -> None:
        self.base = base
        self.block = block
        self.rows = rows
        self.sizes = sizes
        self.keeps = keeps
        # The block's token column when it is a ragged id column (the fast path).
        self.field = field
        self.tokens: Ragged | None = None if field is None else block.fields[field]
        self.done = np.zeros(len(rows), dtype=bool)
        self.remaining = len(rows)

    def compact(self) -> None:
        """Keep only the block rows of documents still open (so one straggler in an
        open bin does not hold its whole arrival block)."""
        keep = np.flatnonzero(~self.done)
        wanted = self.rows[keep]
        block = self.block.take(wanted)
        rows = np.full(len(self.rows), -1, dtype=np.int64)
        rows[keep] = np.arange(len(keep), dtype=np.int64)
        self.block, self.rows = block, rows
        if self.field is not None:
            self.tokens = block.fields[self.field]


class _Lane:
    """One lane's placement state and the documents that its open bins (or window) hold."""

    __slots__ = ("placer", "segments")

    def __init__(self, placer: BinPlacer) -> None:
        self.placer = placer
        self.segments: list[_Segment] = []

    def locate(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Segment index and position within it of documents ``docs``."""
        bases = np.array([seg.base for seg in self.segments], dtype=np.int64)
        where = np.searchsorted(bases, docs, side="right") - 1
        return where, docs - bases[where]

    def forget(self) -> None:
        """Drop the segments whose documents have all gone out; compact stragglers."""
        live = [seg for seg in self.segments if seg.remaining]
        for seg in live[:-1]:  # the newest segment is still filling bins: leave it
            if seg.remaining * 4 < len(seg.rows) and len(seg.block) > seg.remaining:
                seg.compact()
        self.segments = live

    def held(self) -> int:
        return sum(seg.remaining for seg in self.segments)


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
        _check_common(max_length, num_bins, algorithm, tokens_field, min_sequence_length,
                      oversized, bfd_window)
        _check_int("microbatch_size", microbatch_size, 1, None, "pass a positive size")
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
        self._lanes: dict[int, _Lane] = {}

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
                state = self._lanes[block.lane] = _Lane(self._placer())
            base = state.placer.admitted
            state.segments.append(_Segment(base, block, placed, sizes[placed], keeps[placed],
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
        if fields is None or _MASK_FIELD in fields:
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
        length = _checked_length(RowView((ids[0], ids[1], ids[2]), payload), self.tokens_field)
        bad = values_outside(_tokens(payload, self.tokens_field), 0, self._id_high())
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

    # ------------------------------------------------------------------ rows

    def _rows(self, lane: int, state: _Lane, placement: Placement) -> Block:
        """The block of the rows that went out; marks the documents they end as done."""
        pieces = placement.pieces
        docs, starts, stops, childs = pieces[:, 0], pieces[:, 1], pieces[:, 2], pieces[:, 3]
        segs, local = state.locate(docs)
        segments = state.segments
        count = len(docs)
        src_rows = np.empty(count, dtype=np.int64)
        sizes = np.empty(count, dtype=np.int64)
        keeps = np.empty(count, dtype=np.int64)
        doc_ids = np.empty((count, 5), dtype=np.int64)
        for s in np.unique(segs).tolist():
            sel = segs == s
            seg = segments[s]
            at = local[sel]
            src_rows[sel] = seg.rows[at]
            sizes[sel] = seg.sizes[at]
            keeps[sel] = seg.keeps[at]
            doc_ids[sel] = seg.block.ids[seg.rows[at]]
        last = stops == keeps
        whole = last & (starts == 0)
        row_offsets = placement.row_offsets
        used = placement.row_used
        num_rows = len(used)
        firsts = row_offsets[:-1]
        per_row = np.diff(row_offsets)
        row_of = np.repeat(np.arange(num_rows, dtype=np.int64), per_row)
        truncated = np.where(last, sizes - keeps, 0)

        # Lineage of each piece: the document's, plus the child index when it is cut.
        doc_lineage = self._doc_lineage(segments, segs, local)
        if doc_lineage is None and bool(whole.all()):
            piece_lineage: list[tuple[int, ...]] | None = None
        else:
            base = doc_lineage if doc_lineage is not None else [()] * count
            piece_lineage = [lin if w else (*lin, c) for lin, w, c in
                             zip(base, whole.tolist(), childs.tolist())]
        row_lineage = [(0,)] * num_rows if piece_lineage is None else \
            [(*piece_lineage[f], 0) for f in firsts.tolist()]

        contributors = self._contributors(segments, segs, local, doc_ids, piece_lineage, last,
                                          row_of, num_rows)
        counts, token_counts = self._counts(segments, segs, local, last, stops - starts, row_of,
                                            used, num_rows)
        truncated_rows = np.bincount(row_of, weights=truncated, minlength=num_rows)
        packing = self._infos(per_row.tolist(), used.tolist(),
                              truncated_rows.astype(np.int64).tolist())
        payload = self._assemble_rows(segments, segs, src_rows, starts, stops, row_of, used,
                                      num_rows, firsts)
        # Documents whose last piece went out are no longer held.
        for s in np.unique(segs[last]).tolist():
            seg = segments[s]
            at = local[last & (segs == s)]
            seg.done[at] = True
            seg.remaining = int(len(seg.rows) - seg.done.sum())
        ids = doc_ids[firsts]
        return Block(lane, ids, lineage=row_lineage, counts=counts, token_counts=token_counts,
                     contributors=contributors, packing=packing, **payload)

    @staticmethod
    def _doc_lineage(segments: list[_Segment], segs: np.ndarray,
                     local: np.ndarray) -> list[tuple[int, ...]] | None:
        if all(seg.block.lineage is None for seg in segments):
            return None
        out = []
        for s, k in zip(segs.tolist(), local.tolist()):
            seg = segments[s]
            lineage = seg.block.lineage
            out.append(lineage[seg.rows[k]] if lineage is not None else ())
        return out

    @staticmethod
    def _contributors(segments: list[_Segment], segs: np.ndarray, local: np.ndarray,
                      doc_ids: np.ndarray, piece_lineage: list[tuple[int, ...]] | None,
                      last: np.ndarray, row_of: np.ndarray, num_rows: int) -> Contributors:
        """One entry per piece, in row order; a document packed upstream (it lists
        contributors) closes, with its last piece, what its own contributors close."""
        upstream = any(seg.block.contributors is not None for seg in segments)
        if not upstream:
            offsets = np.zeros(num_rows + 1, dtype=np.int64)
            np.cumsum(np.bincount(row_of, minlength=num_rows), out=offsets[1:])
            return Contributors(offsets, doc_ids.copy(), piece_lineage, last.copy())
        ids: list[np.ndarray] = []
        lineage: list[tuple[int, ...]] = []
        flags: list[np.ndarray] = []
        lengths = np.zeros(num_rows, dtype=np.int64)
        for p, (s, k) in enumerate(zip(segs.tolist(), local.tolist())):
            seg = segments[s]
            row = int(seg.rows[k])
            table = seg.block.contributors
            own = None if table is None else table.slice(row, row + 1)
            if last[p] and own is not None and len(own.last):
                ids.append(own.ids)
                lineage.extend(own.lineage if own.lineage is not None else [()] * len(own.last))
                flags.append(own.last)
                lengths[row_of[p]] += len(own.last)
            else:
                ids.append(doc_ids[p:p + 1])
                lineage.append(piece_lineage[p] if piece_lineage is not None else ())
                flags.append(last[p:p + 1])
                lengths[row_of[p]] += 1
        offsets = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Contributors(offsets, np.concatenate(ids), lineage if any(lineage) else None,
                            np.concatenate(flags))

    @staticmethod
    def _counts(segments: list[_Segment], segs: np.ndarray, local: np.ndarray,
                last: np.ndarray, piece_sizes: np.ndarray, row_of: np.ndarray,
                used: np.ndarray, num_rows: int) -> tuple[list[dict[int, int]],
                                                          list[dict[int, int]]]:
        """``component_sample_counts`` and ``component_token_counts`` of every row."""
        components = []
        for seg in segments:
            comp = seg.block.component
            if seg.block.counts is not None or comp is None or not len(comp) \
                    or not bool((comp == comp[0]).all()) or comp[0] < 0:
                components = None
                break
            components.append(int(comp[0]))
        if components is not None and len(set(components)) == 1:
            # The usual case: every document is one sample of the same component.
            c = components[0]
            closed = np.bincount(row_of, weights=last, minlength=num_rows).astype(np.int64)
            return ([{c: k} if k else {} for k in closed.tolist()],
                    [{c: u} for u in used.tolist()])
        counts: list[dict[int, int]] = [{} for _ in range(num_rows)]
        tokens: list[dict[int, int]] = [{} for _ in range(num_rows)]
        for p, (s, k) in enumerate(zip(segs.tolist(), local.tolist())):
            seg = segments[s]
            doc_counts = seg.block._counts_list()[int(seg.rows[k])]
            row = int(row_of[p])
            if last[p]:
                samples = counts[row]
                for comp, n in doc_counts.items():
                    samples[comp] = samples.get(comp, 0) + n
            _add_tokens(tokens[row], doc_counts, int(piece_sizes[p]))
        return counts, tokens

    def _infos(self, segments: list[int], used: list[int],
               truncated: list[int]) -> list[dict[str, int]]:
        """The ``_packing_metadata`` of each row."""
        if self.flat:
            limit = self.max_length
            return [{"num_segments": n, "num_tokens": u, "truncated_tokens": t,
                     "padding_length": limit - u} for n, u, t in zip(segments, used, truncated)]
        return [{"num_segments": n, "num_tokens": u, "truncated_tokens": t}
                for n, u, t in zip(segments, used, truncated)]

    def _assemble_rows(self, segments: list[_Segment], segs: np.ndarray, src_rows: np.ndarray,
                       starts: np.ndarray, stops: np.ndarray, row_of: np.ndarray,
                       used: np.ndarray, num_rows: int, firsts: np.ndarray) -> dict[str, Any]:
        """The rows' payloads: ``fields=`` of flat rows, or ``payloads=`` of segment lists."""
        plans: list[list[tuple[Any, int, int]]] | None = None
        involved = np.unique(segs).tolist()
        if not self.flat or any(segments[s].tokens is None for s in involved):
            plans = [[] for _ in range(num_rows)]
            for p, (s, row) in enumerate(zip(segs.tolist(), src_rows.tolist())):
                plans[int(row_of[p])].append((segments[s].block.payload(row), int(starts[p]),
                                              int(stops[p])))
        if not self.flat:
            tokens_field = self.tokens_field
            return {"payloads": [assemble_segments(plan, tokens_field=tokens_field)
                                 for plan in plans]}  # type: ignore[union-attr]
        limit = self.max_length
        if plans is not None:  # the general path: lists, tensors, loss masks
            built = [assemble_flat_row(plan, limit, tokens_field=self.tokens_field,
                                       pad_token_id=self.pad_token_id,
                                       emit_positions=self.emit_positions) for plan in plans]
            return {"payloads": built}
        lengths = stops - starts
        # Where each piece lands: its row, after the pieces before it in that row.
        before = np.cumsum(lengths) - lengths
        dest = row_of * limit + (before - before[firsts][row_of])
        src = np.empty(len(lengths), dtype=np.int64)
        for s in np.unique(segs).tolist():
            sel = segs == s
            src[sel] = segments[s].tokens.offsets[src_rows[sel]]  # type: ignore[union-attr]
        src += starts
        values_of = {s: segments[s].tokens.values  # type: ignore[union-attr]
                     for s in np.unique(segs).tolist()}
        if native_enabled() and all(v.dtype == np.int32 for v in values_of.values()):
            # The common case: int32 tokens, every piece copied in one kernel call.
            out = np.full(num_rows * limit, self.pad_token_id, dtype=np.int32)
            for s, values in values_of.items():
                sel = segs == s if len(values_of) > 1 else slice(None)
                copy_runs(values, src[sel], dest[sel], lengths[sel], out)
            return {"fields": self._flat_fields(out, dest, lengths, used, num_rows, True)}
        # The rows laid end to end are the pieces in placement order, each row's
        # followed by its padding: one concatenate copies them all (a C-level copy
        # of each document's run, no per-token index).
        padding = np.full(limit, self.pad_token_id, dtype=np.int32)
        pad_after = (np.append(firsts[1:], len(lengths)) - 1).tolist()  # each row's last piece
        pads = (limit - used).tolist()
        parts: list[np.ndarray] = []
        row = 0
        for p, (s, a, n) in enumerate(zip(segs.tolist(), src.tolist(), lengths.tolist())):
            parts.append(values_of[s][a:a + n])
            if p == pad_after[row]:
                if pads[row]:
                    parts.append(padding[:pads[row]])
                row += 1
        out = np.concatenate(parts, dtype=np.int32, casting="same_kind")
        return {"fields": self._flat_fields(out, dest, lengths, used, num_rows, False)}

    def _flat_fields(self, out: np.ndarray, dest: np.ndarray, lengths: np.ndarray,
                     used: np.ndarray, num_rows: int, native: bool) -> dict[str, Any]:
        """``input_ids`` of the rows laid end to end in ``out``, and their ``positions``
        (``dest``, ``lengths``: where each piece starts in ``out`` and its tokens;
        ``used``: each row's tokens; ``native``: the compiled kernel writes them)."""
        limit = self.max_length
        fields: dict[str, Any] = {"input_ids": out.reshape(num_rows, limit)}
        if self.emit_positions and native:
            # One ramp per segment: the pieces, then each row's trailing padding.
            padded = used < limit
            positions = np.empty(num_rows * limit, dtype=np.int32)
            ramps(dest, lengths, positions, native=True)
            ramps(np.flatnonzero(padded) * limit + used[padded], limit - used[padded],
                  positions, native=True)
            fields["positions"] = positions.reshape(num_rows, limit)
        elif self.emit_positions:
            # Each token's distance from the start of its segment (a piece, or the
            # trailing padding): the running maximum of the segment starts.
            size = num_rows * limit
            kind = np.int32 if size < 2**31 else np.int64
            marks = np.zeros(size, dtype=kind)
            marks[dest] = dest
            padded = used < limit
            pad_starts = np.flatnonzero(padded) * limit + used[padded]
            marks[pad_starts] = pad_starts
            np.maximum.accumulate(marks, out=marks)
            positions = np.arange(size, dtype=kind)
            positions -= marks
            fields["positions"] = positions.astype(np.int32, copy=False).reshape(num_rows, limit)
        return fields

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


# --------------------------------------------------------------------------- assembly


def _segment_positions(lengths: Sequence[int], total: int) -> np.ndarray:
    """``0..n-1`` for each segment, laid end to end, without a Python loop over tokens."""
    seg = np.asarray(lengths, dtype=np.int32)
    starts = np.cumsum(seg, dtype=np.int32) - seg
    return np.arange(total, dtype=np.int32) - np.repeat(starts, seg)


def assemble_flat_row(plan: Sequence[tuple[Any, int, int]], max_length: int, *,
                      tokens_field: str = "auto", pad_token_id: int = 0,
                      emit_positions: bool = True) -> dict[str, np.ndarray]:
    """Build one flat ``pack_flat`` row from its bin plan.

    Args:
        plan: ``(payload, start, stop)`` pieces in row order.
        max_length: Row length; what the pieces leave free is padding.
        tokens_field: Payload field holding the tokens, or ``"auto"``.
        pad_token_id: Token id of the trailing padding.
        emit_positions: Also return ``positions``, restarting at 0 for every
            piece and for the padding.

    Returns:
        ``{"input_ids": int32[max_length]}``, plus ``"positions"`` (int32)
        when asked and ``"loss_mask"`` when any piece carries one (pieces
        without one count as fully supervised; padding gets 0).
    """
    lengths = [stop - start for _, start, stop in plan]
    used = sum(lengths)
    row = np.empty(max_length, dtype=np.int32)
    parts = [_tokens(payload, tokens_field)[start:stop] for payload, start, stop in plan]
    np.concatenate(parts, out=row[:used], casting="same_kind")
    row[used:] = pad_token_id
    out = {"input_ids": row}
    if emit_positions:
        pad = max_length - used
        out["positions"] = _segment_positions([*lengths, pad] if pad else lengths, max_length)
    mask = _flat_mask(plan, max_length, used)
    if mask is not None:
        out[_MASK_FIELD] = mask
    return out


def _flat_mask(plan: Sequence[tuple[Any, int, int]], max_length: int,
               used: int) -> np.ndarray | None:
    masks = [payload.get(_MASK_FIELD) if isinstance(payload, dict) else None
             for payload, _, _ in plan]
    present = [np.asarray(m) for m in masks if m is not None]
    if not present:
        return None
    out = np.zeros(max_length, dtype=np.result_type(*present))
    parts = [np.ones(stop - start, dtype=out.dtype) if m is None else m[start:stop]
             for m, (_, start, stop) in zip(masks, plan)]
    np.concatenate(parts, out=out[:used], casting="same_kind")
    return out


def _slice_payload(payload: Any, start: int, stop: int, tokens_field: str) -> Any:
    """A piece of a document's payload: the tokens (and loss mask) cut to ``[start, stop)``."""
    tokens = _tokens(payload, tokens_field)
    if start == 0 and stop == len(tokens):
        return payload  # a whole document travels as the original payload object
    if not isinstance(payload, dict):
        return tokens[start:stop]
    piece = dict(payload)
    piece[find_token_field(payload, tokens_field)] = tokens[start:stop]
    if piece.get(_MASK_FIELD) is not None:
        piece[_MASK_FIELD] = piece[_MASK_FIELD][start:stop]
    return piece


def assemble_segments(plan: Sequence[tuple[Any, int, int]], *,
                      tokens_field: str = "auto") -> dict[str, list[Any]]:
    """Build a ``pack_sequences`` payload, ``{"packed_samples": [...]}``, from its bin plan.

    Whole documents appear as their original payload objects; pieces of a
    split document as a shallow copy whose tokens (and ``loss_mask``) are cut
    to the piece (numpy views, no copies), other fields kept as they are.
    """
    return {"packed_samples": [_slice_payload(payload, start, stop, tokens_field)
                               for payload, start, stop in plan]}


# --------------------------------------------------------------------------- operators


class _PackOperator(Operator):
    """What both packers share: validation, the accumulator, traits and config."""

    # Rows per micro-batch of push_many (the record path); the output does not
    # depend on how ready rows are grouped.
    default_microbatch_size: ClassVar[int] = 64
    _accumulator_type: ClassVar[type[PackingAccumulator]] = PackingAccumulator

    def __init__(self, max_length: int, *, num_bins: int, algorithm: str, tokens_field: str,
                 min_sequence_length: int, oversized: str, bfd_window: int | None) -> None:
        _check_common(max_length, num_bins, algorithm, tokens_field, min_sequence_length,
                      oversized, bfd_window)
        self.max_length = int(max_length)
        self.num_bins = int(num_bins)
        self.algorithm = algorithm
        self.tokens_field = tokens_field
        self.min_sequence_length = int(min_sequence_length)
        self.oversized = oversized
        self.bfd_window = None if bfd_window is None else int(bfd_window)

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> PackingAccumulator:
        """A fresh per-lane bin engine (it never uses the clock, so ``deterministic`` is moot)."""
        acc = self._accumulator_type(
            self.max_length, num_bins=self.num_bins, algorithm=self.algorithm,
            min_sequence_length=self.min_sequence_length, oversized=self.oversized,
            tokens_field=self.tokens_field,
            microbatch_size=ctx.microbatch_size or self.default_microbatch_size,
            bfd_window=self.bfd_window,
        )
        datasets = ctx.plan.get("datasets") if ctx.plan else None
        acc.datasets = dict(datasets) if isinstance(datasets, Mapping) else None
        return acc

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """The accumulator emits assembled rows: nothing is left to do here."""
        return list(elems)

    def process_block(self, block: Block) -> Block:
        """The accumulator emits assembled rows: nothing is left to do here."""
        return block

    def traits(self) -> OpTraits:
        """Packing reorders (rows close out of cursor order) and fans out (split pieces).

        Its accumulator places and assembles the rows, so ``process_many`` has
        nothing left to do and runs on the driver thread (``inline``).
        """
        return OpTraits(preserves_cursor_order=False, fan_out=True, inline=True)

    def config(self) -> dict[str, Any]:
        """Every parameter that shapes the output (``bfd_window`` only where it does)."""
        config = {
            **super().config(), "max_length": self.max_length, "num_bins": self.num_bins,
            "algorithm": self.algorithm, "tokens_field": self.tokens_field,
            "min_sequence_length": self.min_sequence_length, "oversized": self.oversized,
        }
        if self.algorithm == "best_fit_decreasing":
            config["bfd_window"] = self.bfd_window or DEFAULT_BFD_WINDOW
        return config


class PackFlat(_PackOperator):
    """Pack token documents into flat rows of exactly ``max_length`` tokens.

    Each output payload is ``{"input_ids": int32[max_length]}`` plus
    ``"positions"`` (int32, restarting at 0 for every segment, the trailing
    padding being a segment of its own) when ``emit_positions`` and
    ``"loss_mask"`` (0 on padding) when the inputs carry one. The record's
    ``tags["_packing_metadata"]`` holds ``padding_length``, ``num_segments``,
    ``num_tokens`` and ``truncated_tokens``. See the module docstring for the
    placement rules and the accounting.

    Args:
        max_length: Row length; use the model's sequence length + 1, since
            labels shift by one.
        num_bins: Bins that may be open per lane (ignored by ``"wrap"`` and
            ``"best_fit_decreasing"``).
        algorithm: ``"first_fit"``, ``"best_fit"``, ``"wrap"`` or
            ``"best_fit_decreasing"`` (see the module docstring).
        tokens_field: Payload field holding the token ids, or ``"auto"``
            (``input_ids``, ``tokens``, ``token_ids``, ``ids``, in that
            order); a payload may also be a bare 1-D array.
        pad_token_id: Token id written into the trailing padding.
        emit_positions: Emit the per-segment ``positions`` field.
        min_sequence_length: A bin whose room drops below this is emitted.
        oversized: ``"split"``, ``"drop"`` or ``"truncate"`` for documents
            longer than ``max_length``.
        bfd_window: Documents per ``"best_fit_decreasing"`` window (default
            4096; a flush sentinel also ends a window). Only for that
            algorithm: the packer holds the window's documents.

    Raises:
        ValueError: A parameter out of range or an unknown mode; while
            running, a token id outside ``0..2**31 - 1`` (never wrapped).
    """

    name: ClassVar[str] = "pack_flat"
    _accumulator_type: ClassVar[type[PackingAccumulator]] = PackFlatAccumulator

    def __init__(self, max_length: int, *, num_bins: int = 8, algorithm: str = "first_fit",
                 tokens_field: str = "auto", pad_token_id: int = 0, emit_positions: bool = True,
                 min_sequence_length: int = 1, oversized: str = "split",
                 bfd_window: int | None = None) -> None:
        super().__init__(max_length, num_bins=num_bins, algorithm=algorithm,
                         tokens_field=tokens_field, min_sequence_length=min_sequence_length,
                         oversized=oversized, bfd_window=bfd_window)
        _check_int("pad_token_id", pad_token_id, _INT32.min, _INT32.max,
                   "pass your tokenizer's pad id (rows are int32)")
        if not isinstance(emit_positions, bool):
            raise ValueError(f"emit_positions must be True or False, got {emit_positions!r}")
        self.pad_token_id = int(pad_token_id)
        self.emit_positions = emit_positions

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> PackingAccumulator:
        """A fresh per-lane bin engine that assembles flat rows."""
        acc = super().accumulator(deterministic=deterministic, ctx=ctx)
        acc.pad_token_id = self.pad_token_id
        acc.emit_positions = self.emit_positions
        return acc

    def config(self) -> dict[str, Any]:
        """Every parameter that shapes the output."""
        return {**super().config(), "pad_token_id": self.pad_token_id,
                "emit_positions": self.emit_positions}


class PackSequences(_PackOperator):
    """Pack documents into bins of at most ``max_length`` tokens, kept as separate segments.

    Each output payload is ``{"packed_samples": [segment payloads...]}`` in the
    order the segments entered the bin: whole documents as their original
    payload objects, pieces of a split document as shallow copies with the
    tokens (and ``loss_mask``) cut to the piece. ``tags["_packing_metadata"]``
    holds ``num_segments``, ``num_tokens`` and ``truncated_tokens`` (no
    ``padding_length``: nothing is padded). Placement and accounting are those
    of :class:`PackFlat` (see the module docstring).

    Args:
        max_length: Most tokens per bin.
        num_bins: Bins that may be open per lane (ignored by ``"wrap"`` and
            ``"best_fit_decreasing"``).
        algorithm: ``"first_fit"``, ``"best_fit"``, ``"wrap"`` (documents
            cut at bin boundaries, as pieces) or ``"best_fit_decreasing"``.
        tokens_field: Payload field holding the token ids, or ``"auto"``.
        min_sequence_length: A bin whose room drops below this is emitted.
        oversized: ``"split"`` (default), ``"drop"`` or ``"truncate"``.
        bfd_window: Documents per ``"best_fit_decreasing"`` window (default
            4096); only for that algorithm.

    Raises:
        ValueError: A parameter out of range or an unknown mode; while
            running, a negative token id.
    """

    name: ClassVar[str] = "pack_sequences"
    _accumulator_type: ClassVar[type[PackingAccumulator]] = PackSequencesAccumulator

    def __init__(self, max_length: int, *, num_bins: int = 8, algorithm: str = "first_fit",
                 tokens_field: str = "auto", min_sequence_length: int = 1,
                 oversized: str = "split", bfd_window: int | None = None) -> None:
        super().__init__(max_length, num_bins=num_bins, algorithm=algorithm,
                         tokens_field=tokens_field, min_sequence_length=min_sequence_length,
                         oversized=oversized, bfd_window=bfd_window)

