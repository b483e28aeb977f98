"""The data model every stage of a pipeline speaks.

Two kinds of element travel between stages: a :class:`SampleRecord` (one
sample: its :class:`SampleMeta` and its payload) and, after ``batch()``, a
:class:`SampleBatch` of records of one lane.

Identity and order live in the meta. A base sample is named by
``sample_id = (dataset_id, shard_id, local_sample_id)`` and placed by
``(lane_id, chunk_id, chunk_offset)``. When an operator splits one record into
several, output ``i`` gets ``meta.child(i)``, which appends ``i`` to the
``lineage``. The cursor key ``(chunk_id, chunk_offset, lineage, sample_id)``
then sorts records exactly as a single-threaded run emits them::

    doc at chunk 3, offset 7      -> key (3, 7, (),   sid)
    ...its first piece            -> key (3, 7, (0,), sid)
    ...its second piece           -> key (3, 7, (1,), sid)
    next doc, chunk 3, offset 8   -> key (3, 8, (),   sid')

Control information rides in ``meta.tags`` under reserved keys (see
:data:`CONTRIBUTORS_TAG` and its neighbours): the contributors of a packed
record, the tombstone marker of a dropped sample, the flush-sentinel marker,
and the packing metadata (trailing padding length) written by ``pack_flat``.

Every class here is a frozen dataclass. They are created once per sample, so
constructors do no validation and no copying: containers handed in are kept
as they are and must not be mutated afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import repeat
from typing import TYPE_CHECKING, Any, Union

# The reserved tags live in the vocabulary module; they are public names here too.
from zephon_torch.vocab import (
    CONTRIBUTORS_TAG,
    FLUSH_SENTINEL_TAG,
    PACKING_METADATA_TAG,
    TOMBSTONE_TAG,
    is_control,
)

if TYPE_CHECKING:
    from typing import Literal

__all__ = [
    "CONTRIBUTORS_TAG",
    "FLUSH_SENTINEL_TAG",
    "PACKING_METADATA_TAG",
    "TOMBSTONE_TAG",
    "ChunkId",
    "ChunkOffset",
    "ComponentId",
    "ContributorRef",
    "CursorKey",
    "DatasetId",
    "LaneId",
    "LineageIndex",
    "LocalSampleId",
    "SampleBatch",
    "SampleCursor",
    "SampleId",
    "SampleMeta",
    "SamplePayload",
    "SamplePayloadArray",
    "SampleRecord",
    "ShardId",
]

ChunkId = int
ChunkOffset = int
ComponentId = int
DatasetId = int
LaneId = int
LineageIndex = int
LocalSampleId = int
ShardId = int
#: A 1-D array of token ids: a numpy array, a torch tensor or a list of ints.
SamplePayloadArray = Any
#: ``(dataset_id, shard_id, local_sample_id)``.
SampleId = tuple[int, int, int]
#: ``(chunk_id, chunk_offset, lineage, sample_id)``: the canonical cursor key.
CursorKey = tuple[int, int, tuple[int, ...], SampleId]
SamplePayload = Union[  # a recursive alias: Union[...] takes the string forms
    bytes,
    memoryview,
    str,
    int,
    float,
    complex,
    SamplePayloadArray,
    "list[SamplePayload]",
    "dict[Any, SamplePayload]",
]




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
        return "_NO_TAGS"  # unpickles as the module's singleton


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


#: What :meth:`SampleBatch.to_training` runs: ``zephon_torch._training``'s
#: ``batch_to_training``. The conversion stands above the data model (it reaches the
#: packing kernel's switch in ``ops``), so this module never imports it: the package
#: root installs it (:func:`install_training_converter`, in ``zephon_torch/__init__.py``),
#: which every import of a ``zephon_torch`` module runs first.
_training_converter: Callable[..., dict[str, Any]] | None = None


def install_training_converter(convert: Callable[..., dict[str, Any]]) -> None:
    """Make ``convert(rows, **options)`` the function behind :meth:`SampleBatch.to_training`.

    The package root calls it once, with ``zephon_torch._training.batch_to_training``.
    """
    global _training_converter
    _training_converter = convert


@dataclass(frozen=True, slots=True, eq=False)
class SampleBatch:
    """A batch of :class:`SampleRecord` of one lane, in stream order.

    ``SampleBatch(records)`` accepts any sequence and stores a tuple;
    ``lane_ids`` and ``chunk_ids`` are derived from the records. A batch has
    ``len()`` and iterates over its records.
    """

    records: tuple[SampleRecord, ...]
    lane_ids: tuple[int, ...] = field(init=False)
    chunk_ids: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        records = self.records if type(self.records) is tuple else tuple(self.records)
        object.__setattr__(self, "records", records)
        object.__setattr__(self, "lane_ids", tuple(r.meta.lane_id for r in records))
        object.__setattr__(self, "chunk_ids", tuple(r.meta.chunk_id for r in records))

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[SampleRecord]:
        return iter(self.records)

    def __getitem__(self, index: int) -> SampleRecord:
        return self.records[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleBatch):
            return NotImplemented
        return self.records == other.records

    def __hash__(self) -> int:
        return hash(self.records)

    @property
    def ids(self) -> tuple[tuple[int, int, int], ...]:
        """The ``sample_id`` of every record."""
        return tuple(r.meta.sample_id for r in self.records)

    def _training_rows(self) -> Sequence[Any]:
        """What ``to_training`` reads: the records (a block view has lighter rows)."""
        return self.records

    @property
    def lineage_paths(self) -> tuple[tuple[int, ...], ...]:
        """The ``lineage`` of every record."""
        return tuple(r.meta.lineage for r in self.records)

    def to_training(
        self,
        *,
        tokens_field: str = "auto",
        return_labels: bool = False,
        dtype: Any = "auto",
        extra_fields: Sequence[str] = (),
        ignore_index: int = -100,
        rename_fields: Mapping[str, str] | None = None,
        flatten: bool = False,
        exclude_fields: Sequence[str] = (),
        return_num_valid_tokens: bool = False,
        return_loss_mask: bool = False,
        return_cu_seqlens: bool = False,
        return_padding_mask: bool = False,
        eos_mask_loss: bool = False,
        eos_token_id: int | None = None,
        position_mode: Literal["preserve", "sequence"] = "preserve",
        return_piece_ids: bool = False,
        device: Any = None,
        pin_memory: bool = False,
        format: Literal["hf"] | None = None,
    ) -> dict[str, Any]:
        """Convert the batch to a training-ready dict, with optional LM labels.

        The common cases are one call each:

        - a transformers causal LM: pack to the model's length
          (``pack_flat(2048)``), then ``to_training(format="hf")`` and
          ``model(**batch).loss`` (``docs/huggingface.md``);
        - a loss of your own: pack one token longer (``pack_flat(2049)``),
          then ``to_training(return_labels=True)`` gives 2048 ``input_ids``
          and their next-token ``labels``.

        Without either, ``input_ids`` are the whole rows and there are no
        labels (for inference, or labels made elsewhere).

        See ``docs/to_training.md`` for the full contract with worked examples.
        In short: ``"ids"`` and ``"texts"`` are always returned as lists;
        ``"input_ids"`` stacks the token field (``tokens_field="auto"`` looks
        for ``input_ids``, ``tokens``, ``token_ids``, ``ids`` in that order; a
        payload may also be a bare 1-D array of ids). With
        ``return_labels=True``, ``input_ids = tokens[:, :-1]`` and
        ``labels = tokens[:, 1:]``, and labels are set to ``ignore_index``
        where they fall in a record's trailing padding
        (``meta.padding_length``), where a payload ``loss_mask`` (shifted by
        one, ``mask[:, 1:]``) is 0, and, with ``eos_mask_loss``, where the
        input token is ``eos_token_id``. Payload ``positions`` (from
        ``pack_flat``) are forwarded and sliced like ``input_ids``
        (``position_mode="preserve"``) or replaced by ``0..S-1`` per row
        (``"sequence"``).

        Args:
            tokens_field: Field holding the token ids, or ``"auto"``. Bare
                array payloads are the token rows themselves: the name is
                ignored for them.
            return_labels: Shift tokens into ``input_ids``/``labels``.
            dtype: ``"auto"`` (torch.long if torch imports, else numpy int64),
                ``None`` (Python lists), a torch dtype (tensors) or a numpy
                dtype (arrays). Applies to token-like integer fields.
            extra_fields: More per-token payload fields to stack; sliced like
                ``input_ids`` when labels are returned. ``positions`` may be
                listed in either ``position_mode`` and comes out once (the
                generated numbering under ``"sequence"``).
            ignore_index: Label value ignored by the loss.
            rename_fields: ``{emitted_key: new_key}``, applied before exclusion.
            flatten: Flatten sequence fields from ``[B, S]`` to ``[B * S]``
                after shifting and masking; ``cu_seqlens`` becomes one compact
                cumulative sequence and ``max_seqlen`` a Python int.
            exclude_fields: Output names (after renaming) to omit.
            return_num_valid_tokens: Add the count of labels that are not
                ``ignore_index`` (a Python int). Needs ``return_labels``.
            return_loss_mask: Add the label-aligned float32 ``loss_mask``
                (1.0 where a label counts). Needs ``return_labels``.
            return_cu_seqlens: Add ``cu_seqlens`` and ``max_seqlen`` derived
                from the zeros of the input-aligned payload positions (int32).
            return_padding_mask: Add the bool input-aligned ``padding_mask``,
                True on trailing padding only.
            eos_mask_loss: Ignore labels predicted from an EOS input token.
                Careful: if BOS and EOS share an id, the first content token
                after BOS is masked too.
            eos_token_id: Nonnegative EOS id; required by ``eos_mask_loss``.
            position_mode: ``"preserve"`` or ``"sequence"``.
            return_piece_ids: Add ``piece_ids``: for every row, a list of
                ``(dataset, shard, local, start, stop)``, one per piece it
                holds, in row order (a packed row holds several; ``ids``
                names only the first): the piece's sample id and its span
                ``row[start:stop]`` in the whole row (before the label
                shift; padding is in no piece). Off by default, and free
                when off. Packed rows need their ``positions``.
            device: Place every tensor on this device (``non_blocking`` when
                the source is pinned). Needs tensor output.
            pin_memory: Pin CPU tensors before the device copy.
            format: ``None`` (the options as given) or ``"hf"``: only what a
                transformers causal LM's ``forward`` takes, as int64 tensors:
                ``input_ids`` (the whole rows), ``labels`` (the same tokens,
                -100 on padding, where a payload ``loss_mask`` is 0, on each
                document's first token, and after EOS with
                ``eos_mask_loss``; the model shifts them itself), and
                ``position_ids`` (rows with payload positions) or
                ``attention_mask`` (rows without). ``flatten=True`` gives one
                ``[1, B * S]`` row (transformers' padding-free layout). Takes
                ``tokens_field``, ``extra_fields``, ``rename_fields``,
                ``exclude_fields``, ``flatten``, ``eos_mask_loss``,
                ``eos_token_id``, ``device`` and ``pin_memory``; other
                options are a ``ValueError``.

        Returns:
            A dict with ``ids``, ``texts``, ``input_ids`` and, as requested,
            ``labels``, ``positions``, the extra fields, ``num_valid_tokens``,
            ``loss_mask``, ``cu_seqlens``, ``max_seqlen``, ``padding_mask``,
            ``piece_ids``.

        Raises:
            TypeError: Payloads neither dicts nor arrays, or a mix of both;
                ``exclude_fields``/``extra_fields`` not a sequence of names (a
                string, None); ``ignore_index`` not an int.
            ValueError: Any inconsistent request or data (see the docs page
                for the full list); messages name the record and the field.

        Warns:
            UserWarning: ``eos_token_id`` given with ``eos_mask_loss=False``.
        """
        convert = _training_converter
        if convert is None:  # only while zephon_torch/__init__.py itself is being imported
            raise RuntimeError("SampleBatch.to_training needs the zephon_torch package "
                               "imported first (import zephon_torch)")
        return convert(
            self._training_rows(),
            tokens_field=tokens_field,
            return_labels=return_labels,
            dtype=dtype,
            extra_fields=extra_fields,
            ignore_index=ignore_index,
            rename_fields=rename_fields,
            flatten=flatten,
            exclude_fields=exclude_fields,
            return_num_valid_tokens=return_num_valid_tokens,
            return_loss_mask=return_loss_mask,
            return_cu_seqlens=return_cu_seqlens,
            return_padding_mask=return_padding_mask,
            eos_mask_loss=eos_mask_loss,
            eos_token_id=eos_token_id,
            position_mode=position_mode,
            device=device,
            pin_memory=pin_memory,
            format=format,
            return_piece_ids=return_piece_ids,
        )
