"""Sequence packing: ``pack_flat`` (flat token rows) and ``pack_sequences`` (bins of segments).

Both operators share one bin engine,
:class:`~zephon_torch.ops.pack_engine.PackingAccumulator`. It sees each
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
goes out as soon as its room drops below ``min_sequence_length``, and a
flush (:meth:`~zephon_torch.ops.pack_engine.PackingAccumulator.flush`)
emits the open bins in opening order. One refinement: a piece that would
leave less than ``min_sequence_length`` of room even in a fresh bin (a full
``max_length`` piece of a split document, for instance) goes out at once as
its own row instead of pushing a partly filled bin out early; the output is
the same row it would have made, and the open bins keep filling.

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

from zephon_torch.block import Block
from zephon_torch.ops.base import Element, OpContext, Operator, OpTraits
from zephon_torch.ops.pack_engine import (
    PackFlatAccumulator,
    PackingAccumulator,
    PackSequencesAccumulator,
)
from zephon_torch.ops.pack_options import (
    ALGORITHMS,
    DEFAULT_BFD_WINDOW,
    OVERSIZED_MODES,
    PLAN_KEY,
    check_common,
    check_int,
)
from zephon_torch.ops.pack_rows import assemble_flat_row, assemble_segments

# The operators are defined here; the other names are documented with this module (the
# API reference) and live beside it: the engine in pack_engine, the row assembly in
# pack_rows, the parameters in pack_options.
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

_INT32 = np.iinfo(np.int32)


# --------------------------------------------------------------------------- operators


class _PackOperator(Operator):
    """What both packers share: validation, the accumulator, traits and config."""

    # Rows per micro-batch of push_many (the record path); the output does not
    # depend on how ready rows are grouped.
    default_microbatch_size: ClassVar[int] = 64
    _accumulator_type: ClassVar[type[PackingAccumulator]] = PackingAccumulator

    def __init__(self, max_length: int, *, num_bins: int, algorithm: str, tokens_field: str,
                 min_sequence_length: int, oversized: str, bfd_window: int | None) -> None:
        check_common(max_length, num_bins, algorithm, tokens_field, min_sequence_length,
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
        check_int("pad_token_id", pad_token_id, _INT32.min, _INT32.max,
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
