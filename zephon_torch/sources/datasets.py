"""The built-in datasets: in-memory items, JSONL, Parquet and text files.

Each format is a module of :mod:`zephon_torch.sources.formats`, registered
by name; this module gathers their dataset classes and factories where
users have always imported them (``from zephon_torch.sources import
datasets``).

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
:class:`~zephon_torch.sources.handles.HandlePool` and
:class:`~zephon_torch.sources.caches.LRUCache`); line indexes that are on
disk are memory-mapped again where they are needed.

Fingerprints (:meth:`Dataset.describe`) hold shard names relative to the
files' common folder (just the base names when the files share a folder),
never absolute paths, so a job can move to another cluster.
"""

from __future__ import annotations

# ``Dataset``, ``OnError`` and the suffix lists have always been importable from here too.
from zephon_torch.sources.base import Dataset  # noqa: F401
from zephon_torch.sources.formats.common import OnError  # noqa: F401
from zephon_torch.sources.formats.items import ItemsDataset, items
from zephon_torch.sources.formats.jsonl import JSONL_SUFFIXES, JsonlDataset, jsonl  # noqa: F401
from zephon_torch.sources.formats.parquet import (  # noqa: F401
    PARQUET_SUFFIXES,
    ParquetDataset,
    parquet,
)
from zephon_torch.sources.formats.text_files import TextFilesDataset, text_files

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
