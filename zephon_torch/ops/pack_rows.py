"""Packed rows out of a placement: the documents open bins hold, and the rows they make.

The placement kernel (:mod:`zephon_torch.ops._binpack`) answers with pieces
``(document, start, stop, child)`` grouped into rows; it knows nothing of the
documents themselves. A lane's :class:`Lane` keeps the documents its open
bins (or its best-fit-decreasing window) still hold, as :class:`Segment`
runs of the blocks they arrived in, and :class:`RowBuilder` turns the pieces
of the rows that went out into one block: the rows' ids and lineage (a row
is named by its first piece), their contributors as a table, the component
counts, the ``_packing_metadata``, and the payloads. Flat rows are gathered
from the documents' ragged token column into one ``(rows, max_length)``
array (one kernel call, or one ``concatenate``), with positions from the
pieces' offsets; segment lists, loss masks and other payloads go through the
row plans (:func:`assemble_flat_row`, :func:`assemble_segments`).

Example: pieces ``(d0, 0, 5), (d2, 0, 3)`` in a row of ``max_length=8`` give
``input_ids`` of d0's 5 tokens, d2's 3, and ``positions``
``0 1 2 3 4 0 1 2``; both documents close in that row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.block import Block
from zephon_torch.block_columns import Ragged
from zephon_torch.block_ids import Contributors
from zephon_torch.ops._binpack import BinPlacer, Placement, copy_runs, native_enabled, ramps
from zephon_torch.ops.pack_options import MASK_FIELD, tokens_of
from zephon_torch.vocab import find_token_field

__all__ = ["Lane", "RowBuilder", "Segment", "assemble_flat_row", "assemble_segments"]


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


class Segment:
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


class Lane:
    """One lane's placement state and the documents that its open bins (or window) hold."""

    __slots__ = ("placer", "segments")

    def __init__(self, placer: BinPlacer) -> None:
        self.placer = placer
        self.segments: list[Segment] = []

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
        """Documents of the lane not yet out (their last piece not emitted)."""
        return sum(seg.remaining for seg in self.segments)


# --------------------------------------------------------------------------- rows


class RowBuilder:
    """Builds the block of the rows that went out of one placement.

    Args:
        flat: Flat token rows (``pack_flat``) rather than segment lists.
        max_length: Tokens per row.
        tokens_field: Payload field holding the tokens, or ``"auto"``.
        pad_token_id: Token id of the trailing padding (flat rows).
        emit_positions: Emit per-segment ``positions`` (flat rows).
    """

    __slots__ = ("emit_positions", "flat", "max_length", "pad_token_id", "tokens_field")

    def __init__(self, *, flat: bool, max_length: int, tokens_field: str, pad_token_id: int,
                 emit_positions: bool) -> None:
        self.flat = flat
        self.max_length = max_length
        self.tokens_field = tokens_field
        self.pad_token_id = pad_token_id
        self.emit_positions = emit_positions

    def rows(self, lane: int, state: Lane, placement: Placement) -> Block:
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
    def _doc_lineage(segments: list[Segment], segs: np.ndarray,
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
    def _contributors(segments: list[Segment], segs: np.ndarray, local: np.ndarray,
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
    def _counts(segments: list[Segment], segs: np.ndarray, local: np.ndarray,
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

    def _assemble_rows(self, segments: list[Segment], segs: np.ndarray, src_rows: np.ndarray,
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
    parts = [tokens_of(payload, tokens_field)[start:stop] for payload, start, stop in plan]
    np.concatenate(parts, out=row[:used], casting="same_kind")
    row[used:] = pad_token_id
    out = {"input_ids": row}
    if emit_positions:
        pad = max_length - used
        out["positions"] = _segment_positions([*lengths, pad] if pad else lengths, max_length)
    mask = _flat_mask(plan, max_length, used)
    if mask is not None:
        out[MASK_FIELD] = mask
    return out


def _flat_mask(plan: Sequence[tuple[Any, int, int]], max_length: int,
               used: int) -> np.ndarray | None:
    masks = [payload.get(MASK_FIELD) if isinstance(payload, dict) else None
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
    tokens = tokens_of(payload, tokens_field)
    if start == 0 and stop == len(tokens):
        return payload  # a whole document travels as the original payload object
    if not isinstance(payload, dict):
        return tokens[start:stop]
    piece = dict(payload)
    piece[find_token_field(payload, tokens_field)] = tokens[start:stop]
    if piece.get(MASK_FIELD) is not None:
        piece[MASK_FIELD] = piece[MASK_FIELD][start:stop]
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
