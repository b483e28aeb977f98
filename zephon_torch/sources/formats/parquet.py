"""Parquet files: one sample (a dict) per row, read by row group.

Counting reads the file metadata only. A read maps local ids to row groups
through the cumulative row counts and decodes only the groups it needs: in
a file of row groups of 1000, 1000 and 500 rows, ids ``[5, 1999, 2000]`` are
rows 5 and 999 of group 0 and 1 and row 0 of group 2. A decoded group is
kept until as many of its rows have been read as it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any, ClassVar

import numpy as np

from zephon_torch._extras import require
from zephon_torch.block_columns import Ragged, concat_columns
from zephon_torch.sources.base import Shard, count_read
from zephon_torch.sources.caches import KeyedLocks, ReadOnceCache
from zephon_torch.sources.formats.common import (
    FileDataset,
    OnError,
    content_signature,
    even_share,
    read_once,
    shard_names,
)
from zephon_torch.sources.formats.registry import CommandLineFormat, SourceFormat, register
from zephon_torch.sources.handles import (
    DataChangedError,
    HandlePool,
    RandomAccessFile,
    edge_digest,
    open_binary,
    stat_file,
)
from zephon_torch.sources.paths import expand_paths, is_url

__all__ = ["PARQUET_SUFFIXES", "ParquetDataset", "parquet"]


PARQUET_SUFFIXES = (".parquet", ".pq")


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
        return size, content_signature("parquet", edge_digest(handle, size, footer))
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

    A list column of numbers becomes a :class:`~zephon_torch.block_columns.Ragged`
    column: each row's run of values copied from the row group's buffers
    into one array of its own (no Arrow ``take``); other columns become
    lists. None for a column that cannot be held so (nulls in a token
    column, fixed-size lists).
    """
    import pyarrow as pa

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


class ParquetDataset(FileDataset):
    """Parquet files: one sample per row, read by row group.

    Counting uses the file metadata only. :meth:`read` maps local ids to row
    groups (cumulative row counts) and decodes only the row groups it needs;
    a decoded row group is kept (a small per-process LRU of row groups, of
    any shards) until as many of its rows have been read as it holds, so
    neighbouring ids do not decode it again, a finished group does not
    linger, and reads going on in two groups of one shard at once (chunks
    fetched side by side) do not evict each other's. A row is a dict; a list
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
    #: Decoded row groups kept (each until its rows are read), per process: at most
    #: this many, as many as when one group was kept per shard for 4 shards.
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
        for shard_id, (path, shard_name) in enumerate(zip(files, shard_names(files))):
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
        bounds = self._bounds[shard_id]
        return read_once(self._groups, self._decoding, shard_id, row_group, lambda: (
            self._read_row_group(shard_id, row_group),
            int(bounds[row_group + 1] - bounds[row_group])), key=(shard_id, row_group))

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
            self._groups.spend((shard_id, first), first, ids.size)
            return rows
        out: list[Any] = [None] * ids.size
        used, first_use = np.unique(groups, return_index=True)
        # Each group read once, in order of first use: the one read last, kept, is
        # where the next call goes on (a shuffled pass visits a row group's rows in
        # consecutive calls).
        for group in used[np.argsort(first_use)].tolist():
            where = np.flatnonzero(groups == group)
            rows = _table_rows(self._row_group(shard_id, group), ids[where] - bounds[group])
            self._groups.spend((shard_id, group), group, where.size)
            for position, row in zip(where.tolist(), rows):
                out[position] = row
        return out

    def read_columns(self, shard_id: int, local_ids: Sequence[int]) -> dict[str, Any] | None:
        """The rows ``local_ids`` (in that order) as columns, for a block of rows.

        A list column of numbers without nulls becomes one
        :class:`~zephon_torch.block_columns.Ragged` column sliced from Arrow's
        offsets (its values copied once, so they are writable and hold no
        Arrow memory), with no Python per row; any other column becomes a
        list of Python values. Row ``i`` of the columns is exactly what
        :meth:`read` gives for it. None when a column cannot be held so (a
        null list, a fixed-size list): the caller then reads rows.
        """
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
            self._groups.spend((shard_id, group), group, stop - start)
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
            total += even_share(int(sizes[group]), int(bounds[group + 1] - bounds[group]), rows)
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


def parquet(paths: str | Sequence[str], *, columns: Sequence[str] | None = None,
            component_id: int = 0, name: str | None = None, passes: int | None = None,
            on_error: OnError = "raise") -> ParquetDataset:
    """Parquet files, one sample per row (see :class:`ParquetDataset`)."""
    return ParquetDataset(paths, columns=columns, component_id=component_id, name=name,
                          passes=passes, on_error=on_error)


register(SourceFormat(
    name="parquet", factory=parquet, builder="from_parquet",
    command_line=CommandLineFormat(name="parquet", label="Parquet", suffixes=(".parquet",),
                                   marks=(".parquet",), rank=0)))
