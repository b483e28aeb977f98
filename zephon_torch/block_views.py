"""Views of a block's rows for the consumer: :class:`BlockBatch`, :class:`PlainRows`.

A batch delivered to the user is a :class:`BlockBatch`: a
:class:`~zephon_torch.types.SampleBatch` over a block of data rows whose
records are built only when someone reads them, while ``to_training`` reads
the block's columns (through :class:`RowView` rows where it must read row by
row). :class:`PlainRows` is what the consumer keeps of a block of untagged
rows it hands out a few at a time: the id array, and the records of any range
of rows on demand.

Example: ``len(batch)`` and ``batch.ids`` come from the ids column; only
``batch.records`` (or iterating) builds the ``SampleRecord`` objects, once.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon_torch.block_ids import ID_CHUNK, ID_OFFSET, NO_COUNTS, unit_counts
from zephon_torch.types import SampleBatch, SampleRecord, records_from_columns
from zephon_torch.vocab import PACKING_METADATA_TAG

if TYPE_CHECKING:
    from zephon_torch.block import Block

__all__ = ["MIXED", "BlockBatch", "PlainRows", "RowView"]


#: :class:`PlainRows`: a column whose rows hold different values.
MIXED: Any = type("Mixed", (), {"__repr__": lambda self: "MIXED", "__slots__": ()})()


class PlainRows:
    """The rows of a block without tags, ready to be handed out a few at a time.

    What the consumer needs of a block of plain data rows: the records of
    any range of rows (built only when asked for) and, for the books, the
    rows' chunk ids, offsets and cursor keys. The ids stay one numpy array;
    the per-row Python objects (counts, payloads, lineage) are the block's
    own lists, so that rows waiting in a queue cost the garbage collector
    nothing.

    Raises:
        ValueError: The block has rows with tags (tombstones, contributors,
            packing metadata, other tags).
    """

    __slots__ = ("consecutive", "counts", "ids", "lane", "lineage", "payloads", "single_chunk",
                 "token_counts", "uniform_counts")

    def __init__(self, block: Block) -> None:
        if not block._plain():
            raise ValueError("PlainRows holds rows without tags; this block has tagged rows")
        self.lane = block.lane
        ids = self.ids = block.ids
        n = len(ids)
        #: The counts object every row shares (the usual one-component block), or MIXED.
        self.uniform_counts: Any = MIXED
        component = block.component
        if block.counts is None and component is None:
            self.uniform_counts = NO_COUNTS
        elif block.counts is None and n and component[0] == component[-1] \
                and bool((component == component[0]).all()):
            self.uniform_counts = unit_counts(int(component[0]))
        self.counts = (block._counts_list() if self.uniform_counts is MIXED
                       else [self.uniform_counts] * n)
        self.payloads = block.payloads if block.payloads is not None else block.payload_list()
        self.token_counts = block.token_counts
        self.lineage = block.lineage
        chunks, offsets = ids[:, ID_CHUNK], ids[:, ID_OFFSET]
        #: Every row is of one chunk (the usual block).
        self.single_chunk = n < 2 or (chunks[0] == chunks[-1]
                                      and bool((chunks == chunks[0]).all()))
        #: The rows' offsets go up one at a time (a chunk's rows in order, none left out).
        self.consecutive = n < 2 or (offsets[-1] - offsets[0] == n - 1
                                     and bool((np.diff(offsets) == 1).all()))

    def __len__(self) -> int:
        return len(self.counts)

    def chunk_ids(self, start: int, stop: int) -> list[int]:
        """The ``chunk_id`` of rows ``start..stop-1``."""
        return self.ids[start:stop, ID_CHUNK].tolist()

    def offsets(self, start: int, stop: int) -> list[int]:
        """The ``chunk_offset`` of rows ``start..stop-1``."""
        return self.ids[start:stop, ID_OFFSET].tolist()

    def records(self, start: int, stop: int) -> list[SampleRecord]:
        """Rows ``start..stop-1`` as records (what ``Block.records()`` gives for them)."""
        cut = slice(start, stop)
        tokens, lineage = self.token_counts, self.lineage
        return records_from_columns(
            itertools.repeat(self.lane), self.ids[cut].T.tolist(), self.counts[cut],
            self.payloads[cut], None if tokens is None else tokens[cut],
            None if lineage is None else lineage[cut])

    def cursor_key(self, i: int) -> tuple[int, int, tuple[int, ...], tuple[int, int, int]]:
        """Row ``i``'s cursor key ``(chunk_id, chunk_offset, lineage, sample_id)``."""
        d, s, loc, c, o = self.ids[i].tolist()
        return (c, o, self.lineage[i] if self.lineage is not None else (), (d, s, loc))


# --------------------------------------------------------------------------- batches


class RowView:
    """A row as code that checks payloads reads it, without building its record.

    It answers ``row.payload``, ``row.meta.sample_id`` and ``row.meta.tags``
    (what ``to_training`` and the packers' checks read: for ``to_training``
    the packing metadata, the one tag it reads).
    """

    __slots__ = ("payload", "sample_id", "tags")

    def __init__(self, sample_id: tuple[int, int, int], payload: Any,
                 tags: Mapping[str, Any] | None = None) -> None:
        self.sample_id = sample_id
        self.payload = payload
        self.tags = {} if tags is None else tags

    @property
    def meta(self) -> RowView:
        return self


class _Rows(Sequence):
    """The rows ``to_training`` reads, plus the columns it reads them from when it can.

    As a sequence it gives a :class:`RowView` per row (built on first use: the
    general path); ``columns`` (the block's fields), ``sample_ids`` and
    ``padding_lengths`` let the common batch of packed rows be read as whole
    arrays without them.
    """

    def __init__(self, block: Block) -> None:
        self._block = block
        self._rows: list[RowView] | None = None
        self.columns = block.fields if block.tomb is None else None
        self.sample_ids = [tuple(v) for v in block.ids[:, :3].tolist()]
        packing = block.packing
        pads = None if packing is None else [
            None if info is None else info.get("padding_length") for info in packing]
        self.padding_lengths = (pads if pads is not None and all(type(p) is int for p in pads)
                                else None)

    def _items(self) -> list[RowView]:
        if self._rows is None:
            block = self._block
            packing = block.packing or [None] * len(block)
            self._rows = [
                RowView(sid, payload, {PACKING_METADATA_TAG: info} if info is not None else {})
                for sid, payload, info in zip(self.sample_ids, block.payload_list(), packing)]
        return self._rows

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: Any) -> Any:
        return self._items()[index]

    def __iter__(self) -> Any:
        return iter(self._items())


class BlockBatch(SampleBatch):
    """A :class:`~zephon_torch.types.SampleBatch` that is a view over a block of data rows.

    ``records``, ``lane_ids`` and ``chunk_ids`` are built on first access;
    ``len()``, ``ids`` and ``to_training`` read the block's columns directly.
    It is a ``SampleBatch`` in every way a caller can see.
    """

    __slots__ = ("_block",)

    def __init__(self, block: Block) -> None:
        object.__setattr__(self, "_block", block)

    def __getattr__(self, name: str) -> Any:
        # Only reached for the slots not filled yet: materialise them on demand.
        if name == "records":
            records = tuple(self._block.records())
            object.__setattr__(self, "records", records)
            return records
        if name == "lane_ids":
            value = (self._block.lane,) * len(self._block)
            object.__setattr__(self, "lane_ids", value)
            return value
        if name == "chunk_ids":
            value = tuple(self._block.chunk_ids.tolist())
            object.__setattr__(self, "chunk_ids", value)
            return value
        raise AttributeError(name)

    @property
    def block(self) -> Block:
        """The block this batch views."""
        return self._block

    def __len__(self) -> int:
        return len(self._block)

    @property
    def ids(self) -> tuple[tuple[int, int, int], ...]:
        """The ``sample_id`` of every record (from the ids column)."""
        return tuple(map(tuple, self._block.ids[:, :3].tolist()))

    def _training_rows(self) -> _Rows:
        return _Rows(self._block)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (BlockBatch, (self._block,))
