"""Low-level file access for the file datasets: streams, lines, handles.

Everything here works on bytes and knows nothing about samples or records;
``datasets.py`` builds the datasets on top of it.

**Paths** (expanding globs and folders into files) live in
:mod:`~zephon_torch.sources.paths`; ``expand_paths`` and ``is_url`` are
re-exported here.

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
handle. It also proves that each span it cuts is the one line the index
promised (it starts right after a line ending, is not blank, and only blank
lines follow it up to the next indexed line), so an index that no longer
fits its file is an error, not pieces of lines or a line lost.

**Line endings.** ``\n``, with an optional ``\r`` before it. A file with no
``\n`` at all but with ``\r`` bytes uses old Mac line endings (``\r``
alone) and is split there; scanning, streaming and reading by pointer agree
on this (a ``\r`` inside a line of a normal file stays part of the line).

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
import hashlib
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from zephon_torch._extras import require
from zephon_torch.sources.base import count_read
from zephon_torch.sources.paths import expand_paths, is_url, url_fs

__all__ = [
    "BLOCK_SIZE",
    "EDGE_BYTES",
    "DataChangedError",
    "FileStat",
    "HandlePool",
    "KeyedLocks",
    "LRUCache",
    "LineScanner",
    "RandomAccessFile",
    "ReadOnceCache",
    "TruncatedStreamError",
    "edge_digest",
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
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)



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
        with self._lock:
            self._data[key] = [unit, value, rows]
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

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
        zstandard = require("zstandard", "reading .zst files")

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
_LF, _CR = 10, 13


class _LineSplit:
    """The line index of a stream whose lines end with one given byte (see LineScanner)."""

    def __init__(self, terminator: int) -> None:
        self.terminator = terminator
        self.seen = False  # whether the terminator occurred at all
        self._offsets: list[np.ndarray] = []
        self._numbers: list[np.ndarray] = []
        self._pos = 0  # stream offset of the next block
        self._line_start = 0  # where the unfinished line started
        self._line_no = 1  # its 1-based number
        self._has_content = False  # whether it holds a non-whitespace byte yet

    def feed(self, block: bytes) -> None:
        n = len(block)
        if n == 0:
            return
        arr = np.frombuffer(block, dtype=np.uint8)
        newlines = np.flatnonzero(arr == self.terminator)
        k = newlines.size
        if k == 0:
            self._has_content = self._has_content or not block.isspace()
            self._pos += n
            return
        self.seen = True
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

    def finish(self, complete_only: bool) -> np.ndarray:
        offsets, numbers = list(self._offsets), list(self._numbers)
        if self._has_content and not complete_only:
            offsets.append(np.array([self._line_start], dtype=np.int64))
            numbers.append(np.array([self._line_no], dtype=np.int64))
        index = np.empty((sum(a.size for a in offsets), 2), dtype=np.int64)
        if offsets:
            index[:, 0] = np.concatenate(offsets)
            index[:, 1] = np.concatenate(numbers)
        return index


class LineScanner:
    """Builds the line index of a byte stream fed block by block.

    The result is an ``(n, 2)`` int64 array: column 0 the byte offset where
    each non-blank line starts, column 1 its 1-based line number. A line is
    blank when it holds only ASCII whitespace (the bytes that
    ``bytes.isspace`` accepts), exactly as :func:`iter_lines` decides.

    Lines end with ``\\n`` (a ``\\r`` before it is part of the line ending).
    A stream with no ``\\n`` at all but with ``\\r`` bytes has old Mac line
    endings: its lines end with ``\\r`` (:attr:`line_end` is then ``"cr"``).
    Until the first ``\\n`` shows up both splits are kept; a normal file has
    one in its first block, so the second split costs nothing there.
    """

    def __init__(self) -> None:
        self._lf = _LineSplit(_LF)
        self._cr: _LineSplit | None = _LineSplit(_CR)

    @property
    def position(self) -> int:
        """Bytes scanned so far."""
        return self._lf._pos

    @property
    def line_end(self) -> str:
        """``"lf"`` (``\\n`` or ``\\r\\n``), or ``"cr"`` for a stream with only ``\\r``."""
        return "cr" if self._cr is not None and self._cr.seen else "lf"

    def feed(self, block: bytes) -> None:
        """Scan the next block of the stream."""
        self._lf.feed(block)
        if self._cr is not None:
            if self._lf.seen:
                self._cr = None  # a "\n": this is not a CR-only stream
            else:
                self._cr.feed(block)

    def finish(self, *, complete_only: bool = False) -> np.ndarray:
        """The index. ``complete_only`` drops an unfinished last line (a truncated stream)."""
        split = self._cr if self.line_end == "cr" else self._lf
        return split.finish(complete_only)


def _strip_newline(line: bytes) -> bytes:
    return line[:-1] if line.endswith(b"\r") else line


def _cr_lines(data: bytes, *, complete_only: bool = False) -> Iterator[bytes]:
    """The non-blank lines of a stream with ``\\r`` line endings (no ``\\n`` in it)."""
    pieces = data.split(b"\r")
    last = pieces.pop()
    for line in pieces:
        if line and not line.isspace():
            yield line
    if not complete_only and last and not last.isspace():
        yield last


def iter_lines(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """The non-blank lines of a block stream, without their line ending.

    Lines end as :class:`LineScanner` says (``\\n``, ``\\r\\n``, or ``\\r`` in a
    stream without any ``\\n``). A final line without a line ending is kept;
    if ``blocks`` raises, the unfinished line is dropped and the exception
    propagates.
    """
    pending: list[bytes] = []
    saw_lf = False
    try:
        for block in blocks:
            pieces = block.split(b"\n")
            if len(pieces) == 1:  # no newline: the current line goes on
                pending.append(block)
                continue
            saw_lf = True
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
    except Exception:
        if not saw_lf:  # perhaps CR line endings: the complete lines before the fault
            yield from _cr_lines(b"".join(pending), complete_only=True)
        raise
    line = b"".join(pending)
    if not saw_lf and b"\r" in line:
        yield from _cr_lines(line)
    elif line and not line.isspace():
        yield _strip_newline(line)


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


def read_lines_at(file: RandomAccessFile, offsets: np.ndarray, file_size: int,
                  ids: np.ndarray, line_end: str = "lf",
                  numbers: np.ndarray | None = None) -> list[bytes]:
    """The lines ``ids`` (sorted, unique) of an indexed file, without line endings.

    Nearby lines are read with one range read (see the module doc). Each read
    also proves that the span it cut is the line the index promised: the
    line starts right after a line ending, holds content (it is not blank),
    and what lies between its line ending and the next indexed line is blank
    lines only (with ``numbers``, the index's 1-based line numbers, exactly as
    many line endings as the numbers say). A file rewritten since it was
    indexed (even to the same size and modification time, say one line split
    in two) fails that check wherever it changed, instead of handing out
    pieces of lines or losing one.

    The check costs one comparison per line: a line followed directly by the
    next has its line ending as the last byte of its span; only a span that
    also holds blank lines has those bytes looked at.

    Raises:
        DataChangedError: The bytes do not fit the index (the file changed).
    """
    n = offsets.size
    after = ids + 1
    end = b"\r" if line_end == "cr" else b"\n"
    end_byte = end[0]
    # Line i, its line ending and any blank lines after it span [starts[i], ends[i]).
    starts = offsets[ids].tolist()
    nxt = np.minimum(after, n - 1)
    ends = np.where(after < n, offsets[nxt], file_size).tolist()
    followed = (after < n).tolist()
    # Line endings from line i to the next indexed line (0: unknown, or the last line).
    gaps = ([0] * len(starts) if numbers is None
            else np.where(after < n, numbers[nxt] - numbers[ids], 0).tolist())
    count = len(starts)
    out: list[bytes] = []
    j = 0
    while j < count:
        window = starts[j]
        last = j
        while (last + 1 < count and starts[last + 1] - ends[last] <= _MERGE_GAP
               and ends[last + 1] - window <= _MAX_WINDOW):
            last += 1
        lead = 1 if window else 0  # the byte before the first line: its line ending
        data = file.read_at(window - lead, ends[last] - window + lead)
        if len(data) < ends[last] - window + lead:
            raise DataChangedError(f"{file.path!r} is shorter than its line index says")
        base = window - lead
        for i in range(j, last + 1):
            lo, hi = starts[i] - base, ends[i] - base
            if lo and data[lo - 1] != end_byte:
                raise DataChangedError(f"{file.path!r} no longer has a line starting at byte "
                                       f"{starts[i]}")
            nl = data.find(end, lo, hi)
            if nl < 0:
                if followed[i]:
                    raise DataChangedError(f"{file.path!r} no longer has a line ending between "
                                           f"bytes {starts[i]} and {ends[i]}")
                nl = hi
            elif nl + 1 != hi or gaps[i] > 1:  # more than this line's ending: blank lines?
                _check_blank_tail(file.path, data, nl, hi, end, gaps[i], starts[i], ends[i])
            line = data[lo:nl]
            if line_end != "cr":
                line = _strip_newline(line)
            if not line or line.isspace():  # stops at the first content byte
                raise DataChangedError(f"{file.path!r} no longer has content in the line at "
                                       f"byte {starts[i]} (it is blank now)")
            out.append(line)
        j = last + 1
    return out


def _check_blank_tail(path: str, data: bytes, nl: int, hi: int, end: bytes, gap: int,
                      start: int, stop: int) -> None:
    """Check that ``data[nl:hi]``, after a line, is blank lines only (``gap`` line endings
    when known): the bytes between an indexed line and the next hold no other line."""
    tail = data[nl:hi]
    if not tail.isspace():
        raise DataChangedError(f"{path!r} no longer holds one line between bytes {start} and "
                               f"{stop}: another line starts inside it")
    if gap and tail.count(end) != gap:
        raise DataChangedError(f"{path!r} no longer holds one line between bytes {start} and "
                               f"{stop}: {tail.count(end)} line ending(s) there, the index "
                               f"says {gap}")
