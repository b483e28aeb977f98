"""Small in-process caches and locks that the readers share between threads.

:class:`LRUCache` keeps recently used values (a JSONL file's line index, a
Parquet file's metadata), :class:`ReadOnceCache` keeps the read unit a pass
is taking rows from (a row group, a block of lines) until all its rows are
read, and :class:`KeyedLocks` lets one thread decode what another would
otherwise decode too. None of them carries its contents into a pickle:
datasets travel to worker processes, their caches start empty there.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

__all__ = ["KeyedLocks", "LRUCache", "ReadOnceCache"]


class _Cache:
    """What the caches share: a size, and a pickle without contents (``capacity`` only)."""

    capacity: int
    _data: OrderedDict[Any, Any]

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def _store(self, key: Any, entry: Any) -> None:
        # Keep ``entry`` as the most recently used, then evict beyond the capacity.
        with self._lock:
            self._data[key] = entry
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity": self.capacity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"])  # type: ignore[misc]


class LRUCache(_Cache):
    """A small thread-safe LRU map; its contents are not pickled.

    Values are computed outside the lock (two threads may both compute a
    missing value; the result is the same and one copy wins).
    """

    def get(self, key: Any) -> Any:
        """The value for ``key``, or None."""
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        """Store ``value``, evicting the least recently used entries."""
        self._store(key, value)


class ReadOnceCache(_Cache):
    """A small thread-safe LRU of decoded read units that forgets a unit once all its
    rows have been read; its contents are not pickled.

    A reader keeps the unit it decoded last per shard (a Parquet row group,
    a block of JSONL lines), because a pass reads a unit's rows in several
    consecutive calls. Once those calls have taken as many rows as the unit
    holds, the pass has no more use for it; kept until the LRU evicted it,
    it would hold a decoded unit for each of the last ``capacity`` shards
    read, which a corpus of few shards never fills and a large one always
    does. Example, a row group of 1,000 rows read in micro-batches of 512::

        put(shard, group, rows=1000)   # decoded: 1000 rows to go
        spend(shard, group, 512)       # 488 to go
        spend(shard, group, 488)       # 0: forgotten, its memory is freed

    The count is a hint, never a correctness matter: a row read twice (a
    replay) makes the unit go early and a later read decode it again; rows
    never read leave it to the LRU, as before.

    Args:
        capacity: Units kept at most (the least recently used goes first).
    """

    # _data: key -> [unit, value, rows still to read]

    def get(self, key: Any, unit: Any) -> Any:
        """The value of ``unit`` under ``key`` if it is the one kept, else None."""
        with self._lock:
            entry = self._data.get(key)
            if entry is None or entry[0] != unit:
                return None
            self._data.move_to_end(key)
            return entry[1]

    def put(self, key: Any, unit: Any, value: Any, rows: int) -> None:
        """Keep ``value`` (unit ``unit`` of ``rows`` rows) under ``key``, replacing what
        was there and evicting the least recently used entries."""
        self._store(key, [unit, value, rows])

    def spend(self, key: Any, unit: Any, rows: int) -> None:
        """Count ``rows`` rows of ``unit`` as read; forget it once none is left."""
        with self._lock:
            entry = self._data.get(key)
            if entry is None or entry[0] != unit:
                return
            entry[2] -= rows
            if entry[2] <= 0:
                del self._data[key]


class KeyedLocks:
    """One lock per key, made on demand; pickles empty (a lock belongs to its process).

    A reader holds the lock of a shard while it decodes something of it that it
    then caches, so that threads needing the same row group wait for one decode
    instead of each making its own.
    """

    def __init__(self) -> None:
        self._locks: dict[Any, threading.Lock] = {}
        self._guard = threading.Lock()

    def __call__(self, key: Any) -> threading.Lock:
        """The lock of ``key``."""
        with self._guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.Lock()
            return lock

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
