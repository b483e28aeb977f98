"""Splitting bytes into lines: the line index, streaming lines, reading by pointer.

**Line index.** A plain JSONL shard is read by pointer: one pass over the
file records, for every line that is not blank, the byte offset where it
starts and its 1-based line number. :class:`LineScanner` does this a block at
a time with numpy (no Python loop per line), so memory stays at one block
plus 16 bytes per line. Example, the file ``b'{"a":1}\\n\\n  \\n{"b":2}'``::

    line 1  offset 0   '{"a":1}'   content      -> (0, 1)
    line 2  offset 8   ''          blank        -> skipped
    line 3  offset 9   '  '        whitespace   -> skipped
    line 4  offset 12  '{"b":2}'   content      -> (12, 4)   (no final newline)

The index is kept on disk by :mod:`zephon_torch.sources.index_cache`.

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
alone) and is split there; scanning, streaming (:func:`iter_lines`) and
reading by pointer agree on this (a ``\r`` inside a line of a normal file
stays part of the line).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from zephon_torch.sources.handles import DataChangedError, RandomAccessFile

__all__ = ["LineScanner", "iter_lines", "read_lines_at"]

# Two requested lines share one read when the bytes between them are fewer
# than this; a window never spans more than _MAX_WINDOW bytes (memory bound).
_MERGE_GAP = 64 << 10
_MAX_WINDOW = 8 << 20


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
