"""JSON Lines files: one sample per non-blank line, read by pointer or as a stream.

A plain file is counted by one scan that records each non-blank line's byte
offset and line number (its *line index*, cached on disk by
``index_cache.py``), and read by pointer through it, a block of about 1 MiB
of lines at a time. ``.gz`` and ``.zst`` files cannot be read at an offset:
they are counted by one decompressing pass (cached the same way) and read in
order with :meth:`JsonlDataset.stream`.

For example, ``jsonl("data/*.jsonl")`` over ``data/a.jsonl`` (3 lines, the
second blank) and ``data/b.jsonl`` (2 lines) has shards ``0: a.jsonl, 2
samples`` and ``1: b.jsonl, 2 samples``; sample ``(d, 0, 1)`` is the third line
of ``a.jsonl``, and ``locate(0, 1)`` says ``"data/a.jsonl line 3"``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from zephon_torch._extras import require
from zephon_torch.sources.base import Shard
from zephon_torch.sources.caches import KeyedLocks, LRUCache, ReadOnceCache
from zephon_torch.sources.formats.common import (
    FileDataset,
    OnError,
    content_signature,
    even_share,
    file_edges,
    read_once,
    shard_names,
)
from zephon_torch.sources.formats.registry import CommandLineFormat, SourceFormat, register
from zephon_torch.sources.handles import (
    DataChangedError,
    FileStat,
    HandlePool,
    RandomAccessFile,
    edge_digest,
    open_binary,
    stat_file,
)
from zephon_torch.sources.index_cache import (
    IndexInfo,
    default_cache_dir,
    describe_index,
    index_key,
    indexing_lock,
    list_entries,
    load_index,
    name_count,
    remove_entry,
    save_index,
)
from zephon_torch.sources.lines import LineScanner, iter_lines, read_lines_at
from zephon_torch.sources.paths import expand_paths
from zephon_torch.sources.streams import TruncatedStreamError, iter_decompressed

__all__ = ["JSONL_SUFFIXES", "JsonlDataset", "jsonl"]


JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".ndjson.gz", ".ndjson.zst")


@dataclass(frozen=True, slots=True)
class _JsonlFile:
    path: str
    compression: str | None  # None, "gzip" or "zstd"
    stat: FileStat
    edges: str  # digest of its size and first and last bytes
    key: str | None  # index cache key; None: not cacheable


def _compression_of(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith(".gz"):
        return "gzip"
    if lower.endswith(".zst"):
        return "zstd"
    return None


class _BlockBytes:
    """A read block of a JSONL file in memory, read by ``(offset, size)`` like the file."""

    __slots__ = ("block", "data", "lo", "path")

    def __init__(self, path: str, block: int, lo: int, data: bytes) -> None:
        self.path = path
        self.block = block
        self.lo = lo
        self.data = data

    def read_at(self, offset: int, size: int) -> bytes:
        """``size`` bytes from file offset ``offset`` (inside the block)."""
        start = offset - self.lo
        return self.data[start:start + size]


def _rewritten(found: str) -> DataChangedError:
    """The error for JSONL bytes that no longer fit the file's line index."""
    return DataChangedError(
        f"jsonl: {found}: the file changed since it was indexed (rewritten, perhaps keeping "
        "its size and modification time); its cached index is removed, restart the pipeline "
        "to index it again")


class JsonlDataset(FileDataset):
    """JSON Lines files: one sample per non-blank line.

    Plain files are read by pointer through a line index (byte offset and
    line number of each non-blank line) built by one scan and cached on disk
    (see ``index_cache.py``). ``.gz`` and ``.zst`` files are streams: counting
    takes one decompressing pass (its result is cached the same way) and
    samples come from :meth:`stream`. Raw payloads are the lines' bytes
    without the line ending. Lines end with ``\\n`` or ``\\r\\n``; a file
    without any ``\\n`` whose lines end with ``\\r`` (old Mac files) is read
    line by line too.

    A file's content signature (for the checkpoint fingerprint) is its size,
    its first and last 4 KiB and its line index; reading checks each line
    against the index, so a file rewritten during a run is an error
    (:class:`~zephon_torch.sources.readers.DataChangedError`, never a skipped
    sample).

    Args:
        paths: A path, glob, directory or fsspec URL, or a list of them.
            A path that exists is that file or folder, even with ``*``, ``?``
            or ``[`` in its name (``shard[1].jsonl``); see ``expand_paths``.
        component_id: The mixture component this dataset feeds.
        name: Name for messages and the fingerprint (default ``"jsonl"``).
        passes: Trips over this dataset (None: the pipeline's ``passes``).
        on_error: ``"raise"``: a truncated compressed file, a glob match that
            cannot be read (and, later, a bad line) is an error naming the
            file; ``"skip"``: keep the complete lines before the damage, leave
            out unreadable matches (warnings) and tombstone bad lines.
        cache_dir: Folder of the index cache (default ``$ZEPHON_CACHE_DIR`` or
            ``~/.cache/zephon_torch/index``).

    Raises:
        ValueError: Empty ``paths``, an unsupported extension, a bad option,
            or a truncated/corrupt compressed file with ``on_error="raise"``.
        FileNotFoundError: A path or glob that matches no file, or an
            unreadable match with ``on_error="raise"``.
    """

    kind = "jsonl"
    raw_format = "json"
    #: Memory-mapped indexes kept open per process.
    loaded_index_cache_size: ClassVar[int] = 64
    #: Bytes per read block of a plain file: a block ends before the first line
    #: that starts at or after a multiple of it (see :meth:`blocks`).
    block_bytes: ClassVar[int] = 1 << 20
    #: Shards whose last read block is kept (until it is read), per process.
    block_cache_size: ClassVar[int] = 4

    def __init__(self, paths: str | Sequence[str], *, component_id: int = 0,
                 name: str | None = None, passes: int | None = None,
                 on_error: OnError = "raise", cache_dir: str | os.PathLike | None = None) -> None:
        self._init_options(component_id=component_id, name=name, passes=passes,
                           on_error=on_error)
        files = expand_paths(paths, what="jsonl", suffixes=JSONL_SUFFIXES,
                             on_error=self.on_error, skipped=self.skipped_paths)
        self.cache_dir = (default_cache_dir() if cache_dir is None
                          else os.path.abspath(os.fspath(cache_dir)))
        self._files: list[_JsonlFile] = []
        # What each index says (line ending, digest, count), from its cache entry's
        # name where it has one: an index is loaded when its shard is first read.
        self._infos: list[IndexInfo] = []
        self._entries: list[str | None] = []  # each index's cache entry, if on disk
        # Indexes without a disk copy stay here (and travel when pickled);
        # those on disk are memory-mapped on demand into a bounded cache.
        self._pinned: dict[int, np.ndarray] = {}
        self._loaded = LRUCache(self.loaded_index_cache_size)
        self._handles = HandlePool(8)
        self._block_starts: dict[int, np.ndarray] = {}
        self._last_block = ReadOnceCache(self.block_cache_size)
        self._reading = KeyedLocks()
        for path in files:
            compression = _compression_of(path)
            if compression == "zstd":
                require("zstandard", "reading .zst files")
            stat = stat_file(path)
            edges = file_edges(path, stat.size)
            kind = f"lines.{compression or 'plain'}"
            self._files.append(_JsonlFile(path, compression, stat, edges,
                                          index_key(path, stat, kind, edges)))
        keys = [file.key for file in self._files if file.key is not None]
        listing = list_entries(self.cache_dir) if keys else {}  # one listing for all files
        if any(len(listing.get(key, ())) != 1 for key in keys):
            # Files to index: processes starting together (torchrun ranks) take turns,
            # so that one indexes and the others find its entries.
            with indexing_lock(self.cache_dir, keys, f"jsonl {self.name!r}") as locked:
                if locked:
                    listing = list_entries(self.cache_dir)
                if not locked or any(len(listing.get(key, ())) != 1 for key in keys):
                    self._count_files(files, listing)
                    return
            # Another process indexed them while this one waited: count from the
            # listing without holding the others up.
        self._count_files(files, listing)

    def _count_files(self, files: list[str],
                     listing: dict[str, list[tuple[str, IndexInfo]]]) -> None:
        """Count every file's lines, from the cache listing where it can, and make
        the shards."""
        for shard_id, (file, shard_name) in enumerate(zip(self._files, shard_names(files))):
            info, entry = self._count(shard_id, file, listing)
            self._infos.append(info)
            self._entries.append(entry)
            self._shards.append(Shard(shard_id=shard_id, num_samples=int(info.lines or 0),
                                      name=shard_name, path=file.path,
                                      access="stream" if file.compression else "pointer"))

    def _count(self, shard_id: int, file: _JsonlFile,
               listing: dict[str, list[tuple[str, IndexInfo]]]) -> tuple[IndexInfo, str | None]:
        """What a file's index says, and its cache entry (None: kept in memory)."""
        found = listing.get(file.key, []) if file.key is not None else []
        if len(found) == 1:
            entry, info = found[0]
            if info.lines is not None:
                return info, entry  # its index is loaded when the shard is first read
            index = load_index(self.cache_dir, entry)  # named before counts were in names
            if index is not None:
                info = describe_index(index, info.line_end)
                self._loaded.put(shard_id, index)
                return info, name_count(self.cache_dir, entry, info)
        for stale, _ in found:  # ambiguous or damaged: index again
            remove_entry(self.cache_dir, stale)
        index, line_end, complete = self._scan(file)
        info = describe_index(index, line_end)
        entry = (save_index(self.cache_dir, file.key, index, info)
                 if complete and file.key else None)
        if entry is None:
            self._pinned[shard_id] = index
        return info, entry

    # -- index ------------------------------------------------------------

    def _scan(self, file: _JsonlFile) -> tuple[np.ndarray, str, bool]:
        """Index a file with one pass; returns (index, line ending, complete)."""
        scanner = LineScanner()
        with open_binary(file.path) as fh:
            try:
                for block in iter_decompressed(fh, file.compression):
                    scanner.feed(block)
            except TruncatedStreamError as exc:
                index = scanner.finish(complete_only=True)
                message = f"jsonl: {file.path!r} is truncated or corrupt: {exc}"
                if self.on_error == "raise":
                    raise ValueError(f"{message}; re-create the file, or pass "
                                     "on_error='skip' to keep the complete lines before the "
                                     "damage") from exc
                self._warn(f"{message}; on_error='skip' keeps the {len(index)} complete "
                           "lines before the damage")
                return index, scanner.line_end, False
        if file.compression is None and scanner.position != file.stat.size:
            raise ValueError(f"jsonl: {file.path!r} changed while it was being indexed; "
                             "run again once it is no longer being written")
        return scanner.finish(), scanner.line_end, True

    def _index(self, shard_id: int) -> np.ndarray:
        index = self._pinned.get(shard_id)
        if index is None:
            index = self._loaded.get(shard_id)
        if index is None:
            file = self._files[shard_id]
            entry = self._entries[shard_id]
            # The entry is checked against its name (digest and count), which gave
            # the shard's count and content signature.
            index = None if entry is None else load_index(self.cache_dir, entry)
            if index is None:  # the cache entry was removed or damaged: index again
                index, line_end, complete = self._scan(file)
                if describe_index(index, line_end) != self._infos[shard_id]:
                    self._forget_index(shard_id)  # a restart indexes it again
                    then = self._shards[shard_id].num_samples
                    how = (f"{then} lines then, {len(index)} now" if len(index) != then
                           else "the same number of lines, at other places")
                    raise DataChangedError(f"jsonl: {file.path!r} changed since it was indexed "
                                           f"({how}); restart the pipeline to re-index it")
                if complete and file.key:
                    save_index(self.cache_dir, file.key, index, self._infos[shard_id])
            self._loaded.put(shard_id, index)
        return index

    def _forget_index(self, shard_id: int) -> None:
        """Drop an index found stale, here and in the cache (a restart indexes again)."""
        entry = self._entries[shard_id]
        if entry is not None:
            remove_entry(self.cache_dir, entry)
        self._handles.discard(shard_id)

    # -- reading ----------------------------------------------------------

    def _check_unchanged(self, file: _JsonlFile, handle: RandomAccessFile) -> None:
        """Raise :class:`DataChangedError` if the open file is not the one indexed."""
        now = handle.stat()
        if now.size != file.stat.size or (now.mtime and file.stat.mtime
                                          and now.mtime != file.stat.mtime):
            how = (f"size {file.stat.size} then, {now.size} now" if now.size != file.stat.size
                   else "same size, modified since")
            raise DataChangedError(
                f"jsonl: {file.path!r} changed since it was indexed ({how}); restart the "
                "pipeline to re-index it")
        if edge_digest(handle, now.size) != file.edges:
            raise DataChangedError(
                f"jsonl: {file.path!r} changed since it was indexed (same size, different "
                "first or last bytes); restart the pipeline to re-index it")

    def _open(self, shard_id: int) -> RandomAccessFile:
        file = self._files[shard_id]
        handle = RandomAccessFile(file.path)
        try:
            self._check_unchanged(file, handle)
        except BaseException:
            handle.close()
            raise
        return handle

    def read(self, shard_id: int, local_ids: Sequence[int]) -> list[bytes]:
        """The raw bytes of lines ``local_ids`` (without line endings), in the order given.

        Raises:
            ValueError: The shard is compressed (stream it instead).
            DataChangedError: The file changed since it was indexed.
        """
        ids = self._check_ids(shard_id, local_ids)
        file = self._files[shard_id]
        if file.compression is not None:
            raise ValueError(f"jsonl: {file.path!r} is compressed and can only be read in "
                             "order with stream(); its shard has access 'stream'")
        if not ids.size:
            return []
        index = self._index(shard_id)
        offsets, numbers = index[:, 0], index[:, 1]
        starts = self.blocks(shard_id)
        line_end = self._infos[shard_id].line_end
        in_block = np.searchsorted(starts, ids, side="right") - 1
        used, first_use = np.unique(in_block, return_index=True)
        out: list[Any] = [None] * ids.size
        try:
            # Blocks in order of first use: the one read last, kept, is where the next
            # call goes on (a shuffled pass visits a block's lines in consecutive calls).
            for block in used[np.argsort(first_use)].tolist():
                where = np.flatnonzero(in_block == block)
                unique, inverse = np.unique(ids[where], return_inverse=True)
                view = self._block(shard_id, block, offsets, starts)
                try:
                    lines = read_lines_at(view, offsets, file.stat.size, unique, line_end,
                                          numbers)
                except DataChangedError as exc:
                    raise _rewritten(str(exc)) from None
                self._last_block.spend(shard_id, block, where.size)
                for position, k in zip(where.tolist(), inverse.reshape(-1).tolist()):
                    out[position] = lines[k]
        except DataChangedError:
            self._forget_index(shard_id)
            raise
        return out

    def _block(self, shard_id: int, block: int, offsets: np.ndarray,
               starts: np.ndarray) -> _BlockBytes:
        """The bytes of one read block, read once and kept until the shard's next block
        is read: from the file's first byte for block 0, else from the line ending
        before the block's first line (``read_lines_at`` checks it)."""
        return read_once(self._last_block, self._reading, shard_id, block,
                         lambda: self._read_block(shard_id, block, offsets, starts))

    def _read_block(self, shard_id: int, block: int, offsets: np.ndarray,
                    starts: np.ndarray) -> tuple[_BlockBytes, int]:
        """One read block from the file, and the number of lines it holds."""
        file = self._files[shard_id]
        lo = 0 if block == 0 else int(offsets[starts[block]]) - 1
        hi = (int(offsets[starts[block + 1]]) if block + 1 < len(starts)
              else file.stat.size)
        handle = self._handles.get(shard_id, lambda: self._open(shard_id))
        data = handle.read_at(lo, hi - lo)
        if len(data) < hi - lo:
            raise _rewritten(f"{file.path!r} is shorter than its line index says")
        stop = (int(starts[block + 1]) if block + 1 < len(starts)
                else self._shards[shard_id].num_samples)
        return _BlockBytes(file.path, block, lo, data), stop - int(starts[block])

    def blocks(self, shard_id: int) -> np.ndarray:
        """Read blocks of about :attr:`block_bytes` bytes of lines (one for a compressed
        file, which is read front to back, or a file of at most that size)."""
        n = self._shards[shard_id].num_samples
        file = self._files[shard_id]
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if file.compression is not None or file.stat.size <= self.block_bytes:
            return np.zeros(1, dtype=np.int64)
        starts = self._block_starts.get(shard_id)
        if starts is None:
            offsets = self._index(shard_id)[:, 0]
            marks = np.arange(0, file.stat.size, self.block_bytes, dtype=np.int64)
            starts = np.unique(np.searchsorted(offsets, marks, side="left")).astype(np.int64)
            starts = starts[starts < n]
            self._block_starts[shard_id] = starts
        return starts

    def stream(self, shard_id: int) -> Iterator[bytes]:
        """The shard's lines in file order (the only way to read a compressed shard).

        Raises:
            ValueError: The file is truncated (with ``on_error="raise"``).
            DataChangedError: The file changed since it was counted.
        """
        file = self._files[shard_id]
        expected = self._shards[shard_id].num_samples
        count = 0
        changed = (f"jsonl: {file.path!r} changed since it was counted ({expected} lines "
                   "then); restart the pipeline to re-index it")
        handle = RandomAccessFile(file.path)
        try:
            self._check_unchanged(file, handle)
        finally:
            handle.close()
        with open_binary(file.path) as fh:
            try:
                for line in iter_lines(iter_decompressed(fh, file.compression)):
                    if count == expected:
                        raise DataChangedError(changed)
                    yield line
                    count += 1
            except TruncatedStreamError as exc:
                if self.on_error == "raise" or count != expected:
                    raise ValueError(f"jsonl: {file.path!r} is truncated or corrupt: {exc}; "
                                     "re-create the file, or pass on_error='skip' to keep "
                                     "the complete lines before the damage") from exc
                return  # skip mode: the lines before the damage, as counted
        if count != expected:
            raise DataChangedError(changed)

    def content_signatures(self) -> list[tuple[int, str] | None]:
        """Per file: its size, and a digest of its first and last 4 KiB and line index."""
        return [(file.stat.size,
                 content_signature("jsonl", file.edges, info.line_end, info.digest))
                for file, info in zip(self._files, self._infos)]

    def sample_bytes(self, shard_id: int, local_ids: np.ndarray) -> int:
        """Bytes of the lines (with their line ending) of a plain file; for a
        compressed stream, the file's size spread evenly over its lines."""
        file = self._files[shard_id]
        n = self._shards[shard_id].num_samples
        ids = np.asarray(local_ids, dtype=np.int64)
        if file.compression is not None or not ids.size:
            return even_share(file.stat.size, n, ids)
        offsets = self._index(shard_id)[:, 0]
        after = ids + 1
        ends = np.where(after < n, offsets[np.minimum(after, n - 1)], file.stat.size)
        return int((ends - offsets[ids]).sum())

    def locate(self, shard_id: int, local_id: int) -> str:
        """``"data/part-0.jsonl line 17"`` (the 1-based line in the file)."""
        file = self._files[shard_id]
        try:
            index = self._index(shard_id)
        except (OSError, ValueError):
            return f"{file.path} sample {local_id}"
        if 0 <= local_id < len(index):
            return f"{file.path} line {int(index[local_id, 1])}"
        return f"{file.path} sample {local_id}"


def jsonl(paths: str | Sequence[str], *, component_id: int = 0, name: str | None = None,
          passes: int | None = None, on_error: OnError = "raise",
          cache_dir: str | os.PathLike | None = None) -> JsonlDataset:
    """JSON Lines files, plain, ``.gz`` or ``.zst`` (see :class:`JsonlDataset`)."""
    return JsonlDataset(paths, component_id=component_id, name=name, passes=passes,
                        on_error=on_error, cache_dir=cache_dir)


register(SourceFormat(
    name="jsonl", factory=jsonl, builder="from_jsonl",
    command_line=CommandLineFormat(
        name="jsonl", label="JSONL",
        suffixes=(".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".ndjson"),
        marks=(".jsonl", ".json", ".ndjson"), rank=1)))
