"""A sample with its payload (:class:`SampleRecord`), and records made many at once.

Part of the data model documented in ``zephon_torch.types`` (which re-exports
the public names here). :func:`payloads_equal` is how two records' payloads
compare (arrays by value); :func:`records_from_columns` and
:func:`metas_from_columns` build the records and metas of a block's columns
in one sweep, for the block layer and the consumer.

This module imports nothing from the package but ``vocab`` and the data model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from zephon_torch._types_meta import _NO_TAGS, SampleMeta

__all__ = ["SampleRecord", "metas_from_columns", "payloads_equal", "records_from_columns"]


def payloads_equal(a: Any, b: Any) -> bool:
    """Deep equality of two payloads, treating arrays and tensors by value.

    Arrays (numpy arrays, torch tensors) compare equal when their dtype, shape
    and values agree; an array never equals a list.
    """
    if a is b:
        return True
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return False
        return all(payloads_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(payloads_equal(x, y) for x, y in zip(a, b)))
    if _is_array(a) or _is_array(b):
        import numpy as np

        if not (_is_array(a) and _is_array(b)):
            return False
        x, y = _as_numpy(a), _as_numpy(b)
        return x.dtype == y.dtype and x.shape == y.shape and bool(np.array_equal(x, y))
    return bool(a == b)


def _is_array(value: Any) -> bool:
    return hasattr(value, "__array__") and not isinstance(value, (bytes, str, memoryview))


def _as_numpy(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


@dataclass(frozen=True, slots=True, eq=False, init=False)
class SampleRecord:
    """Sample payload bundled with its metadata for transport through stages.

    Two records are equal when their metas are equal and their payloads are
    equal by value (arrays compared element-wise).
    """

    meta: SampleMeta
    payload: Any

    def __init__(self, meta: SampleMeta, payload: Any) -> None:
        _RECORD_SET_META(self, meta)
        _RECORD_SET_PAYLOAD(self, payload)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleRecord):
            return NotImplemented
        return self.meta == other.meta and payloads_equal(self.payload, other.payload)

    def __hash__(self) -> int:
        return hash(self.meta)


_RECORD_SET_META = SampleRecord.__dict__["meta"].__set__
_RECORD_SET_PAYLOAD = SampleRecord.__dict__["payload"].__set__


# --------------------------------------------------------------------------- many at once


class _MetaDraft:
    """A :class:`SampleMeta` being filled in: the same slots, without the frozen guard.

    Blocks turn hundreds of rows into metas at a time. Filling a frozen
    instance costs a descriptor call per field; a draft's slots take plain
    attribute stores, which the interpreter specialises. Once every slot is
    set, ``__class__`` assignment (allowed between classes of identical
    layout) makes the draft a ``SampleMeta``: the same type, slots and values
    as ``SampleMeta(...)`` would have built, nothing else (a test holds the
    two equal, and that the layouts match).
    """

    __slots__ = SampleMeta.__slots__  # type: ignore[attr-defined]


class _RecordDraft:
    """A :class:`SampleRecord` being filled in (see :class:`_MetaDraft`)."""

    __slots__ = SampleRecord.__slots__  # type: ignore[attr-defined]


def records_from_columns(
    lanes: Iterable[int],
    columns: Sequence[Sequence[int]],
    counts: Sequence[dict[int, int] | None],
    payloads: Sequence[Any],
    token_counts: Sequence[dict[int, int] | None] | None = None,
    lineage: Sequence[tuple[int, ...]] | None = None,
    tags: Sequence[dict[str, Any] | None] | None = None,
) -> list[SampleRecord]:
    """Records built in one sweep over columns, equal to ``SampleRecord(SampleMeta(...), p)``.

    ``columns`` holds five columns: dataset, shard and local id (the
    ``sample_id``), ``chunk_id`` and ``chunk_offset``; ``lanes`` the lane of
    each row. Any of them may be an endless ``itertools.repeat`` of one value
    (the rows end with the shortest). Row ``i``
    becomes ``SampleRecord(SampleMeta(sample_id, lanes[i], chunk_id,
    chunk_offset, counts[i], token_counts[i], lineage[i], tags[i]),
    payloads[i])``; ``None`` for ``token_counts``, ``lineage`` or ``tags``
    means the defaults for every row. For the block layer and the consumer,
    which make records a block (or a slice of an interleave) at a time.
    """
    meta_type, record_type = SampleMeta, SampleRecord
    out: list[SampleRecord] = []
    append = out.append
    if token_counts is None and lineage is None and tags is None:
        dataset, shard, local, chunk, offset = columns
        for lane, d, s, loc, c, o, cnt, payload in zip(lanes, dataset, shard, local, chunk,
                                                       offset, counts, payloads):
            m = _MetaDraft()
            m.sample_id = (d, s, loc)
            m.lane_id = lane
            m.chunk_id = c
            m.chunk_offset = o
            m.component_sample_counts = {} if cnt is None else cnt
            m.component_token_counts = None
            m.lineage = ()
            m.tags = _NO_TAGS
            m.__class__ = meta_type  # type: ignore[assignment]
            r = _RecordDraft()
            r.meta = m
            r.payload = payload
            r.__class__ = record_type  # type: ignore[assignment]
            append(r)
        return out  # type: ignore[return-value]
    metas = metas_from_columns(lanes, columns, counts, token_counts, lineage, tags)
    for m, payload in zip(metas, payloads):
        r = _RecordDraft()
        r.meta = m
        r.payload = payload
        r.__class__ = record_type  # type: ignore[assignment]
        append(r)
    return out  # type: ignore[return-value]


def metas_from_columns(
    lanes: Iterable[int],
    columns: Sequence[Sequence[int]],
    counts: Sequence[dict[int, int] | None],
    token_counts: Sequence[dict[int, int] | None] | None = None,
    lineage: Sequence[tuple[int, ...]] | None = None,
    tags: Sequence[dict[str, Any] | None] | None = None,
) -> list[SampleMeta]:
    """The metas of :func:`records_from_columns`, without records."""
    meta_type = SampleMeta
    tokens = token_counts if token_counts is not None else repeat(None)
    paths = lineage if lineage is not None else repeat(())
    marks = tags if tags is not None else repeat(None)
    out: list[SampleMeta] = []
    append = out.append
    for lane, d, s, loc, c, o, cnt, tc, lin, tg in zip(lanes, *columns, counts, tokens, paths,
                                                       marks):
        m = _MetaDraft()
        m.sample_id = (d, s, loc)
        m.lane_id = lane
        m.chunk_id = c
        m.chunk_offset = o
        m.component_sample_counts = {} if cnt is None else cnt
        m.component_token_counts = tc
        m.lineage = lin
        m.tags = _NO_TAGS if tg is None else tg
        m.__class__ = meta_type  # type: ignore[assignment]
        append(m)
    return out  # type: ignore[return-value]
