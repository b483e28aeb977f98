"""The words every part of zephon_torch shares: reserved tags, control records, closes.

This module sits at the bottom of the package: it imports nothing from
``zephon_torch``, and every other module that needs one of these facts takes
it from here (no string literal of a reserved tag lives anywhere else).

**Reserved tags** ride in ``SampleMeta.tags``:

=========================  ====================================================
key                        value
=========================  ====================================================
``"_contributors"``        tuple of ``ContributorRef``: the inputs of a packed
                           record (only a last child closes its base offset)
``"_tombstone"``           ``True``: a dropped sample that still closes its
                           base offset
``"_tombstone_reason"``    why (``"filter"``, ``"empty"``, ``"decode_error"``)
``"_tombstone_detail"``    what was wrong with a skipped bad sample
``"_flush_sentinel"``      ``True``: an epoch boundary of one lane
``"_packing_metadata"``    ``{"padding_length": int, ...}`` of a packed row
=========================  ====================================================

**What a record closes.** Progress accounting counts base offsets
``(chunk_id, chunk_offset)``. A record without contributors closes its own
offset; one with contributors closes the offset of each contributor marked
``is_last_child`` (an earlier piece of a split document closes nothing)::

    plain record at (3, 7)                        -> closes (3, 7)
    packed row, pieces (3, 7) last, (3, 8) first  -> closes (3, 7)
    tombstone of (3, 9)                           -> closes (3, 9)

**Empty text.** A document whose text is empty or only whitespace carries
nothing to train on: sources and ``decode_text`` turn it into a tombstone
with reason ``"empty"`` (:func:`is_empty_text`).

**Token fields.** ``tokens_field="auto"`` looks for :data:`AUTO_TOKEN_FIELDS`
in this order (:func:`find_token_field`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import repeat
from typing import Any

__all__ = [
    "AUTO_TOKEN_FIELDS",
    "CONTRIBUTORS_TAG",
    "FLUSH_SENTINEL_TAG",
    "LOSS_MASK_FIELD",
    "PACKING_METADATA_TAG",
    "POSITIONS_FIELD",
    "RESERVED_TAGS",
    "TOMBSTONE_DETAIL_TAG",
    "TOMBSTONE_REASON_TAG",
    "TOMBSTONE_TAG",
    "close_count",
    "closed_offsets",
    "empty_text_rows",
    "find_token_field",
    "is_control",
    "is_empty_text",
    "is_error_reason",
    "is_flush_sentinel",
    "is_tombstone",
    "texts_present",
    "tombstone_tags",
]

#: Tag holding the tuple of ``ContributorRef`` of a multi-input record.
CONTRIBUTORS_TAG = "_contributors"
#: Tag marking a tombstone: a dropped sample that still closes its base offset.
TOMBSTONE_TAG = "_tombstone"
#: Tag holding why a record was tombstoned (``"filter"``, ``"empty"``, ...).
TOMBSTONE_REASON_TAG = "_tombstone_reason"
#: Tag holding what was wrong with a skipped bad sample (``"malformed JSON (...)"``).
TOMBSTONE_DETAIL_TAG = "_tombstone_detail"
#: Tag marking a flush sentinel; its ``chunk_id`` is the epoch boundary.
FLUSH_SENTINEL_TAG = "_flush_sentinel"
#: Tag holding ``{"padding_length": int, ...}``, written by ``pack_flat``.
PACKING_METADATA_TAG = "_packing_metadata"
#: Every reserved tag, in the order a record view lays them out.
RESERVED_TAGS = (CONTRIBUTORS_TAG, PACKING_METADATA_TAG, TOMBSTONE_TAG, TOMBSTONE_REASON_TAG,
                 TOMBSTONE_DETAIL_TAG, FLUSH_SENTINEL_TAG)

#: Field names ``tokens_field="auto"`` looks for, in this order.
AUTO_TOKEN_FIELDS = ("input_ids", "tokens", "token_ids", "ids")
#: The per-token supervision mask field (chat templates write it).
LOSS_MASK_FIELD = "loss_mask"
#: The per-token positions field (``pack_flat`` writes it).
POSITIONS_FIELD = "positions"


def is_tombstone(tags: Mapping[str, Any]) -> bool:
    """True if a meta's ``tags`` mark a tombstone."""
    return bool(tags) and bool(tags.get(TOMBSTONE_TAG))


def is_flush_sentinel(tags: Mapping[str, Any]) -> bool:
    """True if a meta's ``tags`` mark a flush sentinel."""
    return bool(tags) and bool(tags.get(FLUSH_SENTINEL_TAG))


def is_control(tags: Mapping[str, Any]) -> bool:
    """True for a control record (a tombstone or a flush sentinel), never handed to training."""
    return bool(tags) and bool(tags.get(TOMBSTONE_TAG) or tags.get(FLUSH_SENTINEL_TAG))


def is_error_reason(reason: str) -> bool:
    """Whether a tombstone reason means a bad sample skipped by ``on_error="skip"``."""
    return reason.endswith("_error")


def tombstone_tags(tags: Mapping[str, Any], reason: str, detail: str | None) -> dict[str, Any]:
    """The tags of the tombstone of a record whose tags are ``tags``.

    The record's own tags (its contributors) are kept, so the tombstone closes
    exactly what the record would have closed.
    """
    out = dict(tags)
    out[TOMBSTONE_TAG] = True
    out[TOMBSTONE_REASON_TAG] = reason
    if detail is not None:
        out[TOMBSTONE_DETAIL_TAG] = detail
    return out


def closed_offsets(meta: Any) -> Iterator[tuple[int, int]]:
    """The base offsets ``(chunk_id, chunk_offset)`` a record closes (see the module doc)."""
    tags = meta.tags
    refs = tags.get(CONTRIBUTORS_TAG) if tags else None
    if not refs:
        yield (meta.chunk_id, meta.chunk_offset)
        return
    for ref in refs:
        if ref.is_last_child:
            cursor = ref.cursor
            yield (cursor.chunk_id, cursor.chunk_offset)


def close_count(meta: Any) -> int:
    """How many base offsets a record closes."""
    tags = meta.tags
    refs = tags.get(CONTRIBUTORS_TAG) if tags else None
    if not refs:
        return 1
    return sum(1 for ref in refs if ref.is_last_child)


def is_empty_text(text: Any) -> bool:
    """True for a text with nothing to train on: an empty or all-whitespace string, or
    empty structured content (a list of chat messages with none in it)."""
    if isinstance(text, str):
        return not text or text.isspace()
    return isinstance(text, (list, tuple, dict)) and not text


def texts_present(payloads: list[Any]) -> bool:
    """Whether every payload is a dict whose ``"text"`` is a string with a non-blank
    character: then no row is an empty text. False: look row by row.

    One sweep in C: ``dict.get`` and ``str.strip`` refuse (TypeError) anything but a
    dict and a string, and a text strips to ``""`` exactly when it is empty or only
    whitespace (``strip`` and ``isspace`` share one definition of whitespace).
    """
    try:
        return "" not in map(str.strip, map(dict.get, payloads, repeat("text")))
    except TypeError:
        return False


def empty_text_rows(payloads: list[Any]) -> list[int]:
    """The positions of dict payloads whose ``"text"`` is an empty or all-whitespace
    string (:func:`is_empty_text` for the sources' in-memory items, in one sweep)."""
    if texts_present(payloads):  # the usual chunk
        return []
    return [i for i, p in enumerate(payloads)
            if type(p) is dict and type(t := p.get("text")) is str and (not t or t.isspace())]


def find_token_field(payload: Any, tokens_field: str) -> str | None:
    """The dict key holding a payload's token ids (None: the payload is the array itself).

    Raises:
        ValueError: An explicit ``tokens_field`` the payload lacks, or, with
            ``"auto"``, none of :data:`AUTO_TOKEN_FIELDS` present.
    """
    if not isinstance(payload, Mapping):
        return None
    if tokens_field != "auto":
        if tokens_field not in payload:
            raise ValueError(
                f"payload has no token field {tokens_field!r} (its fields: "
                f"{sorted(map(str, payload))}); set tokens_field= to the field holding the "
                "token ids"
            )
        return tokens_field
    for name in AUTO_TOKEN_FIELDS:
        if name in payload:
            return name
    raise ValueError(
        f"cannot detect the token field: the payload fields are {sorted(map(str, payload))}, "
        f"none of {list(AUTO_TOKEN_FIELDS)}; tokenize first or pass tokens_field= explicitly"
    )
