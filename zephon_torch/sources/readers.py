"""Low-level file access for the file datasets, gathered where it has always been imported.

The pieces live in rooms of one concern; this module re-exports their names
so ``from zephon_torch.sources.readers import X`` keeps working:

* :mod:`~zephon_torch.sources.paths`: globs, folders and URLs into files
  (``expand_paths``, ``is_url``);
* :mod:`~zephon_torch.sources.handles`: opening files, what identifies their
  content, open handles per thread (``open_binary``, ``RandomAccessFile``,
  ``HandlePool``, ``stat_file``, ``edge_digest``, ``DataChangedError``);
* :mod:`~zephon_torch.sources.caches`: in-process caches and locks
  (``LRUCache``, ``ReadOnceCache``, ``KeyedLocks``);
* :mod:`~zephon_torch.sources.streams`: blocks and decompression
  (``iter_raw_blocks``, ``iter_decompressed``, ``TruncatedStreamError``);
* :mod:`~zephon_torch.sources.lines`: line splitting, the line index and
  reading lines by pointer (``LineScanner``, ``iter_lines``,
  ``read_lines_at``);
* :mod:`~zephon_torch.sources.index_cache`: the line index on disk.
"""

from __future__ import annotations

from zephon_torch.sources.caches import KeyedLocks, LRUCache, ReadOnceCache
from zephon_torch.sources.handles import (
    EDGE_BYTES,
    DataChangedError,
    FileStat,
    HandlePool,
    RandomAccessFile,
    edge_digest,
    open_binary,
    stat_file,
)
from zephon_torch.sources.lines import LineScanner, iter_lines, read_lines_at
from zephon_torch.sources.paths import expand_paths, is_url
from zephon_torch.sources.streams import (
    BLOCK_SIZE,
    TruncatedStreamError,
    iter_decompressed,
    iter_raw_blocks,
)

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
