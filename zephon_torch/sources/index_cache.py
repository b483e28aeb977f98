"""The on-disk cache of JSONL line indexes.

Scanning a large JSONL file to find its lines takes one full read; every
process and every later run would repeat it. The index (``(n, 2)`` int64:
byte offset and 1-based line number of each non-blank line) is therefore
saved once as a ``.npy`` file named ``<key>.<about>.<lines>.npy``:

* ``key`` is a hash of what identifies the file's content without reading
  it all: its absolute path (or URL), its size, its modification time and a
  digest of its first and last few KiB. A file that changes gets a new key.
  ``cp -p``, ``rsync -t`` or ``tar x`` can rewrite a file keeping its size
  and modification time; the head and tail digest catches most such
  rewrites, and reading checks every line it cuts against the index (see
  :func:`~zephon_torch.sources.lines.read_lines_at`), removing an entry
  found stale.
* ``about`` is what the index says about the file: its line ending
  (``lf``, or ``cr`` for old Mac files) and a digest of the index itself (it
  changes when lines of different lengths are reordered). The digest enters
  the pipeline's fingerprint without reading the index again. It also lets
  a loaded entry prove itself: an entry whose content does not hash to the
  digest in its name (edited, a row deleted, damaged on disk) is not used;
  the file is indexed again and the entry overwritten.
* ``lines`` is the number of lines the index holds, so that one listing of
  the folder counts every file without opening its entry: a dataset of
  100,000 shards loads an index only when it first reads that shard.
  Entries written before the count was in the name (``<key>.<about>.npy``)
  are still read, and renamed to carry it.

A folder is listed once per dataset to find the entries of its files; old
entries are simply left behind (delete the folder to reclaim space).

Writes are atomic (a temporary file in the same folder, then
``os.replace``): processes racing to index the same file each write a
complete file and the last rename wins, and a reader never sees half a file.
A cache folder that cannot be written is not an error: the index is then
kept in memory only, with a warning.

Processes that start together (``torchrun`` ranks on a cold cache) would each
scan every file. :func:`indexing_lock` lets one of them index while the
others wait, then list the folder again and find the entries written: an
advisory ``flock`` on ``.lock-<hash of the dataset's keys>`` in the folder,
removed when the indexing is done and released when the process ends however
it ends. Where the lock cannot be
taken (a folder that cannot be written, a file system without ``flock``)
each process indexes on its own, as before.

The folder is ``cache_dir`` when given, else ``$ZEPHON_CACHE_DIR``, else
``~/.cache/zephon_torch/index``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_torch.sources.handles import FileStat
from zephon_torch.sources.paths import is_url

__all__ = [
    "FORMAT_VERSION",
    "IndexInfo",
    "cache_write_advice",
    "default_cache_dir",
    "describe_index",
    "entry_name",
    "index_key",
    "indexing_lock",
    "list_entries",
    "load_index",
    "name_count",
    "remove_entry",
    "save_index",
]

#: Bumped whenever the meaning of a cached index changes.
FORMAT_VERSION = 2
_warned_dirs: set[str] = set()
_NAME = re.compile(r"^([0-9a-f]{40})\.(lf|cr)([0-9a-f]{32})(?:\.(0|[1-9][0-9]{0,17}))?\.npy$")
_log = logging.getLogger("zephon_torch")


@dataclass(frozen=True, slots=True)
class IndexInfo:
    """What an index says about its file.

    Attributes:
        line_end: ``"lf"`` (``\\n`` or ``\\r\\n``) or ``"cr"`` (``\\r`` only).
        digest: 32 hex digits: a hash of the index and the line ending.
        lines: The number of lines (rows of the index); None for an entry
            named before the count was part of the name.
    """

    line_end: str
    digest: str
    lines: int | None


def describe_index(index: np.ndarray, line_end: str) -> IndexInfo:
    """The :class:`IndexInfo` of an index (hashes the offsets and line numbers)."""
    h = hashlib.blake2b(line_end.encode(), digest_size=16)
    h.update(np.ascontiguousarray(index, dtype="<i8"))
    return IndexInfo(line_end, h.hexdigest(), len(index))


def default_cache_dir() -> str:
    """``$ZEPHON_CACHE_DIR`` if set, else ``~/.cache/zephon_torch/index``."""
    env = os.environ.get("ZEPHON_CACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "zephon_torch", "index")


def index_key(path: str, stat: FileStat, kind: str, edges: str) -> str | None:
    """The cache key of a file, or None when it cannot be keyed safely.

    Args:
        path: Local path or URL.
        stat: Its size and modification token.
        kind: What the index describes (``"lines.plain"``, ``"lines.gzip"`` ...).
        edges: The digest of its first and last bytes
            (:func:`~zephon_torch.sources.handles.edge_digest`).
    """
    if stat.mtime is None:  # without a change token a rewrite could reuse the entry
        return None
    where = path if is_url(path) else os.path.abspath(path)
    text = "\0".join([str(FORMAT_VERSION), kind, where, str(stat.size), stat.mtime, edges])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def entry_name(key: str, info: IndexInfo) -> str:
    """The file name of the entry for ``key`` holding an index described by ``info``."""
    if info.lines is None:
        raise ValueError(f"index cache: the entry for {key} needs its line count")
    return f"{key}.{info.line_end}{info.digest}.{info.lines}.npy"


def _info_of(match: re.Match[str]) -> IndexInfo:
    count = match.group(4)
    return IndexInfo(match.group(2), match.group(3), None if count is None else int(count))


def list_entries(cache_dir: str) -> dict[str, list[tuple[str, IndexInfo]]]:
    """``key -> [(file name, info), ...]`` of the folder's entries.

    A key normally has one entry. Several (a file rewritten keeping its size,
    times and edges, indexed again before the stale entry was noticed) are
    ambiguous: the caller removes them and indexes the file again.
    """
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return {}
    found: dict[str, list[tuple[str, IndexInfo]]] = {}
    for name in sorted(names):
        match = _NAME.match(name)
        if match is not None:
            found.setdefault(match.group(1), []).append((name, _info_of(match)))
    return found


def load_index(cache_dir: str, name: str) -> np.ndarray | None:
    """The cached index in entry ``name``, or None (missing, unreadable or damaged).

    The array is memory-mapped, so processes that read the same file share
    its pages instead of each holding a copy. It must hash to the digest in
    its name (:func:`describe_index`) and hold the number of lines its name
    gives: an entry edited or damaged on disk (a row deleted would silently
    drop a line) is None, so the caller indexes the file again and overwrites
    it. Hashing costs about 12 ms per million lines.
    """
    match = _NAME.match(name)
    if match is None:
        return None
    path = os.path.join(cache_dir, name)
    if not os.path.exists(path):
        return None
    try:
        try:
            index = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError:  # an empty array cannot be memory-mapped
            index = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None  # damaged entry: the caller rebuilds and overwrites it
    if index.ndim != 2 or index.shape[1] != 2 or index.dtype != np.int64:
        return None
    named = _info_of(match)
    found = describe_index(index, named.line_end)
    if found.digest != named.digest or named.lines not in (None, found.lines):
        return None  # not the index its name describes
    return index


def name_count(cache_dir: str, name: str, info: IndexInfo) -> str:
    """Rename an entry without a line count in its name to the name with it
    (``info`` has the count); the name to use (the old one if renaming fails)."""
    match = _NAME.match(name)
    if match is None or match.group(4) is not None:
        return name
    key = match.group(1)
    new = entry_name(key, info)
    try:
        os.replace(os.path.join(cache_dir, name), os.path.join(cache_dir, new))
    except OSError:
        return name  # read-only folder, or another process renamed it first
    return new


@contextlib.contextmanager
def indexing_lock(cache_dir: str, keys: Sequence[str], what: str) -> Iterator[bool]:
    """Hold the folder's lock for a dataset's files while it indexes them.

    Processes listing the same files (the same ``keys``) take turns: the
    first indexes, the others wait here, then list the folder again and find
    its entries. Yields True when the lock is held, False when it cannot be
    taken (the caller indexes without it, as every process did before).

    Args:
        cache_dir: The cache folder (created if missing).
        keys: The cache keys of the dataset's files, in order.
        what: The dataset, for the log line of a process that waits.
    """
    try:
        import fcntl
    except ImportError:  # no flock on this platform
        yield False
        return
    h = hashlib.blake2b(digest_size=16)
    for key in keys:
        h.update(key.encode() + b"\0")
    path = os.path.join(cache_dir, f".lock-{h.hexdigest()}")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd = _locked(fcntl, path, what, cache_dir)
    except OSError:  # a folder that cannot be written, a file system without flock
        yield False  # the write of the entries warns about the folder
        return
    try:
        yield True
    finally:
        # Removed while held, so the folder keeps only entries; a process that
        # waited on this file sees it gone and locks a new one (see _locked).
        with contextlib.suppress(OSError):
            os.unlink(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _locked(fcntl: Any, path: str, what: str, cache_dir: str) -> int:
    """An open descriptor of the lock file ``path``, locked; raises OSError."""
    waited = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waited:
                    _log.info("%s: waiting for another process indexing the same files "
                              "in %s", what, cache_dir)
                    waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)  # the holder removed the file as it finished: lock a new one


def remove_entry(cache_dir: str, name: str) -> None:
    """Delete an entry found stale (processes that mapped it keep their mapping)."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(cache_dir, name))


def save_index(cache_dir: str, key: str, index: np.ndarray, info: IndexInfo) -> str | None:
    """Write ``index`` atomically; its entry name, or None (one warning per folder)."""
    name = entry_name(key, info)
    final = os.path.join(cache_dir, name)
    tmp = f"{final}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(index, dtype=np.int64), allow_pickle=False)
        os.replace(tmp, final)
        return name
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if cache_dir not in _warned_dirs:
            _warned_dirs.add(cache_dir)
            warnings.warn(
                f"cannot write the JSONL index cache in {cache_dir!r} ({exc}); indexes stay "
                f"in memory and are rebuilt by each process. {cache_write_advice(exc)}",
                RuntimeWarning,
                stacklevel=3,
            )
        return None


_NO_HANDLES = (errno.EMFILE, errno.ENFILE)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_WRITABLE = "Pass cache_dir= or set ZEPHON_CACHE_DIR to a writable folder."


def cache_write_advice(exc: OSError) -> str:
    """What to do about ``exc``, raised while writing an index cache entry.

    The advice follows the error: a process out of file handles needs a
    higher open-file limit (another folder would fail the same way), a full
    disk needs space, a folder that cannot be written needs another folder.
    """
    if exc.errno in _NO_HANDLES:
        return ("The process (or the system) has too many files open, the folder may be "
                "fine: raise the open-file limit (ulimit -n, e.g. to 65536, or "
                "resource.setrlimit(RLIMIT_NOFILE)) or keep fewer files open at once (fewer "
                "shards, lanes or workers per process).")
    if exc.errno in _DISK_FULL:
        return ("The disk (or your quota) is full: free some space, or pass cache_dir= or "
                "set ZEPHON_CACHE_DIR to a folder on another disk.")
    return _WRITABLE
