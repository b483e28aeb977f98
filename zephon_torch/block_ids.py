"""Who a block's rows are: the layout of the ids array, component counts, contributors.

Every row of a :class:`~zephon_torch.block.Block` is named by one row of an
int64 ``(n, 5)`` array (the ``ID_*`` columns: ``sample_id`` parts, then the
cursor's chunk and offset). A row usually counts as one sample of one
component (``{c: 1}``, shared per component as the object path shares one
dict per dataset). A packed row instead lists the documents it is made of in
a :class:`Contributors` table: the ``ContributorRef`` tuples of the object
path, held as arrays with per-row offsets.

Example: two packed rows, the first of documents ``(0, 0, 4)`` and
``(0, 0, 5)``, the second of the first piece of ``(0, 0, 6)``::

    offsets [0, 2, 3]
    ids     [[0, 0, 4, 0, 4], [0, 0, 5, 0, 5], [0, 0, 6, 0, 6]]
    lineage [(), (), (0,)]    last [True, True, False]

Row 1 closes nothing yet: the document's last piece is still to come (the
piece is child 0 of its document, hence its lineage).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from zephon_torch.block_columns import gather_runs
from zephon_torch.types import ContributorRef, SampleCursor

__all__ = [
    "EMPTY_IDS",
    "ID_CHUNK",
    "ID_DATASET",
    "ID_LOCAL",
    "ID_OFFSET",
    "ID_SHARD",
    "NO_COUNTS",
    "Contributors",
    "unit_counts",
]

#: Columns of :attr:`Block.ids <zephon_torch.block.Block.ids>`.
ID_DATASET, ID_SHARD, ID_LOCAL, ID_CHUNK, ID_OFFSET = range(5)
#: The ids of no row.
EMPTY_IDS = np.zeros((0, 5), dtype=np.int64)
#: The counts of a row that stands for no sample (a component of ``-1``).
NO_COUNTS: dict[int, int] = {}
# One shared ``{c: 1}`` per component, as the object path shares one per dataset.
_UNIT_COUNTS: dict[int, dict[int, int]] = {}


def unit_counts(component: int) -> dict[int, int]:
    """The shared ``component_sample_counts`` of one sample of ``component`` (``{}`` if < 0)."""
    counts = _UNIT_COUNTS.get(component)
    if counts is None:
        counts = _UNIT_COUNTS[component] = {} if component < 0 else {component: 1}
    return counts


class Contributors:
    """The contributor table of a block: ``ContributorRef`` lists as arrays.

    Row ``r`` of the block lists the entries ``offsets[r]:offsets[r + 1]``; a
    row with no entry is a plain record (its own sole contributor). Each entry
    is a cursor (``ids``: dataset, shard, local, chunk, offset, and
    ``lineage``) and whether it is the last child closing its base offset
    (``last``).
    """

    __slots__ = ("ids", "last", "lineage", "offsets")

    def __init__(self, offsets: np.ndarray, ids: np.ndarray, lineage: list[tuple] | None,
                 last: np.ndarray) -> None:
        self.offsets = offsets
        self.ids = ids
        self.lineage = lineage
        self.last = last

    @classmethod
    def empty(cls, n: int) -> Contributors:
        """A table of ``n`` rows without entries."""
        return cls(np.zeros(n + 1, dtype=np.int64), EMPTY_IDS, None, np.zeros(0, dtype=bool))

    def counts(self) -> np.ndarray:
        """Entries per row."""
        return np.diff(self.offsets)

    def refs(self, row: int) -> tuple[ContributorRef, ...]:
        """The ``ContributorRef`` tuple of one row (empty for a plain row)."""
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        if a == b:
            return ()
        ids = self.ids[a:b].tolist()
        lineage = self.lineage[a:b] if self.lineage is not None else itertools.repeat(())
        last = self.last[a:b].tolist()
        return tuple(ContributorRef(SampleCursor(c, o, (d, s, loc), lin), is_last)
                     for (d, s, loc, c, o), lin, is_last in zip(ids, lineage, last))

    def take(self, index: np.ndarray) -> Contributors:
        """The rows ``index``, in that order."""
        offsets, gather = gather_runs(self.offsets, index)
        lineage = None if self.lineage is None else [self.lineage[g] for g in gather.tolist()]
        return Contributors(offsets, self.ids[gather], lineage, self.last[gather])

    def slice(self, start: int, stop: int) -> Contributors:
        """Rows ``start..stop-1``."""
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        lineage = None if self.lineage is None else self.lineage[a:b]
        return Contributors(self.offsets[start:stop + 1] - a, self.ids[a:b], lineage,
                            self.last[a:b])

    @staticmethod
    def gather(tables: Mapping[int, Contributors],
               picks: Sequence[tuple[int, int]]) -> Contributors:
        """Row ``r`` of table ``b`` for each ``(b, r)`` of ``picks``, in that order."""
        starts = [int(tables[b].offsets[r]) for b, r in picks]
        stops = [int(tables[b].offsets[r + 1]) for b, r in picks]
        lengths = np.array([b - a for a, b in zip(starts, stops)], dtype=np.int64)
        offsets = np.zeros(len(picks) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = [tables[b].ids[a:e] for (b, _), a, e in zip(picks, starts, stops)]
        last = [tables[b].last[a:e] for (b, _), a, e in zip(picks, starts, stops)]
        lineage = None
        if any(t.lineage is not None for t in tables.values()):
            lineage = []
            for (b, _), a, e in zip(picks, starts, stops):
                table = tables[b]
                lineage.extend(table.lineage[a:e] if table.lineage is not None
                               else [()] * (e - a))
        return Contributors(offsets, np.concatenate(ids) if ids else EMPTY_IDS, lineage,
                            np.concatenate(last) if last else np.zeros(0, dtype=bool))

    @staticmethod
    def concat(parts: Sequence[Contributors]) -> Contributors:
        """The rows of every part, in order."""
        if len(parts) == 1:
            return parts[0]
        sizes = [int(p.offsets[-1]) for p in parts]
        offsets = np.zeros(sum(len(p.offsets) - 1 for p in parts) + 1, dtype=np.int64)
        pos, base = 1, 0
        for p, size in zip(parts, sizes):
            n = len(p.offsets) - 1
            offsets[pos:pos + n] = p.offsets[1:] + base
            base += size
            pos += n
        lineage = None
        if any(p.lineage is not None for p in parts):
            lineage = []
            for p, size in zip(parts, sizes):
                lineage.extend(p.lineage if p.lineage is not None else [()] * size)
        return Contributors(offsets, np.concatenate([p.ids for p in parts]), lineage,
                            np.concatenate([p.last for p in parts]))
