"""``to_training(return_piece_ids=True)``: every piece of every row, named.

``ids`` names one sample per row: for a packed row, its first piece. A row of
``pack_flat`` holds several pieces (whole documents, or pieces of a split
one), and its meta lists them as contributors, in row order, one per piece.
This module turns that list into what a training loop can log or check: for
each row, a list of ``(dataset, shard, local, start, stop)`` tuples, the
piece's sample id and its tokens' span ``row[start:stop]`` in the row (the
whole row, before the label shift; trailing padding is in no piece).

Spans come from the row's ``positions`` (``pack_flat`` writes them by
default): a piece starts where they restart at 0. A row of one piece (an
unpacked record, or a packed row that holds one) needs none. Nothing here
runs unless the option is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon_torch.vocab import PACKING_METADATA_TAG, find_token_field

__all__ = ["PIECE_IDS", "piece_ids"]

#: The output key.
PIECE_IDS = "piece_ids"

Piece = tuple[int, int, int, int, int]


def piece_ids(rows: Sequence[Any], tokens_field: str) -> list[list[Piece]]:
    """The pieces of every row of a batch (``rows``: what ``to_training`` reads).

    Raises:
        ValueError: A row of several pieces without positions, or whose
            positions start another number of segments than it has pieces
            (a row packed twice, positions rewritten).
    """
    block = getattr(rows, "_block", None)
    table = None if block is None else block.contributors
    out: list[list[Piece]] = []
    for i, row in enumerate(rows):
        sample_id = tuple(row.meta.sample_id)
        if block is not None:
            refs = [] if table is None else [
                tuple(v) for v in table.ids[int(table.offsets[i]):int(table.offsets[i + 1]), :3]
                .tolist()]
        else:
            refs = [tuple(ref.cursor.sample_id) for ref in row.meta.contributors]
        out.append(_row_pieces(sample_id, refs or [sample_id], row, tokens_field))
    return out


def _row_pieces(sample_id: tuple[int, ...], refs: list[tuple[int, ...]], row: Any,
                tokens_field: str) -> list[Piece]:
    payload = row.payload
    field = find_token_field(payload, tokens_field)
    tokens = payload if field is None else payload[field]
    info = row.meta.tags.get(PACKING_METADATA_TAG) if row.meta.tags else None
    pad = int(info.get("padding_length") or 0) if info else 0
    used = len(tokens) - pad
    if len(refs) == 1:
        d, s, loc = refs[0]
        return [(d, s, loc, 0, used)]
    positions = payload.get("positions") if isinstance(payload, dict) else None
    if positions is None:
        raise ValueError(
            f"return_piece_ids: record {sample_id} holds {len(refs)} pieces but no "
            "'positions' to find where each starts; pack with pack_flat(emit_positions=True) "
            "(the default)"
        )
    starts = np.flatnonzero(np.asarray(positions)[:used] == 0).tolist()
    if len(starts) != len(refs) or (starts and starts[0] != 0):
        raise ValueError(
            f"return_piece_ids: record {sample_id} lists {len(refs)} pieces, but its "
            f"positions start {len(starts)} segments (at {starts[:8]}); a row packed twice "
            "(pack_flat over packed rows) or positions changed after packing cannot be cut "
            "into its pieces: use to_training=False and each record's contribution_refs()"
        )
    stops = [*starts[1:], used]
    return [(d, s, loc, a, b) for (d, s, loc), a, b in zip(refs, starts, stops)]
