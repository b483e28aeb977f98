"""Sources: datasets (mixture components), shards, and the work schedule.

``zt.sources.items/jsonl/parquet/text_files`` build dataset objects for
``Pipeline.from_sources``; each carries its ``component_id``. Each format is
one module of ``zephon_torch.sources.formats``, registered by name;
:class:`SourceOptions` documents the options every ``Pipeline.from_*`` takes.
"""

from zephon_torch.sources.base import POINTER, Dataset, Pointer, Shard, is_pointer
from zephon_torch.sources.datasets import (
    ItemsDataset,
    JsonlDataset,
    ParquetDataset,
    TextFilesDataset,
    items,
    jsonl,
    parquet,
    text_files,
)
from zephon_torch.sources.handles import DataChangedError
from zephon_torch.sources.options import SourceOptions

__all__ = [
    "POINTER",
    "DataChangedError",
    "Dataset",
    "ItemsDataset",
    "JsonlDataset",
    "ParquetDataset",
    "Pointer",
    "Shard",
    "SourceOptions",
    "TextFilesDataset",
    "is_pointer",
    "items",
    "jsonl",
    "parquet",
    "text_files",
]
