"""Opening files, what identifies their content, and reusing open handles.

Everything here works on bytes and knows nothing about samples or records;
the formats (:mod:`zephon_torch.sources.formats`) build datasets on top of it.

**Opening.** :func:`open_binary` opens a local file or URL for streaming;
:class:`RandomAccessFile` reads ``(offset, size)`` ranges (``os.pread`` for
local files, so threads need no shared seek position).
:meth:`RandomAccessFile.read_at` reports every byte it reads with
:func:`~zephon_torch.sources.base.count_read` (``stats()["bytes_read"]``).

**Identity.** :func:`stat_file` gives a file's size and modification token
(:class:`FileStat`, what the line-index cache keys on), and
:func:`edge_digest` a digest of its size and first and last
:data:`EDGE_BYTES`, which names content and never a location. A file found
rewritten under the pipeline raises :class:`DataChangedError`.

**Reuse.** :class:`HandlePool` keeps a few open handles per thread, so a
handle is never shared between threads and a pickled pool carries none.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from zephon_torch.sources.base import count_read
from zephon_torch.sources.paths import is_url, url_fs

__all__ = [
    "EDGE_BYTES",
    "DataChangedError",
    "FileStat",
    "HandlePool",
    "RandomAccessFile",
    "edge_digest",
    "open_binary",
    "stat_file",
]


@dataclass(frozen=True, slots=True)
class FileStat:
    """What identifies a file's content for the index cache.

    Attributes:
        size: Size in bytes.
        mtime: A modification token (nanoseconds for local files; whatever
            the filesystem reports for URLs), or None when unknown.
    """

    size: int
    mtime: str | None


def _local_stat(st: os.stat_result) -> FileStat:
    return FileStat(st.st_size, str(st.st_mtime_ns))


def stat_file(path: str) -> FileStat:
    """Size and modification token of a local file or URL."""
    if not is_url(path):
        return _local_stat(os.stat(path))
    fs, inner = url_fs(path)
    info = fs.info(inner)
    mtime = None
    for key in ("mtime", "LastModified", "last_modified", "updated", "ETag", "etag", "created"):
        if info.get(key) is not None:
            mtime = f"{key}={info[key]}"
            break
    return FileStat(int(info["size"]), mtime)


def open_binary(path: str) -> BinaryIO:
    """Open a local file or URL for binary reading (the caller closes it)."""
    if is_url(path):
        fs, inner = url_fs(path)
        return fs.open(inner, "rb")
    return open(path, "rb", buffering=0)  # we read large blocks ourselves


class RandomAccessFile:
    """A file read by ``(offset, size)`` ranges.

    Local files use ``os.pread`` (no shared seek position); URL files seek
    and read. Each thread gets its own instance from a :class:`HandlePool`.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._file: BinaryIO | None = None
        if is_url(path) or not hasattr(os, "pread"):
            self._file = open_binary(path)
        else:
            self._fd = os.open(path, os.O_RDONLY)

    def stat(self) -> FileStat:
        """The open file's size and modification token."""
        if self._fd is not None:
            return _local_stat(os.fstat(self._fd))
        return stat_file(self.path)

    def read_at(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes from ``offset`` (fewer only at end of file)."""
        parts: list[bytes] = []
        while size > 0:
            if self._fd is not None:
                data = os.pread(self._fd, size, offset)
            else:
                self._file.seek(offset)
                data = self._file.read(size)
            if not data:
                break
            parts.append(data)
            offset += len(data)
            size -= len(data)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        count_read(len(data))
        return data

    def close(self) -> None:
        """Release the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._file is not None:
            self._file.close()
            self._file = None


class HandlePool:
    """A per-thread LRU of open handles (files, Parquet readers).

    Each thread has its own handles, so no handle is ever used by two threads
    at once and evicting one cannot pull a file from under another thread.
    Handles never travel: pickling the pool keeps only its capacity.

    Args:
        capacity: Open handles kept per thread.
        close: How to release an evicted handle.
    """

    def __init__(self, capacity: int = 8, close: Callable[[Any], None] | None = None) -> None:
        self.capacity = capacity
        self._close = close
        self._local = threading.local()

    def get(self, key: Any, opener: Callable[[], Any]) -> Any:
        """The handle for ``key``, opened with ``opener()`` on first use."""
        handles: OrderedDict[Any, Any] | None = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = OrderedDict()
        handle = handles.get(key)
        if handle is not None:
            handles.move_to_end(key)
            return handle
        handle = opener()
        handles[key] = handle
        while len(handles) > self.capacity:
            _, old = handles.popitem(last=False)
            self._release(old)
        return handle

    def discard(self, key: Any) -> None:
        """Close and forget this thread's handle for ``key``, if any."""
        handles = getattr(self._local, "handles", None)
        if handles and key in handles:
            self._release(handles.pop(key))

    def close(self) -> None:
        """Close this thread's handles."""
        handles = getattr(self._local, "handles", None) or {}
        while handles:
            self._release(handles.popitem()[1])

    def _release(self, handle: Any) -> None:
        # A handle that fails to close is still gone from the pool.
        with contextlib.suppress(Exception):
            if self._close is not None:
                self._close(handle)
            elif hasattr(handle, "close"):
                handle.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "close": self._close}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"], state["close"])


class DataChangedError(ValueError):
    """A file no longer holds what the pipeline found in it (rewritten during the run).

    Never turned into a tombstone by ``on_error="skip"``: the documents are
    fine, the pipeline's view of the file is stale.
    """


#: Bytes read at each end of a file for its content signature.
EDGE_BYTES = 4096


def edge_digest(file: RandomAccessFile, size: int, *extra: bytes) -> str:
    """A digest of a file's size, its first and last :data:`EDGE_BYTES` and ``extra``.

    It names content, never a location or a time: a copy of the file
    anywhere has the same digest.
    """
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    if size <= 2 * EDGE_BYTES:
        h.update(file.read_at(0, size))
    else:
        h.update(file.read_at(0, EDGE_BYTES))
        h.update(file.read_at(size - EDGE_BYTES, EDGE_BYTES))
    for part in extra:
        h.update(part)
    return h.hexdigest()

