"""Where a sample sits: its cursor, its contributors and its :class:`SampleMeta`.

Part of the data model documented in ``zephon_torch.types`` (which re-exports
every name here, and is where users import them from). A base sample is named
by ``sample_id`` and placed by ``(lane_id, chunk_id, chunk_offset)``; fan-out
extends its ``lineage``; the :class:`SampleCursor` built from those orders
records as a single-threaded run emits them. Control information (the
contributors of a packed record, the tombstone and flush-sentinel markers, the
packing metadata) rides in ``meta.tags`` under the vocabulary's reserved keys.

This module imports nothing from the package but ``vocab``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from zephon_torch.vocab import (
    CONTRIBUTORS_TAG,
    FLUSH_SENTINEL_TAG,
    PACKING_METADATA_TAG,
    TOMBSTONE_TAG,
    is_control,
)

__all__ = ["ContributorRef", "SampleCursor", "SampleMeta"]


class _NoTags(dict):
    """The shared, read-only ``tags`` of every meta built without tags.

    Most records carry no tags; sharing one empty mapping saves an allocation
    (and a garbage-collector-tracked object) per sample. Mutating it would
    change every such meta, so it refuses: build a new meta instead.
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "SampleMeta.tags is read-only; copy it (dict(meta.tags)) and build a new meta, "
            "or use with_contributors()/with_tombstone()"
        )

    __setitem__ = __delitem__ = setdefault = update = pop = popitem = clear = _refuse
    __ior__ = _refuse

    def __reduce__(self) -> str:
        return "_NO_TAGS"  # unpickles as the singleton, zephon_torch.types._NO_TAGS


_NO_TAGS: dict[str, Any] = _NoTags()


@dataclass(frozen=True, slots=True, eq=False)
class SampleCursor:
    """Stable ordering key that survives fan-out across the pipeline.

    Cursors compare (``<``, ``==``, ...) by :meth:`as_key`, so sorting cursors
    gives the order in which a single-threaded run emits their records.
    """

    chunk_id: int
    chunk_offset: int
    sample_id: tuple[int, int, int]
    lineage: tuple[int, ...] = field(default_factory=tuple)

    @staticmethod
    def from_key(key: Sequence[Any]) -> SampleCursor:
        """Rebuild a cursor from :meth:`as_key` output (lists from JSON work too)."""
        chunk_id, chunk_offset, lineage, sample_id = key
        return SampleCursor(
            int(chunk_id), int(chunk_offset), tuple(int(s) for s in sample_id),
            tuple(int(i) for i in lineage),
        )

    def child(self, index: int) -> SampleCursor:
        """Return the cursor for the ``index``-th child of this element."""
        return SampleCursor(self.chunk_id, self.chunk_offset, self.sample_id,
                            (*self.lineage, index))

    def as_key(self) -> tuple[int, int, tuple[int, ...], tuple[int, int, int]]:
        """Return the canonical tuple key used in checkpoints and comparisons."""
        return (self.chunk_id, self.chunk_offset, self.lineage, self.sample_id)

    @property
    def base_offset(self) -> tuple[int, int]:
        """Return ``(chunk_id, chunk_offset)`` for eviction/base-offset accounting."""
        return (self.chunk_id, self.chunk_offset)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleCursor):
            return NotImplemented
        return self.as_key() == other.as_key()

    def __hash__(self) -> int:
        return hash(self.as_key())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A constructor call pickles several times faster than the default
        # path for slotted frozen dataclasses (packed rows carry many cursors).
        return (SampleCursor, (self.chunk_id, self.chunk_offset, self.sample_id, self.lineage))

    def __lt__(self, other: SampleCursor) -> bool:
        if not isinstance(other, SampleCursor):
            return NotImplemented
        return self.as_key() < other.as_key()

    def __le__(self, other: SampleCursor) -> bool:
        if not isinstance(other, SampleCursor):
            return NotImplemented
        return self.as_key() <= other.as_key()

    def __gt__(self, other: SampleCursor) -> bool:
        if not isinstance(other, SampleCursor):
            return NotImplemented
        return self.as_key() > other.as_key()

    def __ge__(self, other: SampleCursor) -> bool:
        if not isinstance(other, SampleCursor):
            return NotImplemented
        return self.as_key() >= other.as_key()


@dataclass(frozen=True, slots=True)
class ContributorRef:
    """Reference to a contributing child derived from a base sample.

    ``cursor`` pinpoints the base offset and lineage; ``is_last_child=True``
    denotes the sole contributor (or tombstone) that closes that base offset
    for eviction purposes.
    """

    cursor: SampleCursor
    is_last_child: bool = True

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (ContributorRef, (self.cursor, self.is_last_child))


@dataclass(frozen=True, slots=True, init=False)
class SampleMeta:
    """Lightweight metadata that uniquely identifies a sample in a shard.

    ``lineage`` tracks the deterministic position of this record after any
    fan-out: an operator that splits an input calls :meth:`child` in emission
    order, so downstream consumers see the order of a single-threaded run.

    ``component_sample_counts`` maps a mixture component to the number of base
    samples of that component this record holds (``{cid: 1}`` for a plain
    sample; summed over the members of a packed record).
    ``component_token_counts`` maps a component to its token count; it stays
    ``None`` until packing happens after tokenization. ``ensure_mixture``
    weighs by samples with the first and by tokens with the second (falling
    back to splitting the record's token count in proportion to its sample
    counts).

    Contributors, the tombstone marker, the flush-sentinel marker and packing
    metadata live in ``tags`` under reserved keys, so the common 1:1 record
    carries none of them.
    """

    sample_id: tuple[int, int, int]
    lane_id: int
    chunk_id: int
    chunk_offset: int = 0
    component_sample_counts: dict[int, int] = field(default_factory=dict)
    component_token_counts: dict[int, int] | None = None
    lineage: tuple[int, ...] = field(default_factory=tuple)
    tags: dict[str, Any] = field(default_factory=lambda: _NO_TAGS)

    # A meta is built for every sample, so __init__ is written by hand: it sets
    # the slots through their descriptors, about twice as fast as the
    # generated frozen __init__ (which goes through object.__setattr__).
    def __init__(
        self,
        sample_id: tuple[int, int, int],
        lane_id: int,
        chunk_id: int,
        chunk_offset: int = 0,
        component_sample_counts: dict[int, int] | None = None,
        component_token_counts: dict[int, int] | None = None,
        lineage: tuple[int, ...] = (),
        tags: dict[str, Any] | None = None,
    ) -> None:
        _META_SET_SAMPLE_ID(self, sample_id)
        _META_SET_LANE_ID(self, lane_id)
        _META_SET_CHUNK_ID(self, chunk_id)
        _META_SET_CHUNK_OFFSET(self, chunk_offset)
        _META_SET_COUNTS(self, {} if component_sample_counts is None else component_sample_counts)
        _META_SET_TOKEN_COUNTS(self, component_token_counts)
        _META_SET_LINEAGE(self, lineage)
        _META_SET_TAGS(self, _NO_TAGS if tags is None else tags)

    def __hash__(self) -> int:
        return hash((self.sample_id, self.lane_id, self.chunk_id, self.chunk_offset,
                     self.lineage))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickle as a constructor call: several times faster than the default
        # path for slotted frozen dataclasses (metas cross process boundaries).
        return (SampleMeta, (self.sample_id, self.lane_id, self.chunk_id, self.chunk_offset,
                             self.component_sample_counts, self.component_token_counts,
                             self.lineage, self.tags))

    def _replace(self, *, lineage: tuple[int, ...] | None = None,
                 tags: dict[str, Any] | None = None) -> SampleMeta:
        return SampleMeta(
            self.sample_id, self.lane_id, self.chunk_id, self.chunk_offset,
            self.component_sample_counts, self.component_token_counts,
            self.lineage if lineage is None else lineage,
            self.tags if tags is None else tags,
        )

    def with_lineage(self, path: Sequence[int]) -> SampleMeta:
        """Return a new SampleMeta whose lineage is replaced by ``path``."""
        return self._replace(lineage=tuple(path))

    def child(self, index: int) -> SampleMeta:
        """Return metadata for the ``index``-th child emitted from this sample."""
        return self._replace(lineage=(*self.lineage, index))

    @property
    def cursor(self) -> SampleCursor:
        """Return a :class:`SampleCursor` ordering key for this metadata."""
        return SampleCursor(self.chunk_id, self.chunk_offset, self.sample_id, self.lineage)

    def as_cursor_key(self) -> tuple[int, int, tuple[int, ...], tuple[int, int, int]]:
        """Convenience helper returning the tuple form used for persistence."""
        return (self.chunk_id, self.chunk_offset, self.lineage, self.sample_id)

    def contribution_refs(self) -> tuple[ContributorRef, ...]:
        """Return contributor references used for eviction/progress.

        Operators that don't set contributors (1:1 outputs) are treated as
        emitting a single contributor with ``is_last_child=True`` using their
        own cursor.
        """
        refs = self.tags.get(CONTRIBUTORS_TAG)
        if refs:
            return refs
        return (ContributorRef(self.cursor, True),)

    def contribution_cursors(self) -> tuple[SampleCursor, ...]:
        """Return the cursors of all contributors."""
        return tuple(ref.cursor for ref in self.contribution_refs())

    @property
    def contributors(self) -> tuple[ContributorRef, ...]:
        """The contributors stored in the tags (empty for a plain 1:1 record)."""
        return self.tags.get(CONTRIBUTORS_TAG, ())

    @property
    def tombstone(self) -> bool:
        """True if this record is a tombstone (a dropped sample)."""
        return bool(self.tags.get(TOMBSTONE_TAG, False))

    @property
    def is_sentinel(self) -> bool:
        """True if this record is a control signal (tombstone, flush, etc.)."""
        return is_control(self.tags)

    @property
    def is_flush_sentinel(self) -> bool:
        """True if this record is a flush sentinel (triggers accumulator flush)."""
        return bool(self.tags.get(FLUSH_SENTINEL_TAG, False))

    @property
    def padding_length(self) -> int | None:
        """Trailing pad-token count of a flat ``pack_flat`` record, else None."""
        info = self.tags.get(PACKING_METADATA_TAG)
        if info is None:
            return None
        value = info.get("padding_length")
        return None if value is None else int(value)

    def with_contributors(self, value: Sequence[ContributorRef] | None) -> SampleMeta:
        """Return a new SampleMeta with contributors set (or cleared by ``None``/empty)."""
        tags = dict(self.tags)
        if value:
            tags[CONTRIBUTORS_TAG] = tuple(value)
        else:
            tags.pop(CONTRIBUTORS_TAG, None)
        return self._replace(tags=tags)

    def with_tombstone(self, value: bool = True) -> SampleMeta:
        """Return a new SampleMeta with the tombstone marker set or cleared."""
        tags = dict(self.tags)
        if value:
            tags[TOMBSTONE_TAG] = True
        else:
            tags.pop(TOMBSTONE_TAG, None)
        return self._replace(tags=tags)


(
    _META_SET_SAMPLE_ID, _META_SET_LANE_ID, _META_SET_CHUNK_ID, _META_SET_CHUNK_OFFSET,
    _META_SET_COUNTS, _META_SET_TOKEN_COUNTS, _META_SET_LINEAGE, _META_SET_TAGS,
) = (SampleMeta.__dict__[f.name].__set__ for f in fields(SampleMeta))
