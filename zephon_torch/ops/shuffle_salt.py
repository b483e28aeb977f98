"""The shuffle's salts: a 64-bit hash of each element's cursor key and the seed.

Every random choice of :mod:`zephon_torch.ops.shuffle` is one of these
hashes, so an order depends on the elements and the seed alone, never on how
the stream was cut into calls (that module's doc has the formula and the
algorithms that use it). Here are the salt of a record (:func:`salt_of`) and
of every row of a block at once (:func:`block_salts`, bit for bit the same),
the reservoir slot an arrival evicts (:func:`eviction_slots`), and the orders
by salt of a block's rows (:func:`order_block`) and of a list of elements
(:func:`order_by_salt`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from zephon_torch.block import ID_CHUNK, ID_DATASET, ID_LOCAL, ID_OFFSET, ID_SHARD, Block
from zephon_torch.ops.base import Element
from zephon_torch.sources.permute import mix64, seed_key
from zephon_torch.types import CursorKey, SampleBatch

__all__ = [
    "block_salts",
    "cursor_key_of",
    "eviction_slots",
    "fold",
    "order_block",
    "order_by_salt",
    "salt_of",
    "shuffle_prefix",
]

# Keeps shuffle hashes apart from other users of seed_key with the same seed
# (the sources fold (seed, pass, dataset, ...)): "shuffle" in ASCII.
_DOMAIN = 0x73687566666C65
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _mix(x: int) -> int:
    # The scalar twin of permute.mix64 in plain integers: the numpy version
    # costs ~3 us per call on 0-d arrays, and the reservoir hashes every
    # arrival. The tests pin that both agree bit for bit.
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def fold(acc: int, parts: Iterable[int]) -> int:
    """Fold ``parts`` onto the hash ``acc``, continuing seed_key's fold.

    ``seed_key(*a, *b) == fold(seed_key(*a), b)``.
    """
    for part in parts:
        acc = _mix(acc ^ (int(part) & _MASK64))
    return acc


def cursor_key_of(elem: Element) -> CursorKey:
    """The cursor key an element is hashed and ordered by (a batch: its first record's)."""
    if isinstance(elem, SampleBatch):
        # A batch is named by its first record (records are unique, so are
        # the first records of distinct batches).
        if not elem.records:
            raise ValueError("shuffle cannot order an empty SampleBatch")
        return elem.records[0].meta.as_cursor_key()
    return elem.meta.as_cursor_key()


def shuffle_prefix(seed: int) -> int:
    """The fold state every salt of ``seed`` starts from (``seed_key(DOMAIN, seed)``)."""
    return seed_key(_DOMAIN, seed)


def salt_of(prefix: int, elem: Element) -> int:
    """The 64-bit salt of an element: its cursor key hashed onto ``prefix``.

    Args:
        prefix: :func:`shuffle_prefix` of the seed.
        elem: A record (or a batch, named by its first record).

    Returns:
        ``seed_key(DOMAIN, seed, chunk_id, chunk_offset, len(lineage),
        *lineage, *sample_id)`` as a Python int.
    """
    chunk_id, chunk_offset, lineage, sample_id = cursor_key_of(elem)
    return fold(prefix, (chunk_id, chunk_offset, len(lineage), *lineage, *sample_id))


def block_salts(prefix: int, block: Block) -> np.ndarray:
    """:func:`salt_of` of every row of a block, as uint64, with array operations."""
    ids = block.ids.astype(np.uint64)
    n = len(block)
    acc = np.full(n, prefix, dtype=np.uint64)
    lineage = block.lineage
    lengths = (np.zeros(n, dtype=np.int64) if lineage is None
               else np.fromiter(map(len, lineage), dtype=np.int64, count=n))
    acc = mix64(acc ^ ids[:, ID_CHUNK])
    acc = mix64(acc ^ ids[:, ID_OFFSET])
    acc = mix64(acc ^ lengths.astype(np.uint64))
    tail = (ID_DATASET, ID_SHARD, ID_LOCAL)
    for depth in np.unique(lengths).tolist():
        rows = np.flatnonzero(lengths == depth)
        part = acc[rows]
        if depth:
            paths = np.array([lineage[r] for r in rows.tolist()], dtype=np.int64)  # type: ignore[index]
            for d in range(depth):
                part = mix64(part ^ paths[:, d].astype(np.uint64))
        for column in tail:
            part = mix64(part ^ ids[rows, column])
        acc[rows] = part
    return acc


def eviction_slots(salts: np.ndarray, lane: int, first_eviction: int, size: int) -> np.ndarray:
    """The reservoir slot each arrival evicts: ``fold(salt, (lane, n, size))`` mapped onto
    ``[0, size)`` by multiply-shift, for evictions ``n = first_eviction, ...``."""
    count = len(salts)
    evictions = np.arange(first_eviction, first_eviction + count, dtype=np.uint64)
    h = mix64(salts ^ np.uint64(lane & _MASK64))
    h = mix64(h ^ evictions)
    h = mix64(h ^ np.uint64(size))
    # (h * size) >> 64 without 128-bit arithmetic (size < 2**32).
    size64 = np.uint64(size)
    high, low = h >> np.uint64(32), h & np.uint64(0xFFFFFFFF)
    return ((high * size64 + ((low * size64) >> np.uint64(32))) >> np.uint64(32)).astype(np.int64)


def order_block(block: Block, prefix: int) -> np.ndarray:
    """The row order of :func:`order_by_salt` for a block: by salt, ties by cursor key."""
    salts = block_salts(prefix, block)
    order = np.argsort(salts, kind="stable")
    ranked = salts[order]
    if len(ranked) > 1 and bool((ranked[1:] == ranked[:-1]).any()):
        keyed = sorted((int(salt), block.cursor_key(i), i) for i, salt in enumerate(salts))
        order = np.array([i for _, _, i in keyed], dtype=np.int64)
    return order


def order_by_salt(elems: Sequence[Element], prefix: int) -> list[Element]:
    """Sort elements by ``(salt, cursor key)``: a permutation fixed by the set alone.

    The cursor key only breaks (astronomically unlikely) salt collisions.
    """
    keyed = [(salt_of(prefix, e), cursor_key_of(e), i) for i, e in enumerate(elems)]
    keyed.sort()
    return [elems[i] for _, _, i in keyed]
