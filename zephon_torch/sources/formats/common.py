"""What the file formats share: option checks, shard names, byte shares and digests.

Every file dataset names its shards relative to the files' common folder
(:func:`shard_names`), so a fingerprint holds no absolute path and a job can
move to another cluster: ``/data/a/x.jsonl`` and ``/data/b/y.jsonl`` are
shards ``a/x.jsonl`` and ``b/y.jsonl``.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

from zephon_torch.sources.base import Dataset, Shard
from zephon_torch.sources.caches import KeyedLocks, ReadOnceCache
from zephon_torch.sources.handles import RandomAccessFile, edge_digest
from zephon_torch.sources.paths import is_url

__all__ = [
    "FileDataset",
    "OnError",
    "check_component_id",
    "check_field",
    "check_name",
    "check_on_error",
    "check_passes",
    "content_signature",
    "even_share",
    "file_edges",
    "read_once",
    "shard_names",
]


#: What a dataset does with a bad file or sample: fail, or leave it out.
OnError = Literal["raise", "skip"]


def check_on_error(value: Any) -> OnError:
    """``on_error``: ``"raise"`` or ``"skip"``."""
    if value not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {value!r}")
    return value


def check_component_id(value: Any) -> int:
    """``component_id``: an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"component_id must be an integer >= 0, got {value!r}")
    return int(value)


def check_passes(value: Any) -> int | None:
    """A dataset's ``passes``: a positive integer, or None (the pipeline's)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"passes must be a positive integer or None (repeat forever), "
                         f"got {value!r}")
    return int(value)


def check_name(value: Any, default: str) -> str:
    """A dataset's ``name``: a non-empty string (None: ``default``)."""
    if value is None:
        return default
    if not isinstance(value, str) or not value:
        raise ValueError(f"name must be a non-empty string, got {value!r}")
    return value


def check_field(value: Any) -> str:
    """The payload ``field`` a text goes to: a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"field must be a non-empty string such as 'text', got {value!r}")
    return value


def shard_names(paths: Sequence[str]) -> list[str]:
    """Location-free names: each path relative to the files' common folder."""
    normed = [p.split("://", 1)[1] if is_url(p) else os.path.abspath(p).replace(os.sep, "/")
              for p in paths]
    try:
        root = posixpath.commonpath({posixpath.dirname(p) for p in normed})  # once each
    except ValueError:  # a mix of absolute and relative URL paths
        return [posixpath.basename(p) for p in normed]
    if not root:
        return [p.lstrip("/") for p in normed]
    # A local path is absolute and normal here, so its name under the root is its
    # tail: cut it without relpath, which costs ~10 us a path (a second at 100,000).
    cut = len(root) if root.endswith("/") else len(root) + 1
    under = root if root.endswith("/") else root + "/"
    return [p[cut:] if not is_url(raw) and p.startswith(under)
            else posixpath.relpath(p, root) for raw, p in zip(paths, normed)]


def even_share(total: int, count: int, ids: np.ndarray) -> int:
    """Bytes of ``ids`` when ``total`` bytes are spread evenly over ``count`` samples.

    Sample ``i`` gets ``floor((i+1)*total/count) - floor(i*total/count)``, so
    the shares of all samples add up to ``total`` exactly.
    """
    if count <= 0 or not ids.size:
        return 0
    ids = ids.astype(np.int64)
    return int(((ids + 1) * total // count - ids * total // count).sum())


class FileDataset(Dataset):
    """What every file dataset shares: options, shards and id checks."""

    def _init_options(self, *, component_id: Any, name: Any, passes: Any,
                      on_error: Any) -> None:
        self.on_error = check_on_error(on_error)
        self.component_id = check_component_id(component_id)
        self.passes = check_passes(passes)
        self.name = check_name(name, self.kind)
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


def file_edges(path: str, size: int, *extra: bytes) -> str:
    """:func:`edge_digest` of a file (opened and closed here)."""
    handle = RandomAccessFile(path)
    try:
        return edge_digest(handle, size, *extra)
    finally:
        handle.close()


def content_signature(*parts: str) -> str:
    """16 hex digits standing for ``parts`` (the content digest of a shard)."""
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).hexdigest()


T = TypeVar("T")


def read_once(cache: ReadOnceCache, locks: KeyedLocks, shard_id: int, unit: int,
              load: Callable[[], tuple[T, int]], *, key: Hashable | None = None) -> T:
    """A read unit (a block of lines, a row group) of a shard, loaded at most once.

    ``load`` gives the unit and how many of its samples will be read; the
    unit is kept in ``cache`` until that many have been. Threads that want a
    unit being loaded wait for that one load (``locks`` holds one lock per
    shard) instead of loading it again. ``key`` is the unit's place in the
    cache: the shard (``None``, one unit kept per shard) or ``(shard_id,
    unit)``, where several units of one shard may be read at once.
    """
    key = shard_id if key is None else key
    cached = cache.get(key, unit)
    if cached is not None:
        return cached
    with locks(shard_id):
        cached = cache.get(key, unit)
        if cached is not None:
            return cached
        value, samples = load()
        cache.put(key, unit, value, samples)
    return value
