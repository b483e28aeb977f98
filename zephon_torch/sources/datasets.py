"""The built-in datasets: in-memory items, JSONL, Parquet and text files.

Each class turns the user's paths into shards (one per file, sorted by path
so shard ids are stable) and answers two questions for the engine: how many
samples each shard holds, and what the raw bytes (or dict) of some samples
are. Nothing here decodes JSON or builds records; ``fetch`` and
``decode_text`` (``zephon_torch/ops/io.py``) do that on the workers.

How each format counts and reads without holding a file in memory:

========================  ==========  ==========================================
format                    access      count / read
========================  ==========  ==========================================
in-memory items           inline      ``len(items)`` / the payload objects
``.jsonl``                pointer     line index, cached on disk / range reads
``.jsonl.gz``/``.zst``    stream      one streaming pass, cached / ``stream()``
``.parquet``              pointer     file metadata / the needed row groups
text files                pointer     1 per file / the whole file
========================  ==========  ==========================================

For example, ``jsonl("data/*.jsonl")`` over ``data/a.jsonl`` (3 lines, the
second blank) and ``data/b.jsonl`` (2 lines) has shards ``0: a.jsonl, 2
samples`` and ``1: b.jsonl, 2 samples``; sample ``(d, 0, 1)`` is the third line
of ``a.jsonl``, and ``locate(0, 1)`` says ``"data/a.jsonl line 3"``.

Datasets are pickled into worker processes. Open files and decoded row
groups live in per-process caches that pickle empty (see
:class:`~zephon_torch.sources.readers.HandlePool` and
:class:`~zephon_torch.sources.readers.LRUCache`); line indexes that are on
disk are memory-mapped again where they are needed.

Fingerprints (:meth:`Dataset.describe`) hold shard names relative to the
files' common folder (just the base names when the files share a folder),
never absolute paths, so a job can move to another cluster.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, ClassVar, Literal

import numpy as np

from zephon_torch._extras import require
from zephon_torch.sources.base import Dataset, Shard, count_read
from zephon_torch.sources.index_cache import (
    IndexInfo,
    default_cache_dir,
    describe_index,
    index_key,
    list_entries,
    load_index,
    remove_entry,
    save_index,
)
from zephon_torch.sources.readers import (
    DataChangedError,
    FileStat,
    HandlePool,
    KeyedLocks,
    LineScanner,
    LRUCache,
    RandomAccessFile,
    ReadOnceCache,
    TruncatedStreamError,
    edge_digest,
    expand_paths,
    is_url,
    iter_decompressed,
    iter_lines,
    open_binary,
    read_lines_at,
    stat_file,
)
from zephon_torch.vocab import texts_present

__all__ = [
    "ItemsDataset",
    "JsonlDataset",
    "ParquetDataset",
    "TextFilesDataset",
    "items",
    "jsonl",
    "parquet",
    "text_files",
]

OnError = Literal["raise", "skip"]
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".ndjson.gz", ".ndjson.zst")
PARQUET_SUFFIXES = (".parquet", ".pq")


# ---------------------------------------------------------------- validation


def _check_on_error(value: Any) -> OnError:
    if value not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {value!r}")
    return value


def _check_component_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"component_id must be an integer >= 0, got {value!r}")
    return int(value)


def _check_passes(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"passes must be a positive integer or None (repeat forever), "
                         f"got {value!r}")
    return int(value)


def _check_name(value: Any, default: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or not value:
        raise ValueError(f"name must be a non-empty string, got {value!r}")
    return value


def _check_field(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"field must be a non-empty string such as 'text', got {value!r}")
    return value


def _shard_names(paths: Sequence[str]) -> list[str]:
    """Location-free names: each path relative to the files' common folder."""
    normed = [p.split("://", 1)[1] if is_url(p) else os.path.abspath(p).replace(os.sep, "/")
              for p in paths]
    try:
        root = posixpath.commonpath([posixpath.dirname(p) for p in normed])
    except ValueError:  # a mix of absolute and relative URL paths
        return [posixpath.basename(p) for p in normed]
    if not root:
        return [p.lstrip("/") for p in normed]
    return [posixpath.relpath(p, root) for p in normed]


def _even_share(total: int, count: int, ids: np.ndarray) -> int:
    """Bytes of ``ids`` when ``total`` bytes are spread evenly over ``count`` samples.

    Sample ``i`` gets ``floor((i+1)*total/count) - floor(i*total/count)``, so
    the shares of all samples add up to ``total`` exactly.
    """
    if count <= 0 or not ids.size:
        return 0
    ids = ids.astype(np.int64)
    return int(((ids + 1) * total // count - ids * total // count).sum())


class _FileDataset(Dataset):
    """What every file dataset shares: options, shards and id checks."""

    def _init_options(self, *, component_id: Any, name: Any, passes: Any,
                      on_error: Any) -> None:
        self.on_error = _check_on_error(on_error)
        self.component_id = _check_component_id(component_id)
        self.passes = _check_passes(passes)
        self.name = _check_name(name, self.kind)
        self._shards: list[Shard] = []
        #: ``(path, why)`` of the glob matches left out with ``on_error="skip"``.
        self.skipped_paths: list[tuple[str, str]] = []

    def shards(self) -> list[Shard]:
        """The shards in path order, with their sample counts."""
        return list(self._shards)

    def _check_ids(self, shard_id: int, local_ids: Sequence[int]) -> np.ndarray:
        if not 0 <= shard_id < len(self._shards):
            raise IndexError(f"{self.name}: shard {shard_id} does not exist "
                             f"({len(self._shards)} shards)")
        ids = np.asarray(local_ids, dtype=np.int64).reshape(-1)
        n = self._shards[shard_id].num_samples
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise IndexError(f"{self.name}: sample {bad} is out of range for shard "
                             f"{shard_id} ({self._shards[shard_id].path}, {n} samples)")
        return ids

    def _warn(self, message: str) -> None:
        warnings.warn(message, RuntimeWarning, stacklevel=4)


# ---------------------------------------------------------------- items


#: What ``ItemsDataset`` accepts as an item.
_ITEM_KINDS = (dict, str, list, tuple, np.ndarray)


class ItemsDataset(Dataset):
    """An in-memory list of payloads: one shard, read inline.

    Args:
        items: A sequence of payloads. A dict is used as it is (not copied);
            a str ``s`` becomes ``{"text": s}``; a 1-D array or list of token
            ids is kept as it is.
        component_id: The mixture component this dataset feeds.
        name: Name for messages and the fingerprint.
        passes: Trips over this dataset (None: the pipeline's ``passes``).
        on_error: ``"raise"`` or ``"skip"`` for later stages' bad samples.

    Raises:
        ValueError: ``items`` is a single str/dict/bytes instead of a sequence.
        TypeError: An item is not a dict, str or array of token ids.
    """

    kind = "items"
    raw_format = "dict"

    def __init__(self, items: Sequence[Any], *, component_id: int = 0, name: str = "items",
                 passes: int | None = None, on_error: OnError = "raise") -> None:
        if isinstance(items, (str, bytes, dict)):
            raise ValueError(f"items must be a sequence of payloads, got one "
                             f"{type(items).__name__}; wrap it in a list: items([...])")
        if not isinstance(items, Sequence):
            try:
                items = list(items)
            except TypeError:
                raise ValueError(f"items must be a sequence of payloads (dicts or str), "
                                 f"got {type(items).__name__}") from None
        # One sweep in C over the items' types; the item-by-item check only names
        # the culprit when a type is not one of the accepted kinds.
        if not all(issubclass(kind, _ITEM_KINDS) for kind in set(map(type, items))):
            for i, item in enumerate(items):
                if not isinstance(item, _ITEM_KINDS):
                    raise TypeError(f"items[{i}] is a {type(item).__name__}; each item must be "
                                    "a dict payload, a str (becomes {'text': s}) or an array "
                                    "of token ids")
        self._items = items
        self.on_error = _check_on_error(on_error)
        self.component_id = _check_component_id(component_id)
        self.passes = _check_passes(passes)
        self.name = _check_name(name, "items")
        self._shard = Shard(shard_id=0, num_samples=len(items), name=self.name, path=None,
                            access="inline")

    def shards(self) -> list[Shard]:
        """A single in-memory shard."""
        return [self._shard]

    def read(self, shard_id: int, local_ids: Sequence[int]) -> list[Any]:
        """The payloads of ``local_ids`` (dicts are the caller's own objects)."""
        return self.read_checked(shard_id, local_ids)[0]

    def read_checked(self, shard_id: int, local_ids: Sequence[int]) -> tuple[list[Any], bool]:
        """:meth:`read`, and whether every payload is a dict with a non-blank text.

        When it is (``vocab.texts_present``, one sweep), no item needed
        wrapping and no row is an empty text: the source's emptiness check has
        nothing to look for.
        """
        if shard_id != 0:
            raise IndexError(f"{self.name}: shard {shard_id} does not exist (1 shard)")
        items = self._items
        if type(local_ids) is range and local_ids.step == 1 and type(items) is list:
            out = items[local_ids.start:local_ids.stop]  # a run of ids: one slice
            if len(out) != len(local_ids):  # past the end: the indexing below says so
                out = list(map(items.__getitem__, local_ids))
        else:
            out = list(map(items.__getitem__, local_ids))
        if texts_present(out):  # all dicts: no str to wrap
            return out, True
        return [{"text": item} if isinstance(item, str) else item for item in out], False

    def stream(self, shard_id: int) -> Iterator[Any]:
        """The payloads in order."""
        return iter(self.read(shard_id, range(len(self._items))))

    def locate(self, shard_id: int, local_id: int) -> str:
        """``"items[17]"``."""
        return f"{self.name}[{local_id}]"


# ---------------------------------------------------------------- jsonl


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


def _edges(path: str, size: int, *extra: bytes) -> str:
    """:func:`edge_digest` of a file (opened and closed here)."""
    handle = RandomAccessFile(path)
    try:
        return edge_digest(handle, size, *extra)
    finally:
        handle.close()


def _signature(*parts: str) -> str:
    """16 hex digits standing for ``parts`` (the content digest of a shard)."""
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).hexdigest()


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


class JsonlDataset(_FileDataset):
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
        self._infos: list[IndexInfo] = []  # what each index says (line ending, digest)
        self._entries: list[str | None] = []  # each index's cache entry, if on disk
        # Indexes without a disk copy stay here (and travel when pickled);
        # those on disk are memory-mapped on demand into a bounded cache.
        self._pinned: dict[int, np.ndarray] = {}
        self._loaded = LRUCache(self.loaded_index_cache_size)
        self._handles = HandlePool(8)
        self._block_starts: dict[int, np.ndarray] = {}
        self._last_block = ReadOnceCache(self.block_cache_size)
        self._reading = KeyedLocks()
        listing: dict[str, list[tuple[str, IndexInfo]]] | None = None
        for shard_id, (path, shard_name) in enumerate(zip(files, _shard_names(files))):
            compression = _compression_of(path)
            if compression == "zstd":
                require("zstandard", "reading .zst files")
            stat = stat_file(path)
            edges = _edges(path, stat.size)
            kind = f"lines.{compression or 'plain'}"
            file = _JsonlFile(path, compression, stat, edges, index_key(path, stat, kind, edges))
            self._files.append(file)
            index = info = entry = None
            if file.key is not None:
                if listing is None:  # one listing of the cache folder for all files
                    listing = list_entries(self.cache_dir)
                found = listing.get(file.key, [])
                if len(found) == 1:
                    entry, info = found[0]
                    index = load_index(self.cache_dir, entry)
                else:  # none, or several (ambiguous): index again
                    for stale, _ in found:
                        remove_entry(self.cache_dir, stale)
            if index is None:
                index, line_end, complete = self._scan(file)
                info = describe_index(index, line_end)
                entry = (save_index(self.cache_dir, file.key, index, info)
                         if complete and file.key else None)
                if entry is None:
                    self._pinned[shard_id] = index
            self._infos.append(info)
            self._entries.append(entry)
            self._shards.append(Shard(shard_id=shard_id, num_samples=len(index),
                                      name=shard_name, path=path,
                                      access="stream" if compression else "pointer"))

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
            index = None if entry is None else load_index(self.cache_dir, entry)
            if index is None:  # the cache entry was removed: index again
                index, line_end, complete = self._scan(file)
                if describe_index(index, line_end) != self._infos[shard_id]:
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
        cached = self._last_block.get(shard_id, block)
        if cached is not None:
            return cached
        with self._reading(shard_id):  # threads wanting this block wait for one read
            cached = self._last_block.get(shard_id, block)
            if cached is not None:
                return cached
            file = self._files[shard_id]
            lo = 0 if block == 0 else int(offsets[starts[block]]) - 1
            hi = (int(offsets[starts[block + 1]]) if block + 1 < len(starts)
                  else file.stat.size)
            handle = self._handles.get(shard_id, lambda: self._open(shard_id))
            data = handle.read_at(lo, hi - lo)
            if len(data) < hi - lo:
                raise _rewritten(f"{file.path!r} is shorter than its line index says")
            view = _BlockBytes(file.path, block, lo, data)
            stop = (int(starts[block + 1]) if block + 1 < len(starts)
                    else self._shards[shard_id].num_samples)
            self._last_block.put(shard_id, block, view, stop - int(starts[block]))
        return view

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
        return [(file.stat.size, _signature("jsonl", file.edges, info.line_end, info.digest))
                for file, info in zip(self._files, self._infos)]

    def sample_bytes(self, shard_id: int, local_ids: np.ndarray) -> int:
        """Bytes of the lines (with their line ending) of a plain file; for a
        compressed stream, the file's size spread evenly over its lines."""
        file = self._files[shard_id]
        n = self._shards[shard_id].num_samples
        ids = np.asarray(local_ids, dtype=np.int64)
        if file.compression is not None or not ids.size:
            return _even_share(file.stat.size, n, ids)
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


# ---------------------------------------------------------------- parquet


def _parquet_signature(path: str) -> tuple[int, str]:
    """Size and content digest of a Parquet file: its first and last 4 KiB and its footer.

    The footer holds every row group's and column chunk's size, place and
    statistics, so a rewrite of the rows almost always changes it.
    """
    size = stat_file(path).size
    handle = RandomAccessFile(path)
    try:
        tail = handle.read_at(max(size - 8, 0), 8)
        footer = b""
        if len(tail) == 8 and tail[4:] == b"PAR1":  # 4-byte footer length, then the magic
            length = int.from_bytes(tail[:4], "little")
            if 0 < length <= size - 12:
                footer = handle.read_at(size - 8 - length, length)
        return size, _signature("parquet", edge_digest(handle, size, footer))
    finally:
        handle.close()


class _ParquetHandle:
    """An open ``ParquetFile`` and, for URLs, the file object under it."""

    def __init__(self, path: str) -> None:
        pq = require("pyarrow.parquet", "reading Parquet files")
        self._raw = open_binary(path) if is_url(path) else None
        self.file = pq.ParquetFile(self._raw if self._raw is not None else path)

    def close(self) -> None:
        self.file.close()
        if self._raw is not None:
            self._raw.close()


def _is_numeric(arrow_type: Any) -> bool:
    import pyarrow as pa

    return (pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
            or pa.types.is_boolean(arrow_type))


def _column_values(column: Any) -> list[Any]:
    """Python values of a column; lists of numbers become numpy arrays of their dtype.

    The rows of a list-of-numbers column are views of one private copy of
    the values they cover (one copy per call rather than one per row): each
    row is writable and owns no Arrow memory, and rows do not overlap, but a
    row kept alone keeps the values of the other rows read with it alive
    (one ``read`` call's worth, not the row group).
    """
    import pyarrow as pa

    kind = column.type
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _is_numeric(kind.value_type):
        arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        values = arr.values
        if values.null_count == 0:  # numpy cannot hold a null inside an int array
            offsets = arr.offsets.to_numpy()
            start = int(offsets[0])
            bounds = (offsets - start).tolist()
            # One copy of the rows' values, so rows neither pin the row group nor are
            # read-only; each row is a slice of it.
            flat = values.to_numpy(zero_copy_only=False)[start:start + bounds[-1]].copy()
            if not arr.null_count:
                return [flat[a:b] for a, b in pairwise(bounds)]
            valid = arr.is_valid().to_numpy(zero_copy_only=False).tolist()
            return [flat[a:b] if ok else None for a, b, ok in zip(bounds, bounds[1:], valid)]
    if pa.types.is_fixed_size_list(kind) and _is_numeric(kind.value_type):
        dtype = kind.value_type.to_pandas_dtype()
        return [None if v is None or None in v else np.asarray(v, dtype=dtype)
                for v in column.to_pylist()]
    return column.to_pylist()


def _table_columns(table: Any, rows: np.ndarray) -> dict[str, Any] | None:
    """Rows of a decoded row group as columns (see :meth:`ParquetDataset.read_columns`).

    A list column of numbers becomes a :class:`~zephon_torch.block.Ragged`
    column: each row's run of values copied from the row group's buffers
    into one array of its own (no Arrow ``take``); other columns become
    lists. None for a column that cannot be held so (nulls in a token
    column, fixed-size lists).
    """
    import pyarrow as pa

    from zephon_torch.block import Ragged

    n = rows.size
    contiguous = bool(n) and int(rows[-1]) - int(rows[0]) == n - 1 and bool(
        (rows[1:] - rows[:-1] == 1).all())
    out: dict[str, Any] = {}
    for name, column in zip(table.column_names, table.columns):
        kind = column.type
        if pa.types.is_fixed_size_list(kind):
            return None
        if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _is_numeric(
                kind.value_type):
            arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
            if arr.null_count or arr.values.null_count:
                return None
            offsets = arr.offsets.to_numpy().astype(np.int64)
            flat = arr.values.to_numpy(zero_copy_only=False)
            starts, ends = offsets[rows], offsets[rows + 1]
            lengths = ends - starts
            new_offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=new_offsets[1:])
            if contiguous:
                values = flat[int(starts[0]):int(ends[-1])].copy()
            elif n:  # one C-level copy of every row's run, laid end to end
                values = np.concatenate([flat[a:b] for a, b in
                                         zip(starts.tolist(), ends.tolist())])
            else:
                values = flat[:0].copy()
            out[name] = Ragged(values, new_offsets)
        elif contiguous:
            out[name] = column.slice(int(rows[0]), n).to_pylist()
        else:
            out[name] = column.take(pa.array(rows)).to_pylist()
    return out


def _table_rows(table: Any, rows: np.ndarray) -> list[dict[str, Any]]:
    """One dict per requested row of a decoded row group."""
    import pyarrow as pa

    n = rows.size
    if n and int(rows[-1]) - int(rows[0]) == n - 1 and bool((rows[1:] - rows[:-1] == 1).all()):
        part = table.slice(int(rows[0]), n)  # a contiguous run: no copy
    else:
        gathered = _gather_token_rows(table, rows)
        if gathered is not None:
            return gathered
        part = table.take(pa.array(rows))
    names = part.column_names
    if not names:
        return [{} for _ in range(n)]
    if len(names) == 1:  # one column (such as ``input_ids``): no zip of columns
        name = names[0]
        return [{name: value} for value in _column_values(part.column(0))]
    columns = [_column_values(part.column(i)) for i in range(part.num_columns)]
    return [dict(zip(names, values)) for values in zip(*columns)]


def _gather_token_rows(table: Any, rows: np.ndarray) -> list[dict[str, Any]] | None:
    """Scattered rows of a table of one list-of-numbers column without nulls (token
    ids: what a shuffled pass reads), each row a copy of its values; ``None`` for any
    other table.

    The same rows, dtype and values as ``take`` then :func:`_column_values`, at a
    fraction of the cost (no intermediate table); each row owns its memory.
    """
    import pyarrow as pa

    if table.num_columns != 1:
        return None
    column = table.column(0)
    kind = column.type
    if not ((pa.types.is_list(kind) or pa.types.is_large_list(kind))
            and (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type))):
        return None
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    values = arr.values
    if arr.null_count or values.null_count:
        return None
    offsets = arr.offsets.to_numpy()  # positions in ``values`` (a slice's too)
    flat = values.to_numpy(zero_copy_only=True)
    name = table.column_names[0]
    starts = offsets[rows].tolist()
    ends = offsets[rows + 1].tolist()
    return [{name: flat[a:b].copy()} for a, b in zip(starts, ends)]


def _group_bytes(group: Any, columns: Sequence[str] | None) -> int:
    """Compressed bytes of a row group's column chunks (only ``columns`` if given)."""
    wanted = None if columns is None else set(columns)
    total = 0
    for i in range(group.num_columns):
        chunk = group.column(i)
        if wanted is None or chunk.path_in_schema.split(".")[0] in wanted:
            total += int(chunk.total_compressed_size)
    return total


class ParquetDataset(_FileDataset):
    """Parquet files: one sample per row, read by row group.

    Counting uses the file metadata only. :meth:`read` maps local ids to row
    groups (cumulative row counts) and decodes only the row groups it needs;
    the last decoded row group of each shard is kept (a small per-process
    LRU) until as many of its rows have been read as it holds, so
    neighbouring ids do not decode it again and a finished group does not
    linger. A row is a dict; a list
    column of numbers becomes a numpy array of its type (``list<int32>`` ->
    ``np.int32``), everything else Python values. Those arrays are writable
    and hold no Arrow memory: the rows of one :meth:`read` are slices of one
    private copy of that column's values, so a row kept alone keeps the
    column's values of the rows read with it alive, never the row group.

    Args:
        paths: A path, glob, directory or fsspec URL, or a list of them.
            A path that exists is that file or folder, even with ``*``, ``?``
            or ``[`` in its name (``shard[1].jsonl``); see ``expand_paths``.
        columns: Columns to read (None: all). A str means one column.
        component_id: The mixture component this dataset feeds.
        name: Name for messages and the fingerprint (default ``"parquet"``).
        passes: Trips over this dataset (None: the pipeline's ``passes``).
        on_error: ``"raise"``: a file that cannot be opened is an error;
            ``"skip"``: it is a shard of 0 samples, with a warning.

    Raises:
        ValueError: Empty ``paths``, an unsupported extension, a bad option, a
            missing column, or an unreadable file with ``on_error="raise"``.
        FileNotFoundError: A path or glob that matches no file.
    """

    kind = "parquet"
    raw_format = "dict"
    #: Shards whose last decoded row group is kept (until it is read), per process.
    row_group_cache_size: ClassVar[int] = 4

    def __init__(self, paths: str | Sequence[str], *, columns: Sequence[str] | None = None,
                 component_id: int = 0, name: str | None = None, passes: int | None = None,
                 on_error: OnError = "raise") -> None:
        self._init_options(component_id=component_id, name=name, passes=passes,
                           on_error=on_error)
        pq = require("pyarrow.parquet", "reading Parquet files")
        if isinstance(columns, str):
            columns = [columns]
        if columns is not None:
            columns = list(columns)
            if not all(isinstance(c, str) and c for c in columns):
                raise ValueError(f"parquet: columns must be a list of column names, "
                                 f"got {columns!r}")
        self.columns: list[str] | None = columns
        files = expand_paths(paths, what="parquet", suffixes=PARQUET_SUFFIXES,
                             on_error=self.on_error, skipped=self.skipped_paths)
        self._paths = files
        self._bounds: list[np.ndarray] = []
        self._group_bytes: list[np.ndarray] = []
        self._signatures: list[tuple[int, str]] = []
        self._handles = HandlePool(8)
        self._groups = ReadOnceCache(self.row_group_cache_size)
        self._decoding = KeyedLocks()
        for shard_id, (path, shard_name) in enumerate(zip(files, _shard_names(files))):
            counts, sizes = self._row_group_sizes(pq, path)
            self._group_bytes.append(np.asarray(sizes, dtype=np.int64))
            bounds = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=bounds[1:])
            self._bounds.append(bounds)
            self._signatures.append(_parquet_signature(path))
            self._shards.append(Shard(shard_id=shard_id, num_samples=int(bounds[-1]),
                                      name=shard_name, path=path, access="pointer"))

    def _row_group_sizes(self, pq: Any, path: str) -> tuple[list[int], list[int]]:
        """Rows and compressed bytes (of the columns read) of each row group."""
        try:
            raw = open_binary(path) if is_url(path) else None
            try:
                with pq.ParquetFile(raw if raw is not None else path) as pf:
                    meta = pf.metadata
                    names = pf.schema_arrow.names
                    counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
                    sizes = [_group_bytes(meta.row_group(i), self.columns)
                             for i in range(meta.num_row_groups)]
            finally:
                if raw is not None:
                    raw.close()
        except Exception as exc:  # pyarrow raises several types for a bad file
            message = f"parquet: cannot open {path!r} as a Parquet file ({exc})"
            if self.on_error == "raise":
                raise ValueError(f"{message}; check the file, or pass on_error='skip' to "
                                 "treat it as an empty shard") from exc
            self._warn(f"{message}; on_error='skip' treats it as a shard of 0 samples")
            return [], []
        missing = [c for c in self.columns or () if c not in names]
        if missing:
            raise ValueError(f"parquet: {path!r} has no column {', '.join(map(repr, missing))}; "
                             f"its columns are {names}")
        return counts, sizes

    def _read_row_group(self, shard_id: int, row_group: int) -> Any:
        """Decode one row group of a shard (a ``pyarrow.Table`` of ``columns``)."""
        handle = self._handles.get(shard_id, lambda: self._open(shard_id))
        table = handle.file.read_row_group(row_group, columns=self.columns)
        count_read(int(self._group_bytes[shard_id][row_group]))
        return table

    def _open(self, shard_id: int) -> _ParquetHandle:
        """Open a shard, checking that its row groups are those counted."""
        path = self._paths[shard_id]
        handle = _ParquetHandle(path)
        meta = handle.file.metadata
        now = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        then = np.diff(self._bounds[shard_id]).tolist()
        if now != then:
            handle.close()
            raise DataChangedError(
                f"parquet: {path!r} changed since the pipeline was built ({sum(then)} rows in "
                f"{len(then)} row groups then, {sum(now)} in {len(now)} now); restart the "
                "pipeline")
        return handle

    def _row_group(self, shard_id: int, row_group: int) -> Any:
        """A decoded row group, kept per shard until its rows have all been read."""
        cached = self._groups.get(shard_id, row_group)
        if cached is not None:
            return cached
        with self._decoding(shard_id):  # threads wanting this group wait for one decode
            cached = self._groups.get(shard_id, row_group)
            if cached is not None:
                return cached
            table = self._read_row_group(shard_id, row_group)
            bounds = self._bounds[shard_id]
            self._groups.put(shard_id, row_group, table,
                             int(bounds[row_group + 1] - bounds[row_group]))
        return table

    def read(self, shard_id: int, local_ids: Sequence[int]) -> list[dict[str, Any]]:
        """One dict per row of ``local_ids``, in the order given."""
        ids = self._check_ids(shard_id, local_ids)
        if not ids.size:
            return []
        bounds = self._bounds[shard_id]
        groups = np.searchsorted(bounds, ids, side="right") - 1
        first = int(groups[0])
        if first == int(groups[-1]) and bool((groups == first).all()):  # one row group
            rows = _table_rows(self._row_group(shard_id, first), ids - bounds[first])
            self._groups.spend(shard_id, first, ids.size)
            return rows
        out: list[Any] = [None] * ids.size
        used, first_use = np.unique(groups, return_index=True)
        # Each group read once, in order of first use: the one read last, kept, is
        # where the next call goes on (a shuffled pass visits a row group's rows in
        # consecutive calls).
        for group in used[np.argsort(first_use)].tolist():
            where = np.flatnonzero(groups == group)
            rows = _table_rows(self._row_group(shard_id, group), ids[where] - bounds[group])
            self._groups.spend(shard_id, group, where.size)
            for position, row in zip(where.tolist(), rows):
                out[position] = row
        return out

    def read_columns(self, shard_id: int, local_ids: Sequence[int]) -> dict[str, Any] | None:
        """The rows ``local_ids`` (in that order) as columns, for a block of rows.

        A list column of numbers without nulls becomes one
        :class:`~zephon_torch.block.Ragged` column sliced from Arrow's
        offsets (its values copied once, so they are writable and hold no
        Arrow memory), with no Python per row; any other column becomes a
        list of Python values. Row ``i`` of the columns is exactly what
        :meth:`read` gives for it. None when a column cannot be held so (a
        null list, a fixed-size list): the caller then reads rows.
        """
        from zephon_torch.block import concat_columns

        ids = self._check_ids(shard_id, local_ids)
        if not ids.size:
            return None
        bounds = self._bounds[shard_id]
        groups = np.searchsorted(bounds, ids, side="right") - 1
        cut = np.flatnonzero(groups[1:] != groups[:-1]) + 1
        runs: list[dict[str, Any]] = []
        for start, stop in zip([0, *cut.tolist()], [*cut.tolist(), ids.size]):
            group = int(groups[start])
            table = self._row_group(shard_id, group)
            run = _table_columns(table, ids[start:stop] - bounds[group])
            if run is None:
                return None  # the caller reads rows instead (and those count)
            self._groups.spend(shard_id, group, stop - start)
            runs.append(run)
        return concat_columns(runs)

    def sample_bytes(self, shard_id: int, local_ids: np.ndarray) -> int:
        """Each row group's compressed size (of the columns read) spread over its rows."""
        ids = np.asarray(local_ids, dtype=np.int64)
        if not ids.size:
            return 0
        bounds = self._bounds[shard_id]
        sizes = self._group_bytes[shard_id]
        groups = np.searchsorted(bounds, ids, side="right") - 1
        total = 0
        for group in np.unique(groups).tolist():
            rows = ids[groups == group] - bounds[group]
            total += _even_share(int(sizes[group]), int(bounds[group + 1] - bounds[group]), rows)
        return total

    def blocks(self, shard_id: int) -> np.ndarray:
        """The row groups (those holding rows): a decoded group is the unit of reading."""
        bounds = self._bounds[shard_id]
        starts = np.unique(bounds[:-1])
        return starts[starts < bounds[-1]]

    def locate(self, shard_id: int, local_id: int) -> str:
        """``"x.parquet row 12"`` (the 0-based row in the file)."""
        return f"{self._paths[shard_id]} row {local_id}"

    def content_signatures(self) -> list[tuple[int, str] | None]:
        """Per file: its size, and a digest of its first and last 4 KiB and its footer."""
        return list(self._signatures)

    def describe(self) -> dict[str, Any]:
        """Kind, name, shards and the ``columns`` read."""
        return {**super().describe(), "columns": self.columns}


# ---------------------------------------------------------------- text files


class TextFilesDataset(_FileDataset):
    """Text files, each one document: one shard of one sample per file.

    Raw payloads are the file's bytes; ``decode_text`` makes them
    ``{field: text}``. An empty file is still one sample (``decode_text``
    turns it into an ``"empty"`` tombstone, so it is counted, not lost).

    Args:
        paths: A path, glob, directory or fsspec URL, or a list of them (any
            extension). A path that exists is that file or folder, even
            with ``*``, ``?`` or ``[`` in its name; see ``expand_paths``.
        component_id: The mixture component this dataset feeds.
        name: Name for messages and the fingerprint (default ``"text_files"``).
        passes: Trips over this dataset (None: the pipeline's ``passes``).
        on_error: ``"raise"`` or ``"skip"`` (for files that are not UTF-8).
        field: The payload key the text goes to.

    Raises:
        ValueError: Empty ``paths`` or a bad option.
        FileNotFoundError: A path or glob that matches no file.
    """

    kind = "text_files"
    raw_format = "text"

    def __init__(self, paths: str | Sequence[str], *, component_id: int = 0,
                 name: str | None = None, passes: int | None = None,
                 on_error: OnError = "raise", field: str = "text") -> None:
        self._init_options(component_id=component_id, name=name, passes=passes,
                           on_error=on_error)
        self.field = _check_field(field)
        files = expand_paths(paths, what="text_files", suffixes=None, on_error=self.on_error,
                             skipped=self.skipped_paths)
        self._paths = files
        self._sizes = [stat_file(p).size for p in files]
        self._digests = [_signature("text", _edges(p, size))
                         for p, size in zip(files, self._sizes)]
        self._shards = [Shard(shard_id=i, num_samples=1, name=n, path=p, access="pointer")
                        for i, (p, n) in enumerate(zip(files, _shard_names(files)))]

    def read(self, shard_id: int, local_ids: Sequence[int]) -> list[bytes]:
        """The file's bytes, once per requested id (each id must be 0)."""
        ids = self._check_ids(shard_id, local_ids)
        if not ids.size:
            return []
        path = self._paths[shard_id]
        with open_binary(path) as fh:
            data = fh.read()
        count_read(len(data))
        if len(data) != self._sizes[shard_id]:
            raise DataChangedError(f"text_files: {path!r} changed since the pipeline was built "
                                   f"({self._sizes[shard_id]} bytes then, {len(data)} now); "
                                   "restart the pipeline")
        return [data] * ids.size

    def sample_bytes(self, shard_id: int, local_ids: np.ndarray) -> int:
        """The file's size per requested id."""
        return self._sizes[shard_id] * len(local_ids)

    def locate(self, shard_id: int, local_id: int) -> str:
        """The file's path."""
        return self._paths[shard_id]

    def content_signatures(self) -> list[tuple[int, str] | None]:
        """Per file: its size, and a digest of its first and last 4 KiB."""
        return list(zip(self._sizes, self._digests))

    def describe(self) -> dict[str, Any]:
        """Kind, name, shards and the payload ``field``."""
        return {**super().describe(), "field": self.field}


# ---------------------------------------------------------------- factories


def items(items: Sequence[Any], *, component_id: int = 0, name: str = "items",
          passes: int | None = None, on_error: OnError = "raise") -> ItemsDataset:
    """An in-memory dataset (see :class:`ItemsDataset`).

    Example:
        >>> len(items(["a", {"text": "b"}]))
        2
    """
    return ItemsDataset(items, component_id=component_id, name=name, passes=passes,
                        on_error=on_error)


def jsonl(paths: str | Sequence[str], *, component_id: int = 0, name: str | None = None,
          passes: int | None = None, on_error: OnError = "raise",
          cache_dir: str | os.PathLike | None = None) -> JsonlDataset:
    """JSON Lines files, plain, ``.gz`` or ``.zst`` (see :class:`JsonlDataset`)."""
    return JsonlDataset(paths, component_id=component_id, name=name, passes=passes,
                        on_error=on_error, cache_dir=cache_dir)


def parquet(paths: str | Sequence[str], *, columns: Sequence[str] | None = None,
            component_id: int = 0, name: str | None = None, passes: int | None = None,
            on_error: OnError = "raise") -> ParquetDataset:
    """Parquet files, one sample per row (see :class:`ParquetDataset`)."""
    return ParquetDataset(paths, columns=columns, component_id=component_id, name=name,
                          passes=passes, on_error=on_error)


def text_files(paths: str | Sequence[str], *, component_id: int = 0, name: str | None = None,
               passes: int | None = None, on_error: OnError = "raise",
               field: str = "text") -> TextFilesDataset:
    """Text files, one document each (see :class:`TextFilesDataset`)."""
    return TextFilesDataset(paths, component_id=component_id, name=name, passes=passes,
                            on_error=on_error, field=field)
