"""Blocks: one lane's micro-batch of records, stored as columns.

Between built-in stages the unit of work is a :class:`Block`, not a list of
:class:`~zephon_torch.types.SampleRecord`. A block holds the records of one
lane and one micro-batch as a few arrays, so a stage pays per block, not per
document: identity, accounting and payloads are array operations. The public
types stay the contract: :meth:`Block.records` builds records equal, field
for field, to those the object path builds, and :meth:`Block.from_records`
turns any records back into a block (the round trip is exact).

========================  ==================================================
column                    holds
========================  ==================================================
``lane``                  the lane of every row (one scalar per block)
``ids``                   int64 ``(n, 5)``: dataset, shard, local id (the
                          ``sample_id``), ``chunk_id``, ``chunk_offset``
``lineage``               ``None`` (every row a base sample) or one tuple
                          per row
``component``             int64 ``(n,)``: the row counts as one sample of
                          this component (``{c: 1}``; ``-1``: ``{}``), or
``counts``                one ``component_sample_counts`` dict per row
``token_counts``          ``None`` or one ``component_token_counts`` per row
``tomb``                  ``None`` (no tombstone) or bool ``(n,)``, with
                          ``reason``/``detail`` per row
``contributors``          :class:`Contributors`: the contributor table of
                          packed rows (a row with no entry is its own, sole
                          contributor)
``packing``               ``None`` or one ``_packing_metadata`` dict per row
``extra``                 ``None`` or, per row, tags beyond the reserved ones
``payloads`` / ``fields``  the payloads: one object per row, or, for dict
                          payloads with the same keys, one column per key (a
                          :class:`Ragged` integer column for token fields, a
                          2-D array for fixed-length rows, a list otherwise)
========================  ==================================================

Tombstones are rows (``tomb``); their payload is ``None``. Flush sentinels
are not rows: they travel between blocks as :class:`Sentinel` items.

The block's neighbours hold what it is made of: :mod:`zephon_torch.block_columns`
(ragged and other payload columns), :mod:`zephon_torch.block_ids` (the ids
layout, component counts, the contributor table),
:mod:`zephon_torch.block_records` (records to columns),
:mod:`zephon_torch.block_join` (concatenating and gathering blocks) and
:mod:`zephon_torch.block_views` (the batches and rows the consumer hands out).

Example: the records of chunk 3 of lane 1 after ``tokenize``::

    ids     [[0, 2, 17, 3, 0],      fields {"text": ["a b", "", "c"],
             [0, 2, 40, 3, 1],              "input_ids": Ragged(values=[5, 6, 1, 7, 1],
             [0, 2, 9,  3, 2]]                                  offsets=[0, 3, 3, 5])}
    tomb    [F, T, F]   reason [None, "empty", None]

    record(0) == SampleRecord(SampleMeta((0, 2, 17), 1, 3, 0, {0: 1}),
                              {"text": "a b", "input_ids": array([5, 6, 1])})
    record(1) is a tombstone (reason "empty", payload None)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from zephon_torch.block_columns import (
    column_slice,
    column_take,
    fields_of_payloads,
    payloads_of_fields,
)
from zephon_torch.block_ids import (
    ID_CHUNK,
    ID_DATASET,
    ID_LOCAL,
    ID_OFFSET,
    ID_SHARD,
    NO_COUNTS,
    Contributors,
    unit_counts,
)
from zephon_torch.block_join import concat_blocks, gather_arrays
from zephon_torch.block_records import record_columns
from zephon_torch.types import SampleMeta, SampleRecord, metas_from_columns, records_from_columns
from zephon_torch.vocab import (
    CONTRIBUTORS_TAG,
    FLUSH_SENTINEL_TAG,
    PACKING_METADATA_TAG,
    TOMBSTONE_DETAIL_TAG,
    TOMBSTONE_REASON_TAG,
    TOMBSTONE_TAG,
)

# The ID_* columns live in block_ids.py; they are named here too for the modules that
# import them from here.
__all__ = [
    "ID_CHUNK",
    "ID_DATASET",
    "ID_LOCAL",
    "ID_OFFSET",
    "ID_SHARD",
    "Block",
    "Sentinel",
    "blocks_from_elements",
    "blocks_from_records",
]



class Sentinel(NamedTuple):
    """A flush sentinel between blocks: lane ``lane`` reaches the epoch boundary ``boundary``."""

    lane: int
    boundary: int

    def record(self) -> SampleRecord:
        """The sentinel as the object path's record (what a user accumulator would see)."""
        meta = SampleMeta((-1, -1, -1), self.lane, self.boundary, 0, None, None, (),
                          {FLUSH_SENTINEL_TAG: True})
        return SampleRecord(meta, None)


# --------------------------------------------------------------------------- the block


class Block:
    """The records of one lane and one micro-batch, as columns (see the module doc).

    Blocks are treated as immutable: every operation returns a new block,
    sharing what it did not change. Build them with :meth:`from_records`, or
    directly from columns (sources and built-in operators).

    Args:
        lane: The lane of every row.
        ids: int64 ``(n, 5)``: dataset, shard, local id, chunk id, chunk offset.
        payloads: One payload per row (``None`` for tombstones); or ``None``
            with ``fields``.
        fields: Dict payloads as columns (every data row's payload is
            ``{key: column[row]}``, in the keys' order).
        lineage: ``None`` or one lineage tuple per row.
        component: int64 ``(n,)`` component per row, meaning ``{c: 1}``
            (``-1``: ``{}``); ignored when ``counts`` is given.
        counts: One ``component_sample_counts`` dict per row.
        token_counts: ``None`` or one ``component_token_counts`` per row.
        tomb: ``None`` or bool ``(n,)``: the tombstone rows.
        reason, detail: Per row, the tombstone reason and detail (``None``
            where absent).
        contributors: The contributor table, or ``None`` (every row plain).
        packing: ``None`` or one ``_packing_metadata`` dict (or ``None``) per row.
        extra: ``None`` or, per row, a dict of further tags (or ``None``).
    """

    __slots__ = ("component", "contributors", "counts", "detail", "extra", "fields", "ids",
                 "lane", "lineage", "packing", "payloads", "reason", "token_counts", "tomb")

    def __init__(
        self,
        lane: int,
        ids: np.ndarray,
        *,
        payloads: list[Any] | None = None,
        fields: dict[str, Any] | None = None,
        lineage: list[tuple[int, ...]] | None = None,
        component: np.ndarray | None = None,
        counts: list[dict[int, int]] | None = None,
        token_counts: list[dict[int, int] | None] | None = None,
        tomb: np.ndarray | None = None,
        reason: list[str | None] | None = None,
        detail: list[str | None] | None = None,
        contributors: Contributors | None = None,
        packing: list[dict[str, Any] | None] | None = None,
        extra: list[dict[str, Any] | None] | None = None,
    ) -> None:
        if (payloads is None) == (fields is None):
            raise ValueError("a block holds its payloads as objects or as fields, not both")
        self.lane = int(lane)
        self.ids = ids
        self.payloads = payloads
        self.fields = fields
        self.lineage = lineage
        self.component = component
        self.counts = counts
        self.token_counts = token_counts
        self.tomb = tomb if tomb is not None and tomb.any() else None
        self.reason = reason if self.tomb is not None else None
        self.detail = detail if self.tomb is not None else None
        self.contributors = contributors
        self.packing = packing
        self.extra = extra

    # ------------------------------------------------------------------ basics

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        kinds = (f"fields {list(self.fields)}" if self.fields is not None else "objects")
        tombs = 0 if self.tomb is None else int(self.tomb.sum())
        return f"Block(lane={self.lane}, rows={len(self)}, tombstones={tombs}, {kinds})"

    @property
    def chunk_ids(self) -> np.ndarray:
        """The ``chunk_id`` of every row."""
        return self.ids[:, ID_CHUNK]

    def data_mask(self) -> np.ndarray:
        """True for the rows that are data (not tombstones)."""
        if self.tomb is None:
            return np.ones(len(self), dtype=bool)
        return ~self.tomb

    def has_tombstones(self) -> bool:
        """Whether any row is a tombstone."""
        return self.tomb is not None

    def num_data(self) -> int:
        """Rows that are data."""
        return len(self) if self.tomb is None else int(len(self) - self.tomb.sum())

    # ------------------------------------------------------------------ payload access

    def payload(self, i: int) -> Any:
        """The payload of row ``i`` (``None`` for a tombstone)."""
        if self.payloads is not None:
            return self.payloads[i]
        if self.tomb is not None and self.tomb[i]:
            return None
        return {key: column[i] for key, column in self.fields.items()}

    def payload_list(self) -> list[Any]:
        """Every row's payload, in order (``None`` for tombstones)."""
        if self.payloads is not None:
            return list(self.payloads)
        return payloads_of_fields(self.fields, self.tomb)

    def columnar(self) -> Block:
        """The same rows with their dict payloads as columns, where they allow it.

        Every data row's payload must be a dict with the same keys; a field
        whose values are all 1-D integer arrays becomes a
        :class:`~zephon_torch.block_columns.Ragged` column (one copy), any
        other field a list. Otherwise the block is returned as it is.
        """
        if self.fields is not None or self.payloads is None:
            return self
        fields = fields_of_payloads(self.payloads, self.tomb)
        return self if fields is None else self.with_fields(fields)

    def with_payloads(self, payloads: list[Any]) -> Block:
        """The same rows with new payload objects (one per row)."""
        # Slot by slot, not through the keyword constructor: a map stage calls this
        # once per block, and nothing else changes.
        out = object.__new__(Block)
        for name in _SHARED:
            setattr(out, name, getattr(self, name))
        out.payloads = payloads
        out.fields = None
        return out

    def with_fields(self, fields: dict[str, Any]) -> Block:
        """The same rows with new payload columns."""
        return self._replace(payloads=None, fields=fields)

    # ------------------------------------------------------------------ metas and records

    def _counts_list(self) -> list[dict[int, int]]:
        if self.counts is not None:
            return self.counts
        component = self.component
        n = len(self)
        if component is None:
            return [NO_COUNTS] * n
        if n and component[0] == component[-1] and bool((component == component[0]).all()):
            return [unit_counts(int(component[0]))] * n  # the usual block: one component
        return [unit_counts(c) for c in component.tolist()]

    def tags(self, i: int) -> dict[str, Any]:
        """The ``tags`` dict of row ``i``'s meta (built from the columns)."""
        tags: dict[str, Any] = {}
        contributors = self.contributors
        if contributors is not None and contributors.offsets[i] != contributors.offsets[i + 1]:
            tags[CONTRIBUTORS_TAG] = contributors.refs(i)
        if self.packing is not None and self.packing[i] is not None:
            tags[PACKING_METADATA_TAG] = self.packing[i]
        if self.tomb is not None and self.tomb[i]:
            tags[TOMBSTONE_TAG] = True
            if self.reason is not None and self.reason[i] is not None:
                tags[TOMBSTONE_REASON_TAG] = self.reason[i]
            if self.detail is not None and self.detail[i] is not None:
                tags[TOMBSTONE_DETAIL_TAG] = self.detail[i]
        if self.extra is not None and self.extra[i]:
            tags.update(self.extra[i])
        return tags

    def _plain(self) -> bool:
        return (self.contributors is None and self.packing is None and self.tomb is None
                and self.extra is None)

    def _meta_columns(self) -> tuple[list[list[int]], list[dict[int, int]], Any, Any, Any]:
        """What every row's meta is made of: the id columns, counts, token counts,
        lineage, tags."""
        tags = None
        if not self._plain():
            tags = [self.tags(i) or None for i in range(len(self))]
        return self.ids.T.tolist(), self._counts_list(), self.token_counts, self.lineage, tags

    def metas(self) -> list[SampleMeta]:
        """Every row's :class:`~zephon_torch.types.SampleMeta`, in order."""
        columns, counts, tokens, lineage, tags = self._meta_columns()
        return metas_from_columns(itertools.repeat(self.lane), columns, counts, tokens, lineage,
                                  tags)

    def records(self) -> list[SampleRecord]:
        """Every row as a :class:`~zephon_torch.types.SampleRecord`, in order."""
        columns, counts, tokens, lineage, tags = self._meta_columns()
        payloads = self.payloads if self.payloads is not None else self.payload_list()
        return records_from_columns(itertools.repeat(self.lane), columns, counts, payloads,
                                    tokens, lineage, tags)

    def record(self, i: int) -> SampleRecord:
        """Row ``i`` as a record."""
        return self.slice(i, i + 1).records()[0]

    def cursor_key(self, i: int) -> tuple[int, int, tuple[int, ...], tuple[int, int, int]]:
        """Row ``i``'s cursor key ``(chunk_id, chunk_offset, lineage, sample_id)``."""
        d, s, loc, c, o = self.ids[i].tolist()
        lineage = self.lineage[i] if self.lineage is not None else ()
        return (c, o, lineage, (d, s, loc))

    # ------------------------------------------------------------------ accounting

    def close_counts(self) -> np.ndarray:
        """How many base offsets each row closes (int64, one per row)."""
        contributors = self.contributors
        if contributors is None:
            return np.ones(len(self), dtype=np.int64)
        running = np.zeros(len(contributors.last) + 1, dtype=np.int64)
        np.cumsum(contributors.last, out=running[1:])
        offsets = contributors.offsets
        closes = running[offsets[1:]] - running[offsets[:-1]]
        return np.where(offsets[1:] > offsets[:-1], closes, 1)

    def closed_offsets(self, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(chunk_ids, offsets)`` of the base offsets closed by ``rows`` (all rows by default)."""
        block = self if rows is None else self.slice(rows.start or 0,
                                                     len(self) if rows.stop is None
                                                     else rows.stop)
        ids, contributors = block.ids, block.contributors
        if contributors is None:
            return ids[:, ID_CHUNK], ids[:, ID_OFFSET]
        own = contributors.counts() == 0
        entries = contributors.ids[contributors.last]
        chunks = np.concatenate([ids[own, ID_CHUNK], entries[:, ID_CHUNK]])
        offsets = np.concatenate([ids[own, ID_OFFSET], entries[:, ID_OFFSET]])
        return chunks, offsets

    # ------------------------------------------------------------------ reshaping

    def _replace(self, **changes: Any) -> Block:
        state = {name: getattr(self, name) for name in self.__slots__ if name not in ("lane",
                                                                                      "ids")}
        state.update(changes)
        lane = state.pop("lane", self.lane)
        ids = state.pop("ids", self.ids)
        return Block(lane, ids, **state)

    def slice(self, start: int, stop: int) -> Block:
        """Rows ``start..stop-1`` (sharing arrays where it can)."""
        if start == 0 and stop >= len(self):
            return self
        cut = slice(start, stop)
        # Filled slot by slot: a batch is a slice of its block, and this is cheaper
        # than the keyword constructor (what it checks holds for a slice already).
        out = object.__new__(Block)
        out.lane = self.lane
        out.ids = self.ids[cut]
        out.payloads = None if self.payloads is None else self.payloads[cut]
        out.fields = None if self.fields is None else {
            k: column_slice(c, start, stop) for k, c in self.fields.items()}
        out.lineage = None if self.lineage is None else self.lineage[cut]
        out.component = None if self.component is None else self.component[cut]
        out.counts = None if self.counts is None else self.counts[cut]
        out.token_counts = None if self.token_counts is None else self.token_counts[cut]
        tomb = None if self.tomb is None else self.tomb[cut]
        if tomb is not None and tomb.any():
            out.tomb = tomb
            out.reason = None if self.reason is None else self.reason[cut]
            out.detail = None if self.detail is None else self.detail[cut]
        else:
            out.tomb = out.reason = out.detail = None
        out.contributors = (None if self.contributors is None
                            else self.contributors.slice(start, stop))
        out.packing = None if self.packing is None else self.packing[cut]
        out.extra = None if self.extra is None else self.extra[cut]
        return out

    def take(self, index: Sequence[int] | np.ndarray) -> Block:
        """The rows ``index``, in that order."""
        index = np.asarray(index, dtype=np.int64)
        listed = index.tolist()

        def pick(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[i] for i in listed]

        return Block(
            self.lane, self.ids[index],
            payloads=pick(self.payloads),
            fields=None if self.fields is None else
            {k: column_take(c, index) for k, c in self.fields.items()},
            lineage=pick(self.lineage),
            component=None if self.component is None else self.component[index],
            counts=pick(self.counts),
            token_counts=pick(self.token_counts),
            tomb=None if self.tomb is None else self.tomb[index],
            reason=pick(self.reason),
            detail=pick(self.detail),
            contributors=None if self.contributors is None else self.contributors.take(index),
            packing=pick(self.packing),
            extra=pick(self.extra),
        )

    @staticmethod
    def concat(blocks: Sequence[Block]) -> Block:
        """The rows of every block, in order (all of one lane)."""
        blocks = [b for b in blocks if len(b)] or list(blocks[:1])
        if len(blocks) == 1:
            return blocks[0]
        lane = blocks[0].lane
        if any(b.lane != lane for b in blocks):
            raise ValueError(f"cannot concatenate blocks of lanes "
                             f"{sorted({b.lane for b in blocks})}: a block holds one lane")
        return Block(lane, np.concatenate([b.ids for b in blocks]), **concat_blocks(blocks))

    @staticmethod
    def gather(pool: Sequence[Block], owners: Sequence[int], rows: Sequence[int]) -> Block:
        """Rows of several blocks of one lane as one block: row ``rows[i]`` of block
        ``pool[owners[i]]``, in that order.

        Array columns are assembled in place (one copy of each row); where the
        blocks differ in layout, one ``take`` per block, then the order.
        """
        owner = np.asarray(owners, dtype=np.int64)
        row = np.asarray(rows, dtype=np.int64)
        groups = np.unique(owner)
        if len(groups) == 1:
            return pool[int(groups[0])].take(row)
        blocks = [pool[b] for b in groups.tolist()]
        direct = gather_arrays(blocks, groups, owner, row)
        if direct is not None:
            ids, columns = direct
            return Block(blocks[0].lane, ids, **columns)
        order = np.argsort(owner, kind="stable")
        parts = [pool[b].take(row[order[owner[order] == b]]) for b in groups.tolist()]
        joined = Block.concat(parts)
        back = np.empty(len(order), dtype=np.int64)
        back[order] = np.arange(len(order), dtype=np.int64)
        return joined.take(back)

    def split_at(self, cut: int) -> tuple[Block, Block]:
        """``(rows before cut, rows from cut)``."""
        return self.slice(0, cut), self.slice(cut, len(self))

    # ------------------------------------------------------------------ tombstones

    def with_tombstones(self, mask: np.ndarray, reason: str | Sequence[str],
                        detail: Sequence[str | None] | str | None = None) -> Block:
        """Turn the rows of ``mask`` into tombstones (rows already tombstones keep theirs).

        Args:
            mask: bool ``(n,)``.
            reason: One reason for every new tombstone, or one per row.
            detail: ``None``, one detail for all, or one per row.
        """
        mask = np.asarray(mask, dtype=bool)
        if self.tomb is not None:
            mask = mask & ~self.tomb
        if not mask.any():
            return self
        n = len(self)
        tomb = mask if self.tomb is None else (self.tomb | mask)
        reasons = list(self.reason) if self.reason is not None else [None] * n
        details = list(self.detail) if self.detail is not None else [None] * n
        for i in np.flatnonzero(mask).tolist():
            reasons[i] = reason if isinstance(reason, str) else reason[i]
            details[i] = detail if detail is None or isinstance(detail, str) else detail[i]
        payloads = self.payloads
        if payloads is not None:
            payloads = [None if m else p for p, m in zip(payloads, mask.tolist())]
        return self._replace(tomb=tomb, reason=reasons, detail=details, payloads=payloads)

    # ------------------------------------------------------------------ from records

    @classmethod
    def from_records(cls, records: Sequence[SampleRecord], lane: int | None = None) -> Block:
        """A block holding ``records`` (all of one lane, no flush sentinels), in order.

        ``block.records()`` gives records equal to ``records``, field for field.

        Raises:
            ValueError: The records span several lanes, or one is a flush sentinel.
        """
        lane, ids, columns = record_columns(records, lane)
        return cls(lane, ids, **columns)

    # ------------------------------------------------------------------ pickling

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_restore, (self.lane, self.ids, tuple(getattr(self, name) for name in _STATE)))


_STATE = ("payloads", "fields", "lineage", "component", "counts", "token_counts", "tomb",
          "reason", "detail", "contributors", "packing", "extra")
#: What :meth:`Block.with_payloads` keeps.
_SHARED = ("lane", "ids", "lineage", "component", "counts", "token_counts", "tomb", "reason",
           "detail", "contributors", "packing", "extra")


def _restore(lane: int, ids: np.ndarray, state: tuple[Any, ...]) -> Block:
    return Block(lane, ids, **dict(zip(_STATE, state)))


def blocks_from_records(records: Iterable[SampleRecord]) -> list[Block]:
    """Blocks of the records, one per lane (in order of first appearance), order kept."""
    by_lane: dict[int, list[SampleRecord]] = {}
    for record in records:
        by_lane.setdefault(record.meta.lane_id, []).append(record)
    return [Block.from_records(rs, lane) for lane, rs in by_lane.items()]


def blocks_from_elements(elems: Sequence[Any], stage: str = "") -> list[Block]:
    """Blocks of a list of records, one per run of records of one lane (order kept).

    Raises:
        TypeError: An element is not a ``SampleRecord`` (a ``SampleBatch``
            before ``batch()`` means an operator is out of place).
        ValueError: A flush sentinel among them (sentinels travel between blocks).
    """
    blocks: list[Block] = []
    run: list[SampleRecord] = []
    lane = None
    for elem in elems:
        if type(elem) is not SampleRecord and not isinstance(elem, SampleRecord):
            where = f" from stage {stage!r}" if stage else ""
            raise TypeError(
                f"a {type(elem).__name__}{where} reached a stage that takes records; place "
                "record operators before batch()"
            )
        if elem.meta.lane_id != lane and run:
            blocks.append(Block.from_records(run, lane))
            run = []
        lane = elem.meta.lane_id
        run.append(elem)
    if run:
        blocks.append(Block.from_records(run, lane))
    return blocks
