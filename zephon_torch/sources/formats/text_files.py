"""Text files, each one document: a shard of one sample per file.

``text_files("notes/*.md")`` over ``notes/a.md`` and ``notes/b.md`` has shards
``0: a.md, 1 sample`` and ``1: b.md, 1 sample``; the raw payload is the file's
bytes, which ``decode_text`` makes ``{"text": ...}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon_torch.sources.base import Shard, count_read
from zephon_torch.sources.formats.common import (
    FileDataset,
    OnError,
    check_field,
    content_signature,
    file_edges,
    shard_names,
)
from zephon_torch.sources.formats.registry import CommandLineFormat, SourceFormat, register
from zephon_torch.sources.handles import DataChangedError, open_binary, stat_file
from zephon_torch.sources.paths import expand_paths

__all__ = ["TextFilesDataset", "text_files"]


class TextFilesDataset(FileDataset):
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
        self.field = check_field(field)
        files = expand_paths(paths, what="text_files", suffixes=None, on_error=self.on_error,
                             skipped=self.skipped_paths)
        self._paths = files
        self._sizes = [stat_file(p).size for p in files]
        self._digests = [content_signature("text", file_edges(p, size))
                         for p, size in zip(files, self._sizes)]
        self._shards = [Shard(shard_id=i, num_samples=1, name=n, path=p, access="pointer")
                        for i, (p, n) in enumerate(zip(files, shard_names(files)))]

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


def text_files(paths: str | Sequence[str], *, component_id: int = 0, name: str | None = None,
               passes: int | None = None, on_error: OnError = "raise",
               field: str = "text") -> TextFilesDataset:
    """Text files, one document each (see :class:`TextFilesDataset`)."""
    return TextFilesDataset(paths, component_id=component_id, name=name, passes=passes,
                            on_error=on_error, field=field)


register(SourceFormat(
    name="text_files", factory=text_files, builder="from_text_files",
    command_line=CommandLineFormat(name="text", label="text", suffixes=(".txt", ".md"),
                                   endings=(".txt", ".md", "*"), rank=2)))
