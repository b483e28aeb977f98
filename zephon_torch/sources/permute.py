"""Seeded permutations that need no memory: a Feistel network with cycle walking.

Shuffling the samples of a shard with ``rng.permutation(n)`` costs ``8 n``
bytes per shard and ties the order to numpy's generator. Instead, the
position ``i`` of a shard maps to ``permute(i, n, key)``, a bijection of
``[0, n)`` computed on demand:

Shards of up to 65,536 samples use an argsort of keyed hashes instead (a
uniform permutation, at most half a megabyte, cached). Larger ones:

1. Pick ``h`` with ``4**h >= n``; split ``i`` into two ``h``-bit halves.
2. Run four Feistel rounds ``(L, R) -> (R, L ^ F(R, key, round))``, where
   ``F`` is a 64-bit mixing hash. Each round is invertible, so the result is
   a permutation of ``[0, 4**h)``.
3. Cycle walking: while the result is ``>= n``, apply the network again. A
   permutation restricted this way stays a bijection of ``[0, n)``.

Everything is vectorised over arrays of positions with numpy ``uint64``
arithmetic (which wraps), so results are the same on every platform and
every numpy version: the golden tests pin them.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["mix64", "permute", "seed_key"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1
_ROUNDS = 4


def mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijective 64-bit mixing of ``x`` (uint64)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def seed_key(*parts: int) -> int:
    """Fold integers (seed, pass, dataset, shard ...) into one 64-bit key."""
    acc = np.uint64(0x6A09E667F3BCC909)
    for part in parts:
        value = np.uint64(int(part) & _MASK64)
        acc = mix64(np.asarray(acc ^ value, dtype=np.uint64))[()]
    return int(acc)


# Up to this size a permutation is an argsort of keyed hashes: uniform, and a
# few hundred KB at most. Feistel networks on tiny domains are far from uniform.
_SMALL = 1 << 16


@functools.lru_cache(maxsize=64)
def _small_permutation(n: int, key: int) -> np.ndarray:
    salt = np.uint64(seed_key(key, n))
    hashes = mix64(np.arange(n, dtype=np.uint64) ^ salt)
    perm = np.argsort(hashes, kind="stable")
    perm.flags.writeable = False
    return perm


@functools.lru_cache(maxsize=4096)
def _round_keys(key: int) -> tuple[np.uint64, ...]:
    return tuple(np.uint64(seed_key(key, r)) for r in range(_ROUNDS))


def permute(positions: np.ndarray | int, n: int, key: int) -> np.ndarray:
    """Map positions in ``[0, n)`` through the seeded bijection of ``[0, n)``.

    Args:
        positions: Integer array (or scalar) of positions, each in ``[0, n)``.
        n: Size of the permuted range.
        key: 64-bit key (see :func:`seed_key`); each key gives its own order.

    Returns:
        An int64 array of the permuted positions, same shape as ``positions``.
    """
    pos = np.asarray(positions, dtype=np.int64)
    if n <= 1:
        return pos.copy()
    if n <= _SMALL:
        return _small_permutation(n, key)[pos]
    half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)
    half_mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    round_keys = _round_keys(key)
    x = pos.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while True:
        left, right = x >> shift, x & half_mask
        for rk in round_keys:
            left, right = right, left ^ (mix64(right ^ rk) & half_mask)
        walked = (left << shift) | right
        x = np.where(todo, walked, x)
        todo = x >= np.uint64(n)
        if not todo.any():
            return x.astype(np.int64)
