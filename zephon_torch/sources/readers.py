"""Low-level file access for the file datasets: paths, streams, lines, handles.

Everything here works on bytes and knows nothing about samples or records;
``datasets.py`` builds the datasets on top of it.

**Paths.** A path is local (read with plain ``open``/``os.pread``) or an
fsspec URL (anything with ``"://"``). :func:`expand_paths` turns the user's
paths, globs and directories into a sorted list of files, so shard ids are
stable whatever order the user listed them in.

**Line index.** A plain JSONL shard is read by pointer: one pass over the
file records, for every line that is not blank, the byte offset where it
starts and its 1-based line number. :class:`LineScanner` does this a block at
a time with numpy (no Python loop per line), so memory stays at one block
plus 16 bytes per line. Example, the file ``b'{"a":1}\\n\\n  \\n{"b":2}'``::

    line 1  offset 0   '{"a":1}'   content      -> (0, 1)
    line 2  offset 8   ''          blank        -> skipped
    line 3  offset 9   '  '        whitespace   -> skipped
    line 4  offset 12  '{"b":2}'   content      -> (12, 4)   (no final newline)

**Reading by pointer.** Line ``i`` ends at the first newline after
``offsets[i]``, and that newline comes before ``offsets[i + 1]`` (only blank
lines lie between). :func:`read_lines_at` therefore reads one byte range per
window of nearby requested lines and cuts the lines out of it: one system
call for a run of neighbours, no per-file seek state, so threads may share a
handle.

**Bytes read.** :meth:`RandomAccessFile.read_at` and :func:`iter_raw_blocks`
report every byte they read with
:func:`~zephon_torch.sources.base.count_read` (``stats()["bytes_read"]``).

**Compressed streams.** ``.gz`` and ``.zst`` cannot be entered in the
middle; :func:`iter_decompressed` yields decompressed blocks and, unlike the
standard library's readers, notices a stream that stops before its end
marker (``zstandard``'s ``stream_reader`` silently returns fewer bytes), so a
truncated file is an error, or, when asked, the complete lines before the
cut. Counting (:class:`LineScanner`) and streaming (:func:`iter_lines`) see
the same blocks and keep the same lines, so the two always agree.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from zephon_torch.sources.base import count_read

__all__ = [
    "BLOCK_SIZE",
    "FileStat",
    "HandlePool",
    "KeyedLocks",
    "LRUCache",
    "LineScanner",
    "RandomAccessFile",
    "TruncatedStreamError",
    "expand_paths",
    "is_url",
    "iter_decompressed",
    "iter_lines",
    "iter_raw_blocks",
    "open_binary",
    "read_lines_at",
    "stat_file",
]

#: Bytes read (or decompressed) at a time when scanning or streaming a file.
BLOCK_SIZE = 1 << 20
# Two requested lines share one read when the bytes between them are fewer
# than this; a window never spans more than _MAX_WINDOW bytes (memory bound).
_MERGE_GAP = 64 << 10
_MAX_WINDOW = 8 << 20


def is_url(path: str) -> bool:
    """True if ``path`` names an fsspec URL (``"s3://..."``, ``"memory://..."``)."""
    return "://" in path


def _url_fs(url: str) -> tuple[Any, str]:
    import fsspec  # only URLs need it

    return fsspec.core.url_to_fs(url)


# ---------------------------------------------------------------- paths


def expand_paths(paths: Any, *, what: str, suffixes: Sequence[str] | None) -> list[str]:
    """Expand paths, globs and directories into a sorted list of files.

    Args:
        paths: A path or a list of them; each may be a glob (``data/*.jsonl``),
            a directory (its files with a supported suffix) or an fsspec URL.
        what: The source's name for messages (``"jsonl"``).
        suffixes: Supported lower-case suffixes, or None to accept any file.

    Raises:
        ValueError: ``paths`` is empty or not made of strings, or a file has an
            unsupported suffix.
        FileNotFoundError: A path or glob matches no file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    elif not isinstance(paths, Iterable):
        raise ValueError(
            f"{what}: paths must be a path, a glob or a list of them, got {paths!r}"
        )
    paths = list(paths)
    if not paths:
        raise ValueError(
            f"{what}: paths is empty; pass a file, a glob such as 'data/*.jsonl', "
            "or a list of them"
        )
    found: set[str] = set()
    for raw in paths:
        path = os.fspath(raw) if isinstance(raw, os.PathLike) else raw
        if not isinstance(path, str) or not path:
            raise ValueError(f"{what}: every path must be a non-empty string, got {raw!r}")
        matches = _expand_url(path, suffixes) if is_url(path) else _expand_local(path, suffixes)
        if not matches:
            hint = "" if is_url(path) else f" (relative paths start from {os.getcwd()!r})"
            raise FileNotFoundError(f"{what}: {path!r} matches no file{hint}; check the path")
        found.update(matches)
    files = sorted(found)
    if suffixes is not None:
        for file in files:
            if not file.lower().endswith(tuple(suffixes)):
                raise ValueError(
                    f"{what}: {file!r} has an unsupported extension; supported: "
                    f"{', '.join(suffixes)}"
                )
    return files


def _has_magic(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _expand_local(path: str, suffixes: Sequence[str] | None) -> list[str]:
    if _has_magic(path):
        return [m for m in glob.glob(path, recursive=True) if os.path.isfile(m)]
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        files = [os.path.join(path, n) for n in names if not n.startswith(".")]
        return [f for f in files if os.path.isfile(f) and _suffix_ok(f, suffixes)]
    return [path] if os.path.isfile(path) else []


def _expand_url(url: str, suffixes: Sequence[str] | None) -> list[str]:
    fs, path = _url_fs(url)
    if _has_magic(path):
        return [fs.unstrip_protocol(m) for m in fs.glob(path) if fs.isfile(m)]
    if fs.isdir(path):
        entries = fs.ls(path, detail=True)
        return [fs.unstrip_protocol(e["name"]) for e in entries
                if e.get("type") == "file" and _suffix_ok(e["name"], suffixes)]
    return [url] if fs.exists(path) else []


def _suffix_ok(path: str, suffixes: Sequence[str] | None) -> bool:
    return suffixes is None or path.lower().endswith(tuple(suffixes))


# ---------------------------------------------------------------- files


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


def stat_file(path: str) -> FileStat:
    """Size and modification token of a local file or URL."""
    if not is_url(path):
        st = os.stat(path)
        return FileStat(st.st_size, str(st.st_mtime_ns))
    fs, inner = _url_fs(path)
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
        fs, inner = _url_fs(path)
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
            st = os.fstat(self._fd)
            return FileStat(st.st_size, str(st.st_mtime_ns))
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


class LRUCache:
    """A small thread-safe LRU map; its contents are not pickled.

    Values are computed outside the lock (two threads may both compute a
    missing value; the result is the same and one copy wins).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        """The value for ``key``, or None."""
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        """Store ``value``, evicting the least recently used entries."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity": self.capacity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["capacity"])


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


# ---------------------------------------------------------------- streams


class TruncatedStreamError(ValueError):
    """A compressed stream ended before its end marker, or is corrupt."""


def iter_raw_blocks(file: BinaryIO, block_size: int = BLOCK_SIZE) -> Iterator[bytes]:
    """Blocks of ``file`` until end of file."""
    while True:
        block = file.read(block_size)
        if not block:
            return
        count_read(len(block))
        yield block


def iter_decompressed(file: BinaryIO, compression: str | None, *,
                      block_size: int = BLOCK_SIZE) -> Iterator[bytes]:
    """Decompressed blocks of ``file`` (``compression``: None, "gzip" or "zstd").

    Concatenated gzip members and zstd frames are read one after another.

    Raises:
        TruncatedStreamError: The input ends inside a member/frame, or is not
            valid compressed data. Blocks before the fault have been yielded.
    """
    if compression is None:
        yield from iter_raw_blocks(file, block_size)
    elif compression == "gzip":
        yield from _iter_members(file, block_size, lambda: zlib.decompressobj(wbits=31),
                                 zlib.error)
    elif compression == "zstd":
        import zstandard

        dctx = zstandard.ZstdDecompressor()
        yield from _iter_members(file, block_size, dctx.decompressobj, zstandard.ZstdError)
    else:
        raise ValueError(f"unknown compression {compression!r}")


def _iter_members(file: BinaryIO, block_size: int, new: Callable[[], Any],
                  error: type[Exception]) -> Iterator[bytes]:
    # A fresh decompressor per member/frame; the bytes after one's end marker
    # (``unused_data``) start the next. The input is fed in pieces small
    # enough that one piece cannot expand without bound in memory.
    piece = 64 << 10
    dobj = None  # None between members: only padding or a new member may follow
    for block in iter_raw_blocks(file, block_size):
        data = block
        while data:
            if dobj is None:
                data = data.lstrip(b"\x00")  # gzip tools may pad with zeros
                if not data:
                    break
                dobj = new()
            feed, data = data[:piece], data[piece:]
            try:
                out = dobj.decompress(feed)
            except error as exc:
                raise TruncatedStreamError(f"corrupt compressed data ({exc})") from exc
            if out:
                yield out
            if dobj.eof:
                data = dobj.unused_data + data
                dobj = None
    if dobj is not None:
        raise TruncatedStreamError("the compressed stream ends before its end marker "
                                   "(the file is truncated)")


# ---------------------------------------------------------------- lines


# Bytes that are not ASCII whitespace (``bytes.isspace``: 9-13 and 32).
_CONTENT = np.ones(256, dtype=bool)
_CONTENT[[9, 10, 11, 12, 13, 32]] = False


class LineScanner:
    """Builds the line index of a byte stream fed block by block.

    The result is an ``(n, 2)`` int64 array: column 0 the byte offset where
    each non-blank line starts, column 1 its 1-based line number. A line is
    blank when it holds only ASCII whitespace (the bytes that
    ``bytes.isspace`` accepts), exactly as :func:`iter_lines` decides.
    """

    def __init__(self) -> None:
        self._offsets: list[np.ndarray] = []
        self._numbers: list[np.ndarray] = []
        self._pos = 0  # stream offset of the next block
        self._line_start = 0  # where the unfinished line started
        self._line_no = 1  # its 1-based number
        self._has_content = False  # whether it holds a non-whitespace byte yet

    @property
    def position(self) -> int:
        """Bytes scanned so far."""
        return self._pos

    def feed(self, block: bytes) -> None:
        """Scan the next block of the stream."""
        n = len(block)
        if n == 0:
            return
        arr = np.frombuffer(block, dtype=np.uint8)
        newlines = np.flatnonzero(arr == 10)
        k = newlines.size
        if k == 0:
            self._has_content = self._has_content or not block.isspace()
            self._pos += n
            return
        seg_start = np.empty(k, dtype=np.int64)
        seg_start[0] = 0
        seg_start[1:] = newlines[:-1] + 1
        nonempty = newlines > seg_start
        # Almost every line starts with a content byte ('{'), which settles it;
        # only lines starting with whitespace need a look at all their bytes.
        has = nonempty & _CONTENT[arr[seg_start]]
        for j in np.flatnonzero(nonempty & ~has).tolist():
            has[j] = not block[int(seg_start[j]):int(newlines[j])].isspace()
        has[0] |= self._has_content  # the first segment ends the carried line
        starts = seg_start + self._pos
        starts[0] = self._line_start
        numbers = np.arange(self._line_no, self._line_no + k, dtype=np.int64)
        self._offsets.append(starts[has])
        self._numbers.append(numbers[has])
        tail = int(newlines[-1]) + 1
        rest = block[tail:]
        self._line_start = self._pos + tail
        self._line_no += k
        self._has_content = bool(rest) and not rest.isspace()
        self._pos += n

    def finish(self, *, complete_only: bool = False) -> np.ndarray:
        """The index. ``complete_only`` drops an unfinished last line (a truncated stream)."""
        offsets, numbers = list(self._offsets), list(self._numbers)
        if self._has_content and not complete_only:
            offsets.append(np.array([self._line_start], dtype=np.int64))
            numbers.append(np.array([self._line_no], dtype=np.int64))
        index = np.empty((sum(a.size for a in offsets), 2), dtype=np.int64)
        if offsets:
            index[:, 0] = np.concatenate(offsets)
            index[:, 1] = np.concatenate(numbers)
        return index


def _strip_newline(line: bytes) -> bytes:
    return line[:-1] if line.endswith(b"\r") else line


def iter_lines(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """The non-blank lines of a block stream, without their line ending.

    A final line without a newline is kept; if ``blocks`` raises, the
    unfinished line is dropped and the exception propagates.
    """
    pending: list[bytes] = []
    for block in blocks:
        pieces = block.split(b"\n")
        if len(pieces) == 1:  # no newline: the current line goes on
            pending.append(block)
            continue
        if pending:
            pending.append(pieces[0])
            pieces[0] = b"".join(pending)
            pending = []
        tail = pieces.pop()
        if tail:
            pending.append(tail)
        for line in pieces:
            if line and not line.isspace():
                yield _strip_newline(line)
    line = b"".join(pending)
    if line and not line.isspace():
        yield _strip_newline(line)


def read_lines_at(file: RandomAccessFile, offsets: np.ndarray, file_size: int,
                  ids: np.ndarray) -> list[bytes]:
    """The lines ``ids`` (sorted, unique) of an indexed file, without line endings.

    Nearby lines are read with one range read (see the module doc).

    Raises:
        ValueError: The file is shorter than its index says (it changed).
    """
    n = offsets.size
    after = ids + 1
    # Line i, its newline and any blank lines after it span [starts[i], ends[i]).
    starts = offsets[ids].tolist()
    ends = np.where(after < n, offsets[np.minimum(after, n - 1)], file_size).tolist()
    count = len(starts)
    out: list[bytes] = []
    j = 0
    while j < count:
        window = starts[j]
        last = j
        while (last + 1 < count and starts[last + 1] - ends[last] <= _MERGE_GAP
               and ends[last + 1] - window <= _MAX_WINDOW):
            last += 1
        data = file.read_at(window, ends[last] - window)
        if len(data) < ends[last] - window:
            raise ValueError(f"{file.path!r} is shorter than its line index says; the file "
                             "changed while the pipeline ran, restart it to re-index")
        for i in range(j, last + 1):
            lo, hi = starts[i] - window, ends[i] - window
            nl = data.find(b"\n", lo, hi)
            out.append(_strip_newline(data[lo:hi if nl < 0 else nl]))
        j = last + 1
    return out
