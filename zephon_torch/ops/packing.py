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
from typing import Any, ClassVar, NamedTuple

import numpy as np

from zephon_torch._training import AUTO_TOKEN_FIELDS
from zephon_torch.ops._binpack import BinPlacer, Placement
from zephon_torch.ops.accumulators import Accumulator
from zephon_torch.ops.base import Element, OpContext, Operator, OpTraits, tombstone
from zephon_torch.runners.shm import LazyPayload
from zephon_torch.types import (
    CONTRIBUTORS_TAG,
    FLUSH_SENTINEL_TAG,
    PACKING_METADATA_TAG,
    TOMBSTONE_TAG,
    ContributorRef,
    SampleCursor,
    SampleMeta,
    SampleRecord,
)

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
_MASK_FIELD = "loss_mask"
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


def _token_field(payload: Any, tokens_field: str) -> str | None:
    """The dict key holding the tokens, or None when the payload is the array itself."""
    if not isinstance(payload, dict):
        return None
    if tokens_field != "auto":
        if tokens_field not in payload:
            raise ValueError(
                f"payload has no token field {tokens_field!r} (its fields: {sorted(payload)}); "
                "set tokens_field= to the field holding the token ids"
            )
        return tokens_field
    for name in AUTO_TOKEN_FIELDS:
        if name in payload:
            return name
    raise ValueError(
        f"cannot detect the token field: the payload fields are {sorted(payload)}, none of "
        f"{list(AUTO_TOKEN_FIELDS)}; tokenize first or pass tokens_field= explicitly"
    )


def _tokens(payload: Any, tokens_field: str) -> Any:
    field = _token_field(payload, tokens_field)
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


def _described_length(info: dict[str, int] | None, tokens_field: str) -> int | None:
    """The token count of a payload known only by its :func:`~zephon_torch.runners.shm.describe`
    (field -> length of a 1-D integer array, -1 for anything else), when that is
    enough to know it passes :func:`_checked_length`; else None (read the payload)."""
    if info is None:
        return None
    if tokens_field == "auto":
        tokens_field = next((name for name in AUTO_TOKEN_FIELDS if name in info), "")
    length = info.get(tokens_field, -1)
    if length < 0 or info.get(_MASK_FIELD, length) != length:
        return None
    return length


# --------------------------------------------------------------------------- bins


class _Piece(NamedTuple):
    """A contiguous run ``[start, stop)`` of one document's tokens, placed in one bin."""

    payload: Any
    start: int
    stop: int
    meta: SampleMeta  # the document's meta, or its child(i) when it is split
    doc: SampleMeta  # the document's own meta
    last: bool  # this piece ends the document, so it closes it
    truncated: int  # tokens discarded from the document (oversized="truncate")

    @property
    def size(self) -> int:
        return self.stop - self.start


# Builds a _Piece from a tuple of its fields without the generated __new__'s
# argument parsing: pieces are made once per document on the packer's hot path.
_new_piece = tuple.__new__


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


def _packed_meta(pieces: Sequence[_Piece], info: dict[str, int]) -> SampleMeta:
    """The meta of a packed record: its first piece's meta made a child, plus accounting.

    A piece that ends a document closes it, unless the document already lists
    contributors (it was packed upstream): then it closes what they close. An
    earlier piece of a split document is listed without closing anything. The
    token split of :func:`_add_tokens` is written out for the common document
    of one component, since this runs once per piece.
    """
    refs: list[ContributorRef] = []
    samples: dict[int, int] = {}
    tokens: dict[int, int] = {}
    for piece in pieces:
        doc, meta = piece.doc, piece.meta
        counts = doc.component_sample_counts
        cursor = SampleCursor(meta.chunk_id, meta.chunk_offset, meta.sample_id, meta.lineage)
        if piece.last:
            # A document that already lists contributors (packed upstream)
            # closes what they close; otherwise its last piece closes itself.
            upstream = doc.tags.get(CONTRIBUTORS_TAG) if doc.tags else None
            if upstream:
                refs.extend(upstream)
            else:
                refs.append(ContributorRef(cursor, True))
            for comp, count in counts.items():
                samples[comp] = samples.get(comp, 0) + count
        else:
            refs.append(ContributorRef(cursor, False))
        if len(counts) == 1:
            for comp in counts:
                tokens[comp] = tokens.get(comp, 0) + piece.stop - piece.start
        else:
            _add_tokens(tokens, counts, piece.stop - piece.start)
    first = pieces[0].meta
    # Fresh tags: a row holding many documents should not inherit one document's tags.
    tags = {CONTRIBUTORS_TAG: tuple(refs), PACKING_METADATA_TAG: info}
    return SampleMeta(first.sample_id, first.lane_id, first.chunk_id, first.chunk_offset,
                      samples, tokens, (*first.lineage, 0), tags)


# --------------------------------------------------------------------------- accumulators


class _Lane:
    """One lane's placement state and the documents that its open bins (or window) hold."""

    __slots__ = ("docs", "placer")

    def __init__(self, placer: BinPlacer) -> None:
        self.placer = placer
        # sequence number (the placer's) -> (record, token count, tokens kept)
        self.docs: dict[int, tuple[SampleRecord, int, int]] = {}


class PackingAccumulator(Accumulator):
    """The bin engine shared by both packers: per-lane bins, decided in stream order.

    ``push_many`` returns micro-batches (one lane each, at most
    ``microbatch_size`` elements) of bin plans and pass-through tombstones, in
    the order they became ready; nothing ready is held back, so
    ``has_pending_data(lane)`` is true exactly when the lane has open bins (or,
    for ``best_fit_decreasing``, a partial window). Control records reaching
    ``push_many`` (tombstones, or a flush sentinel should a runner forward one)
    pass through in place without touching any bin; flushing is the runner's
    call to :meth:`flush`.

    The decisions are made by :class:`~zephon_torch.ops._binpack.BinPlacer`,
    one per lane: each ``push_many`` hands a lane's documents to it as one
    array of token counts, and turns the rows that went out into bin plans.

    Args:
        max_length: Tokens per row.
        num_bins: Bins that may be open per lane (``first_fit``/``best_fit``).
        algorithm: One of :data:`ALGORITHMS`.
        min_sequence_length: A bin whose room drops below this goes out.
        oversized: ``"split"``, ``"drop"`` or ``"truncate"``.
        tokens_field: Payload field holding the tokens, or ``"auto"``.
        microbatch_size: Most elements per emitted micro-batch.
        bfd_window: Documents per ``best_fit_decreasing`` window (default
            :data:`DEFAULT_BFD_WINDOW`); only for that algorithm.
    """

    reads_payload = True  # placement needs each document's token count
    # Under the process runner a tokenized document may still be a handle to
    # the worker's shared memory: the worker recorded its fields' lengths
    # (LazyPayload.info), which is all placement needs, and the bin plan lists
    # the handle, so the document's tokens go from the worker that made them
    # to the worker that assembles the row without this process reading them.
    takes_handles = True

    def __init__(self, max_length: int, *, num_bins: int = 8, algorithm: str = "first_fit",
                 min_sequence_length: int = 1, oversized: str = "split",
                 tokens_field: str = "auto", microbatch_size: int = 64,
                 bfd_window: int | None = None) -> None:
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
        self._lanes: dict[int, _Lane] = {}

    # ------------------------------------------------------------------ contract

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        # What goes out at each position of the input: the element itself (a
        # control record, or a document turned into a tombstone), or the rows
        # that the document placed there sent out. Rows are known only once
        # each lane's documents have been placed (one call per lane), so they
        # are slotted in by the document that sent them out.
        out: list[Any] = [None] * len(elems)
        # lane -> (positions, (record, token count, tokens kept), tokens kept)
        runs: dict[int, tuple[list[int], list[tuple[SampleRecord, int, int]], list[int]]] = {}
        field = AUTO_TOKEN_FIELDS[0] if self.tokens_field == "auto" else self.tokens_field
        limit = self.max_length
        drop, truncate = self.oversized == "drop", self.oversized == "truncate"
        for position, elem in enumerate(elems):
            # The common document (a dict whose token field is a 1-D integer
            # array, no loss mask, or a handle described so) is measured here
            # without the general path's checks; both give the same length.
            payload = elem.payload if type(elem) is SampleRecord else None
            kind = type(payload)
            size = 0
            if kind is dict:
                tokens = payload.get(field)
                if (type(tokens) is np.ndarray and tokens.ndim == 1
                        and tokens.dtype.kind in "iu" and _MASK_FIELD not in payload):
                    size = tokens.shape[0]
            elif kind is LazyPayload:
                info = payload.info  # the worker's describe(): -1 for a non-id-array field
                if info is not None and _MASK_FIELD not in info:
                    size = info.get(field, 0)
            meta = elem.meta if size > 0 else None
            if meta is None or ((tags := meta.tags)
                                and (tags.get(TOMBSTONE_TAG) or tags.get(FLUSH_SENTINEL_TAG))):
                elem, size = self._measure(elem)
                if not size:  # passes on as it is (a control record, an empty document)
                    out[position] = elem
                    continue
                meta = elem.meta
            keep = size
            if size > limit:
                if drop:
                    out[position] = tombstone(elem, "oversized")
                    continue
                if truncate:
                    keep = limit
            run = runs.get(meta.lane_id)
            if run is None:
                run = runs[meta.lane_id] = ([], [], [])
            run[0].append(position)
            run[1].append((elem, size, keep))
            run[2].append(keep)
        for lane_id, run in runs.items():
            self._place_run(lane_id, run, out)
        ready: list[Any] = []
        for item in out:
            if type(item) is list:
                ready.extend(item)
            elif item is not None:
                ready.append(item)
        return self._group(ready)

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        # Flushing a placer emits every open bin and leaves it fresh: bins (or
        # the window) are the only per-lane state.
        lanes = sorted(self._lanes) if lane_id is None else [lane_id]
        ready: list[SampleRecord] = []
        for lane in lanes:
            state = self._lanes.get(lane)
            if state is None:
                continue
            ready.extend(self._rows(state.placer.flush(), state.docs))
            if state.docs:
                raise RuntimeError(
                    f"packing: lane {lane} still holds {len(state.docs)} documents after its "
                    "open bins were flushed, so they would be lost; this is a bug in "
                    "zephon_torch, please report it"
                )
        return self._group(ready)

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        if lane_id is None:
            return any(state.placer.pending for state in self._lanes.values())
        state = self._lanes.get(lane_id)
        return state is not None and state.placer.pending

    # ------------------------------------------------------------------ placement

    def _measure(self, elem: Any) -> tuple[Any, int]:
        """The general path: ``(element, token count)``, checked; a count of 0 means the
        element passes on as it is (a control record, or the tombstone of an empty one)."""
        if not isinstance(elem, SampleRecord):
            raise TypeError(
                f"packing takes SampleRecord elements, got {type(elem).__name__}; "
                "place pack_flat/pack_sequences before batch()"
            )
        if elem.meta.is_sentinel:  # tombstones (and stray sentinels) go straight on
            return elem, 0
        length = None
        if type(elem.payload) is LazyPayload:
            length = _described_length(elem.payload.info, self.tokens_field)
            if length is None:  # not enough known about it: read it
                elem = SampleRecord(elem.meta, elem.payload.load())
        if length is None:
            length = _checked_length(elem, self.tokens_field)
        if length == 0:
            return tombstone(elem, "empty"), 0
        return elem, length

    def _placer(self) -> BinPlacer:
        return BinPlacer(self.max_length, algorithm=self.algorithm, num_bins=self.num_bins,
                         min_sequence_length=self.min_sequence_length, window=self.bfd_window)

    def _place_run(self, lane_id: int,
                   run: tuple[list[int], list[tuple[SampleRecord, int, int]], list[int]],
                   out: list[Any]) -> None:
        """Place one lane's documents of this push in one call; slot the rows into ``out``."""
        state = self._lanes.get(lane_id)
        if state is None:
            state = self._lanes[lane_id] = _Lane(self._placer())
        positions, entries, keeps = run
        base, docs = state.placer.admitted, state.docs
        docs.update(zip(range(base, base + len(entries)), entries))
        placement = state.placer.place(np.array(keeps, dtype=np.int64))
        if not placement.rows:
            return
        rows = self._rows(placement, docs)
        for after, row in zip(placement.row_after.tolist(), rows):
            position = positions[after - base]
            slot = out[position]
            if slot is None:
                out[position] = [row]
            else:
                slot.append(row)

    def _rows(self, placement: Placement, docs: dict[int, tuple[SampleRecord, int, int]],
              ) -> list[SampleRecord]:
        """The bin plan records of the rows that went out; forgets the documents they end."""
        if not placement.rows:
            return []
        flat = iter(placement.pieces.ravel().tolist())
        quads = list(zip(flat, flat, flat, flat))
        offsets = placement.row_offsets.tolist()
        done = []
        records = []
        for row, used in enumerate(placement.row_used.tolist()):
            pieces = []
            for doc, start, stop, child in quads[offsets[row]:offsets[row + 1]]:
                record, size, keep = docs[doc]
                meta = record.meta
                if stop == keep:  # the piece that ends the document closes it
                    done.append(doc)
                    piece = (record.payload, start, stop, meta if start == 0 else meta.child(child),
                             meta, True, size - keep)
                else:
                    piece = (record.payload, start, stop, meta.child(child), meta, False, 0)
                pieces.append(_new_piece(_Piece, piece))
            records.append(self._close_pieces(pieces, used))
        for doc in done:
            del docs[doc]
        return records

    # ------------------------------------------------------------------ emission

    def _row_info(self, used: int, pieces: Sequence[_Piece]) -> dict[str, int]:
        """The ``_packing_metadata`` of a closed bin."""
        return {"num_segments": len(pieces), "num_tokens": used,
                "truncated_tokens": sum(p.truncated for p in pieces)}

    def _close_pieces(self, pieces: list[_Piece], used: int) -> SampleRecord:
        """The bin plan record of the pieces of one row, ``used`` tokens in all."""
        meta = _packed_meta(pieces, self._row_info(used, pieces))
        plan = [(p.payload, p.start, p.stop) for p in pieces]
        return SampleRecord(meta, {PLAN_KEY: plan, "max_length": self.max_length})

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


class PackFlatAccumulator(PackingAccumulator):
    """The accumulator of :class:`PackFlat`: rows also record their trailing padding."""

    def _row_info(self, used: int, pieces: Sequence[_Piece]) -> dict[str, int]:
        info = super()._row_info(used, pieces)
        info["padding_length"] = self.max_length - used
        return info


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
    piece[_token_field(payload, tokens_field)] = tokens[start:stop]
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


def _loaded(plan: dict[str, Any]) -> dict[str, Any]:
    """A bin plan whose pieces are real payloads. A worker receives them so; a plan
    assembled in the process that placed it may still list shared-memory handles."""
    pieces = plan[PLAN_KEY]
    if not any(type(payload) is LazyPayload for payload, _, _ in pieces):
        return plan
    return {**plan, PLAN_KEY: [(payload.load() if type(payload) is LazyPayload else payload,
                                start, stop) for payload, start, stop in pieces]}


def _is_plan(elem: Any) -> bool:
    return (type(elem) is SampleRecord and type(elem.payload) is dict
            and PLAN_KEY in elem.payload)


# --------------------------------------------------------------------------- operators


class _PackOperator(Operator):
    """What both packers share: validation, the accumulator, traits and config."""

    # Rows per assembly task: each is a round trip to a worker under the process
    # runner, and the output does not depend on how ready rows are grouped.
    default_microbatch_size: ClassVar[int] = 64
    nested_handles: ClassVar[bool] = True  # bin plans may list shared-memory handles
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
        return self._accumulator_type(
            self.max_length, num_bins=self.num_bins, algorithm=self.algorithm,
            min_sequence_length=self.min_sequence_length, oversized=self.oversized,
            tokens_field=self.tokens_field,
            microbatch_size=ctx.microbatch_size or self.default_microbatch_size,
            bfd_window=self.bfd_window,
        )

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Assemble every bin plan into its packed record; pass tombstones through."""
        return [SampleRecord(e.meta, self._assemble(_loaded(e.payload))) if _is_plan(e) else e
                for e in elems]

    def _assemble(self, plan: dict[str, Any]) -> Any:
        raise NotImplementedError

    def traits(self) -> OpTraits:
        """Packing reorders (rows close out of cursor order) and fans out (split pieces)."""
        return OpTraits(preserves_cursor_order=False, fan_out=True)

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
        ValueError: A parameter out of range or an unknown mode.
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

    def _assemble(self, plan: dict[str, Any]) -> dict[str, np.ndarray]:
        return assemble_flat_row(plan[PLAN_KEY], plan["max_length"],
                                 tokens_field=self.tokens_field,
                                 pad_token_id=self.pad_token_id,
                                 emit_positions=self.emit_positions)

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
        ValueError: A parameter out of range or an unknown mode.
    """

    name: ClassVar[str] = "pack_sequences"
    _accumulator_type: ClassVar[type[PackingAccumulator]] = PackSequencesAccumulator

    def __init__(self, max_length: int, *, num_bins: int = 8, algorithm: str = "first_fit",
                 tokens_field: str = "auto", min_sequence_length: int = 1,
                 oversized: str = "split", bfd_window: int | None = None) -> None:
        super().__init__(max_length, num_bins=num_bins, algorithm=algorithm,
                         tokens_field=tokens_field, min_sequence_length=min_sequence_length,
                         oversized=oversized, bfd_window=bfd_window)

    def _assemble(self, plan: dict[str, Any]) -> dict[str, list[Any]]:
        return assemble_segments(plan[PLAN_KEY], tokens_field=self.tokens_field)
