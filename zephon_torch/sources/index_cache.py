"""The on-disk cache of JSONL line indexes.

Scanning a large JSONL file to find its lines takes one full read; every
process and every later run would repeat it. The index (``(n, 2)`` int64:
byte offset and 1-based line number of each non-blank line) is therefore
saved once as a ``.npy`` file whose name is a hash of what identifies the
file's content: its absolute path (or URL), its size and its modification
time. A file that changes gets a new name, so a stale index is never read;
old entries are simply left behind (delete the folder to reclaim space).

Writes are atomic (a temporary file in the same folder, then
``os.replace``): processes racing to index the same file each write a
complete file and the last rename wins, and a reader never sees half a file.
A cache folder that cannot be written is not an error: the index is then
kept in memory only, with a warning.

The folder is ``cache_dir`` when given, else ``$ZEPHON_CACHE_DIR``, else
``~/.cache/zephon_torch/index``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
import warnings

import numpy as np

from zephon_torch.sources.readers import FileStat, is_url

__all__ = ["FORMAT_VERSION", "default_cache_dir", "index_key", "load_index", "save_index"]

#: Bumped whenever the meaning of a cached index changes.
FORMAT_VERSION = 1
_warned_dirs: set[str] = set()


def default_cache_dir() -> str:
    """``$ZEPHON_CACHE_DIR`` if set, else ``~/.cache/zephon_torch/index``."""
    env = os.environ.get("ZEPHON_CACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "zephon_torch", "index")


def index_key(path: str, stat: FileStat, kind: str) -> str | None:
    """The cache file stem for a file, or None when it cannot be keyed safely.

    Args:
        path: Local path or URL.
        stat: Its size and modification token.
        kind: What the index describes (``"lines"`` or ``"lines.gzip"`` ...).
    """
    if stat.mtime is None:  # without a change token a rewrite could reuse the entry
        return None
    where = path if is_url(path) else os.path.abspath(path)
    text = "\0".join([str(FORMAT_VERSION), kind, where, str(stat.size), stat.mtime])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _file(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"{key}.npy")


def load_index(cache_dir: str, key: str) -> np.ndarray | None:
    """The cached index for ``key``, or None (missing or unreadable).

    The array is memory-mapped, so processes that read the same file share
    its pages instead of each holding a copy.
    """
    path = _file(cache_dir, key)
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
    return index


def save_index(cache_dir: str, key: str, index: np.ndarray) -> bool:
    """Write ``index`` atomically; False (with one warning per folder) on failure."""
    final = _file(cache_dir, key)
    tmp = f"{final}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(index, dtype=np.int64), allow_pickle=False)
        os.replace(tmp, final)
        return True
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if cache_dir not in _warned_dirs:
            _warned_dirs.add(cache_dir)
            warnings.warn(
                f"cannot write the JSONL index cache in {cache_dir!r} ({exc}); indexes stay "
                "in memory and are rebuilt by each process. Pass cache_dir= or set "
                "ZEPHON_CACHE_DIR to a writable folder.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
