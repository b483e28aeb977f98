"""The built-in datasets: counting, reading, caching, errors and pickling."""

from __future__ import annotations

import errno
import gzip
import itertools
import json
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from corpus import assert_scanned_as
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.sources import caches, handles
from zephon_torch.sources import datasets as zd
from zephon_torch.sources.base import Dataset

# ---------------------------------------------------------------- helpers


def write_lines(path: Path, lines: list[str], *, end: str = "\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("".join(line + end for line in lines).encode())
    return path


def docs(n: int, prefix: str = "d") -> list[str]:
    return [json.dumps({"text": f"{prefix}{i}", "i": i}) for i in range(n)]


def write_parquet(path: Path, table: pa.Table, *, row_group_size: int) -> Path:
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


# ---------------------------------------------------------------- jsonl


def test_jsonl_counts_non_blank_lines_and_reads_in_requested_order(tmp_path, cache):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text":"x0"}\n\n   \t\n{"text":"x1"}\r\n{"text":"x2"}')
    ds = zd.jsonl(str(path), cache_dir=cache)
    assert isinstance(ds, Dataset) and isinstance(ds, zd.JsonlDataset)
    assert ds.kind == "jsonl" and ds.raw_format == "json"
    [shard] = ds.shards()
    assert (shard.shard_id, shard.num_samples, shard.access) == (0, 3, "pointer")
    assert ds.read(0, [2, 0, 1, 0]) == [b'{"text":"x2"}', b'{"text":"x0"}',
                                        b'{"text":"x1"}', b'{"text":"x0"}']
    assert ds.read(0, []) == []
    assert [ds.locate(0, i) for i in range(3)] == [f"{path} line 1", f"{path} line 4",
                                                   f"{path} line 5"]
    assert list(ds.stream(0)) == ds.read(0, [0, 1, 2])


def test_jsonl_random_reads_match_a_naive_reader(tmp_path, cache):
    lines = [json.dumps({"text": "w" * (i * 37 % 300), "i": i}) for i in range(2000)]
    lines[10:12] = ["", "  "]
    path = write_lines(tmp_path / "big.jsonl", lines)
    expected = [line.encode() for line in lines if line.strip()]
    ds = zd.jsonl(path, cache_dir=cache)
    assert len(ds) == len(expected)
    ids = np.random.default_rng(0).integers(0, len(expected), 300).tolist()
    assert ds.read(0, ids) == [expected[i] for i in ids]
    assert ds.read(0, range(len(expected))) == expected


def test_jsonl_read_rejects_out_of_range_ids(tmp_path, cache):
    ds = zd.jsonl(write_lines(tmp_path / "a.jsonl", docs(3)), cache_dir=cache)
    with pytest.raises(IndexError, match="sample 3 is out of range"):
        ds.read(0, [3])
    with pytest.raises(IndexError, match="shard 1 does not exist"):
        ds.read(1, [0])


def test_jsonl_glob_sorts_shards_by_path_and_names_them_without_location(tmp_path, cache):
    for name, n in [("part-2.jsonl", 2), ("part-0.jsonl", 3), ("part-1.jsonl", 1)]:
        write_lines(tmp_path / "data" / name, docs(n, name))
    ds = zd.jsonl(str(tmp_path / "data" / "part-*.jsonl"), cache_dir=cache)
    assert [(s.shard_id, s.name, s.num_samples) for s in ds.shards()] == [
        (0, "part-0.jsonl", 3), (1, "part-1.jsonl", 1), (2, "part-2.jsonl", 2)]
    assert json.loads(ds.read(2, [1])[0])["text"] == "part-2.jsonl1"
    described = json.dumps(ds.describe())
    assert str(tmp_path) not in described
    assert ds.describe()["shards"] == [["part-0.jsonl", 3], ["part-1.jsonl", 1],
                                       ["part-2.jsonl", 2]]


def test_jsonl_list_order_does_not_change_shard_ids_and_duplicates_collapse(tmp_path, cache):
    a = write_lines(tmp_path / "x" / "a.jsonl", docs(1))
    b = write_lines(tmp_path / "y" / "b.jsonl", docs(2))
    ds = zd.jsonl([str(b), str(a), str(a)], cache_dir=cache)
    assert [s.path for s in ds.shards()] == [str(a), str(b)]
    assert [s.name for s in ds.shards()] == ["x/a.jsonl", "y/b.jsonl"]


def test_jsonl_directory_means_its_jsonl_files(tmp_path, cache):
    write_lines(tmp_path / "d" / "a.jsonl", docs(2))
    write_lines(tmp_path / "d" / "notes.txt", ["skip me"])
    ds = zd.jsonl(tmp_path / "d", cache_dir=cache)
    assert [s.name for s in ds.shards()] == ["a.jsonl"]


def test_empty_jsonl_file_is_a_shard_with_no_samples(tmp_path, cache):
    (tmp_path / "e.jsonl").write_bytes(b"")
    (tmp_path / "w.jsonl").write_bytes(b"\n \n\n")
    ds = zd.jsonl(str(tmp_path / "*.jsonl"), cache_dir=cache)
    assert [s.num_samples for s in ds.shards()] == [0, 0]
    assert list(ds.stream(0)) == [] and ds.read(1, []) == []


def test_jsonl_index_is_cached_as_npy_and_reused(tmp_path, cache, monkeypatch):
    path = write_lines(tmp_path / "a.jsonl", ["", *docs(4)])
    first = zd.jsonl(path, cache_dir=cache)
    [entry] = list(cache.iterdir())
    index = np.load(entry)
    assert entry.suffix == ".npy" and index.dtype == np.int64 and index.shape == (4, 2)
    assert index[:, 1].tolist() == [2, 3, 4, 5]  # 1-based line numbers, blank line 1 skipped

    def no_scan(self, file):
        raise AssertionError("the cached index should have been used")

    monkeypatch.setattr(zd.JsonlDataset, "_scan", no_scan)
    again = zd.jsonl(path, cache_dir=cache)
    assert again.read(0, [3, 0]) == first.read(0, [3, 0])
    assert len(list(cache.iterdir())) == 1


def test_jsonl_index_is_rebuilt_when_the_file_changes(tmp_path, cache):
    path = write_lines(tmp_path / "a.jsonl", docs(3))
    assert len(zd.jsonl(path, cache_dir=cache)) == 3
    write_lines(path, docs(5, "new"))
    ds = zd.jsonl(path, cache_dir=cache)
    assert len(ds) == 5 and json.loads(ds.read(0, [4])[0])["text"] == "new4"
    # Same size, new modification time: still a new index.
    before = path.read_bytes()
    path.write_bytes(before.replace(b"new0", b"old0"))
    os.utime(path, ns=(1, 1))
    ds = zd.jsonl(path, cache_dir=cache)
    assert json.loads(ds.read(0, [0])[0])["text"] == "old0"
    assert len(list(cache.iterdir())) == 3


def test_jsonl_read_notices_a_file_changed_after_indexing(tmp_path, cache):
    path = write_lines(tmp_path / "a.jsonl", docs(3))
    ds = zd.jsonl(path, cache_dir=cache)
    write_lines(path, docs(2))
    with pytest.raises(ValueError, match="changed since it was indexed") as caught:
        ds.read(0, [0])
    message = str(caught.value)
    assert message.count("changed since") == 1 and message.count("jsonl: ") == 1, message
    assert "then, " in message and "restart the pipeline" in message


def test_jsonl_read_names_a_rewrite_of_the_same_size_as_modified(tmp_path, cache):
    path = write_lines(tmp_path / "a.jsonl", docs(3))
    ds = zd.jsonl(path, cache_dir=cache)
    stat = path.stat()
    path.write_bytes(path.read_bytes().replace(b"\"d0\"", b"\"D0\""))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match=r"\(same size, modified since\); restart the "):
        ds.read(0, [0])


def test_jsonl_default_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "env-cache"))
    ds = zd.jsonl(write_lines(tmp_path / "a.jsonl", docs(2)))
    assert ds.cache_dir == str(tmp_path / "env-cache")
    assert len(list((tmp_path / "env-cache").iterdir())) == 1


def test_jsonl_unwritable_cache_dir_warns_and_keeps_the_index_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    path = write_lines(tmp_path / "a.jsonl", docs(3))
    with pytest.warns(RuntimeWarning, match="cannot write the JSONL index cache"):
        ds = zd.jsonl(path, cache_dir=blocker / "sub")
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.read(0, [2]) == ds.read(0, [2]) == [docs(3)[2].encode()]


def test_jsonl_cache_entry_removed_later_is_rebuilt_on_read(tmp_path, cache):
    path = write_lines(tmp_path / "a.jsonl", docs(3))
    ds = pickle.loads(pickle.dumps(zd.jsonl(path, cache_dir=cache)))
    for entry in cache.iterdir():
        entry.unlink()
    assert ds.read(0, [1]) == [docs(3)[1].encode()]
    assert ds.locate(0, 1) == f"{path} line 2"


def test_gzip_and_zstd_shards_are_streams_with_counts_and_line_numbers(tmp_path, cache):
    body = ("\n".join(docs(5)) + "\n\n").encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(body[:30]) + gzip.compress(body[30:]))
    cctx = zstandard.ZstdCompressor()
    (tmp_path / "b.jsonl.zst").write_bytes(cctx.compress(body[:50]) + cctx.compress(body[50:]))
    ds = zd.jsonl([str(tmp_path / "b.jsonl.zst"), str(tmp_path / "a.jsonl.gz")],
                  cache_dir=cache)
    assert [(s.name, s.num_samples, s.access) for s in ds.shards()] == [
        ("a.jsonl.gz", 5, "stream"), ("b.jsonl.zst", 5, "stream")]
    expected = [d.encode() for d in docs(5)]
    assert list(ds.stream(0)) == expected and list(ds.stream(1)) == expected
    assert ds.locate(1, 4) == f"{tmp_path / 'b.jsonl.zst'} line 5"
    with pytest.raises(ValueError, match="can only be read in order with stream"):
        ds.read(0, [0])
    # The counts are cached too: a second dataset does not decompress to count.
    assert len(list(cache.iterdir())) == 2
    assert len(zd.jsonl(str(tmp_path / "*.jsonl.*"), cache_dir=cache)) == 10


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_truncated_compressed_file_raises_naming_the_file(tmp_path, cache, suffix):
    body = ("\n".join(docs(2000)) + "\n").encode()
    packed = gzip.compress(body) if suffix.endswith("gz") else zstandard.compress(body)
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.(gz|zst).*truncated.*on_error='skip'"):
        zd.jsonl(path, cache_dir=cache)


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_truncated_compressed_file_with_skip_keeps_complete_lines(tmp_path, cache, suffix):
    lines = docs(20_000)  # several zstd blocks: the ones before the cut decode
    body = ("\n".join(lines) + "\n").encode()
    packed = gzip.compress(body) if suffix.endswith("gz") else zstandard.compress(body)
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.warns(RuntimeWarning, match="keeps the .* complete lines"):
        ds = zd.jsonl(path, cache_dir=cache, on_error="skip")
    n = len(ds)
    assert 0 < n < 20_000
    streamed = list(ds.stream(0))
    assert streamed == [line.encode() for line in lines[:n]]
    assert not cache.exists() or not list(cache.iterdir())  # a damaged count is not cached


def test_corrupt_gzip_is_reported(tmp_path, cache):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(b"this is not gzip at all")
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz.*corrupt"):
        zd.jsonl(path, cache_dir=cache)


def test_jsonl_reads_fsspec_urls_and_globs(cache):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/zt-test/p-1.jsonl", ("\n".join(docs(2, "b")) + "\n").encode())
    fs.pipe("/zt-test/p-0.jsonl", ("\n".join(docs(3, "a")) + "\n").encode())
    fs.pipe("/zt-test/p-2.jsonl.gz", gzip.compress(b'{"text":"z"}\n'))
    try:
        ds = zd.jsonl("memory://zt-test/p-*", cache_dir=cache)
        assert [(s.name, s.num_samples) for s in ds.shards()] == [
            ("p-0.jsonl", 3), ("p-1.jsonl", 2), ("p-2.jsonl.gz", 1)]
        assert ds.read(1, [1, 0]) == [docs(2, "b")[1].encode(), docs(2, "b")[0].encode()]
        assert list(ds.stream(2)) == [b'{"text":"z"}']
        single = zd.jsonl("memory://zt-test/p-0.jsonl", cache_dir=cache)
        assert single.read(0, [2]) == [docs(3, "a")[2].encode()]
    finally:
        fs.rm("/zt-test", recursive=True)


def test_jsonl_concurrent_reads_from_threads_agree(tmp_path, cache):
    from concurrent.futures import ThreadPoolExecutor

    lines = docs(3000)
    ds = zd.jsonl(write_lines(tmp_path / "a.jsonl", lines), cache_dir=cache)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 3000, 64).tolist() for _ in range(64)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda ids: ds.read(0, ids), batches))
    assert results == [[lines[i].encode() for i in ids] for ids in batches]


def test_parquet_and_text_files_read_fsspec_urls():
    import fsspec

    fs = fsspec.filesystem("memory")
    with fs.open("/zt-pq/a.parquet", "wb") as f:
        pq.write_table(token_table(5), f, row_group_size=2)
    fs.pipe("/zt-pq/doc.txt", b"remote text")
    try:
        ds = zd.parquet("memory://zt-pq/*.parquet")
        assert [r["text"] for r in ds.read(0, [4, 1])] == ["row4", "row1"]
        assert zd.text_files("memory://zt-pq/doc.txt").read(0, [0]) == [b"remote text"]
    finally:
        fs.rm("/zt-pq", recursive=True)


def test_jsonl_pickles_after_reads_without_open_files(tmp_path, cache):
    path = write_lines(tmp_path / "a.jsonl", docs(50))
    ds = zd.jsonl(path, cache_dir=cache)
    assert ds.read(0, [3]) == [docs(50)[3].encode()]
    payload = pickle.dumps(ds)
    assert len(payload) < 4000  # no index, no handle, no buffered data
    clone = pickle.loads(payload)
    assert clone.read(0, [49, 3]) == [docs(50)[49].encode(), docs(50)[3].encode()]
    assert ds.read(0, [7]) == [docs(50)[7].encode()]  # the original still works


def test_readers_handle_pool_is_per_thread_and_bounded(tmp_path):
    import threading

    opened: list[int] = []
    pool = handles.HandlePool(2)
    for key in range(4):
        pool.get(key, lambda k=key: opened.append(k) or object())
    assert opened == [0, 1, 2, 3]
    pool.get(3, lambda: pytest.fail("cached handle reopened"))
    seen = []
    thread = threading.Thread(target=lambda: seen.append(pool.get(3, lambda: "other")))
    thread.start()
    thread.join()
    assert seen == ["other"]


def test_readers_module_still_offers_every_name_from_its_new_home():
    # The low-level readers were split into rooms of one concern; the old module
    # re-exports each name, the same object, for code that imports it from there.
    from zephon_torch.sources import lines, paths, readers, streams

    homes = (caches, handles, lines, paths, streams)
    for name in readers.__all__:
        owners = [home for home in homes if name in home.__all__]
        assert len(owners) == 1, name
        assert getattr(readers, name) is getattr(owners[0], name), name


@settings(max_examples=150, deadline=None)
@given(
    lines=st.lists(st.sampled_from(["", " ", "\t", "a", "bc", " x ", "{}", "é", "\r", "\x00"]),
                   max_size=30),
    final_newline=st.booleans(),
    block=st.integers(1, 9),
)
def test_line_scanner_and_line_iterator_agree_with_a_naive_split(lines, final_newline, block):
    data = "\n".join(lines).encode() + (b"\n" if final_newline and lines else b"")
    expected, offset = [], 0
    for number, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():
            expected.append((offset, number, line[:-1] if line.endswith(b"\r") else line))
        offset += len(line) + 1
    assert_scanned_as(data, block, expected)


# ---------------------------------------------------------------- parquet


def token_table(n: int) -> pa.Table:
    return pa.table({
        "text": [f"row{i}" for i in range(n)],
        "ids": pa.array([list(range(i % 5)) for i in range(n)], type=pa.list_(pa.int32())),
        "score": [float(i) for i in range(n)],
    })


def test_parquet_counts_from_metadata_and_reads_rows_in_order(tmp_path):
    write_parquet(tmp_path / "b.parquet", token_table(7), row_group_size=3)
    write_parquet(tmp_path / "a.parquet", token_table(10), row_group_size=4)
    ds = zd.parquet(str(tmp_path / "*.parquet"))
    assert ds.raw_format == "dict" and ds.kind == "parquet"
    assert [(s.name, s.num_samples, s.access) for s in ds.shards()] == [
        ("a.parquet", 10, "pointer"), ("b.parquet", 7, "pointer")]
    rows = ds.read(0, [9, 0, 5, 5, 4])
    assert [r["text"] for r in rows] == ["row9", "row0", "row5", "row5", "row4"]
    assert rows[0]["ids"].dtype == np.int32 and rows[0]["ids"].tolist() == [0, 1, 2, 3]
    assert rows[1]["ids"].tolist() == [] and rows[1]["ids"].dtype == np.int32
    assert rows[0]["score"] == 9.0
    assert rows[2] is not rows[3]
    assert ds.locate(1, 6) == f"{tmp_path / 'b.parquet'} row 6"


def test_parquet_reads_only_the_row_groups_it_needs_and_keeps_the_last_one(tmp_path):
    write_parquet(tmp_path / "a.parquet", token_table(12), row_group_size=4)

    class Counting(zd.ParquetDataset):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls: list[tuple[int, int]] = []

        def _read_row_group(self, shard_id, row_group):
            self.calls.append((shard_id, row_group))
            return super()._read_row_group(shard_id, row_group)

    ds = Counting(tmp_path / "a.parquet")
    assert [r["text"] for r in ds.read(0, [5, 6])] == ["row5", "row6"]
    assert ds.calls == [(0, 1)]
    ds.read(0, [7, 4])  # same row group: served from the cache
    assert ds.calls == [(0, 1)]
    ds.read(0, [11, 1, 10])  # in order of first use: the group read last is kept
    assert ds.calls == [(0, 1), (0, 2), (0, 0)]
    ds.read(0, [3, 0])  # the next call goes on where the last one ended: no decode
    assert ds.calls == [(0, 1), (0, 2), (0, 0)]


@pytest.mark.parametrize("value_type", [pa.int32(), pa.int64(), pa.uint16(), pa.float32()])
def test_scattered_rows_of_a_token_column_equal_the_rows_read_one_by_one(tmp_path, value_type):
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(0, 40, size=90)]
    table = pa.table({"input_ids": pa.array(docs, type=pa.list_(value_type))})
    ds = zd.parquet(write_parquet(tmp_path / "t.parquet", table, row_group_size=30))
    ids = rng.permutation(90)
    ids = np.concatenate([ids, ids[:7]])  # a sample asked for twice in one call
    rows = ds.read(0, ids)  # scattered in each row group: gathered without an Arrow take
    for i, row in zip(ids.tolist(), rows):
        alone = ds.read(0, [i])[0]["input_ids"]
        assert row["input_ids"].dtype == alone.dtype == value_type.to_pandas_dtype()
        assert row["input_ids"].tolist() == alone.tolist() == docs[i]
        assert row["input_ids"].flags.writeable and row["input_ids"].flags.owndata
    rows[0]["input_ids"][...] = 0  # each row its own memory
    assert all(r["input_ids"].tolist() == docs[i] for i, r in zip(ids[1:].tolist(), rows[1:])
               if i != ids[0])


def test_parquet_columns_select_and_missing_column_is_an_error(tmp_path):
    write_parquet(tmp_path / "a.parquet", token_table(3), row_group_size=2)
    ds = zd.parquet(tmp_path / "a.parquet", columns=["text"])
    assert ds.read(0, [2]) == [{"text": "row2"}]
    assert ds.describe()["columns"] == ["text"]
    assert zd.parquet(tmp_path / "a.parquet", columns="score").read(0, [1]) == [{"score": 1.0}]
    with pytest.raises(ValueError, match=r"no column 'body'.*columns are"):
        zd.parquet(tmp_path / "a.parquet", columns=["text", "body"])


def test_parquet_list_columns_with_nulls_and_other_types(tmp_path):
    table = pa.table({
        "ids": pa.array([[1, 2], None, [3]], type=pa.list_(pa.int64())),
        "holes": pa.array([[1, None], [2], []], type=pa.list_(pa.int32())),
        "fixed": pa.array([[1.0, 2.0], [3.0, 4.0], None], type=pa.list_(pa.float32(), 2)),
        "words": pa.array([["a"], [], ["b", "c"]]),
    })
    write_parquet(tmp_path / "a.parquet", table, row_group_size=10)
    rows = zd.parquet(tmp_path / "a.parquet").read(0, [0, 1, 2])
    assert rows[0]["ids"].dtype == np.int64 and rows[1]["ids"] is None
    assert rows[0]["holes"] == [1, None]  # a null inside a number list stays a list
    assert rows[0]["fixed"].dtype == np.float32 and rows[2]["fixed"] is None
    assert rows[2]["words"] == ["b", "c"]


@pytest.mark.parametrize("ids", [[4, 5, 6, 7], [7, 4, 6], [1, 6, 9]],
                         ids=["contiguous", "one-group-unordered", "across-groups"])
def test_parquet_number_lists_are_private_writable_arrays(tmp_path, ids):
    write_parquet(tmp_path / "a.parquet", token_table(12), row_group_size=8)
    ds = zd.parquet(tmp_path / "a.parquet", columns=["ids"])
    rows = [r["ids"] for r in ds.read(0, ids)]
    assert [r.tolist() for r in rows] == [list(range(i % 5)) for i in ids]
    for row in rows:
        # Writable and backed by memory numpy owns: no view into Arrow's buffers.
        assert row.flags.writeable and row.flags.c_contiguous
        owner = row if row.base is None else row.base
        assert isinstance(owner, np.ndarray) and owner.flags.owndata
    for a, b in itertools.combinations(rows, 2):
        assert not np.shares_memory(a, b)
    for row in rows:
        row[:] = -1
    # Neither the other rows of the read nor the cached row group changed.
    again = [r["ids"].tolist() for r in ds.read(0, ids)]
    assert again == [list(range(i % 5)) for i in ids]
    assert all((row == -1).all() for row in rows)


def test_parquet_file_that_cannot_be_opened(tmp_path):
    write_parquet(tmp_path / "a.parquet", token_table(3), row_group_size=2)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 definitely not parquet")
    with pytest.raises(ValueError, match=r"cannot open .*broken\.parquet.*on_error='skip'"):
        zd.parquet(str(tmp_path / "*.parquet"))
    with pytest.warns(RuntimeWarning, match=r"broken\.parquet.*0 samples"):
        ds = zd.parquet(str(tmp_path / "*.parquet"), on_error="skip")
    assert [s.num_samples for s in ds.shards()] == [3, 0]


def test_empty_parquet_file_is_a_shard_with_no_samples(tmp_path):
    write_parquet(tmp_path / "e.parquet", token_table(0), row_group_size=4)
    ds = zd.parquet(tmp_path / "e.parquet")
    assert len(ds) == 0 and ds.read(0, []) == []


def test_parquet_pickles_after_reads(tmp_path):
    write_parquet(tmp_path / "a.parquet", token_table(9), row_group_size=3)
    ds = zd.parquet(tmp_path / "a.parquet")
    ds.read(0, [4])
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone._groups) == 0
    assert [r["text"] for r in clone.read(0, [8, 4])] == ["row8", "row4"]


# ---------------------------------------------------------------- text files


def test_text_files_are_one_document_each(tmp_path):
    (tmp_path / "b.txt").write_bytes("second ✓".encode())
    (tmp_path / "a.md").write_bytes(b"first\nwith two lines\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    ds = zd.text_files(str(tmp_path / "*"), field="body")
    assert ds.raw_format == "text" and ds.field == "body"
    assert [(s.name, s.num_samples, s.access) for s in ds.shards()] == [
        ("a.md", 1, "pointer"), ("b.txt", 1, "pointer"), ("empty.txt", 1, "pointer")]
    assert ds.read(1, [0]) == ["second ✓".encode()]
    assert ds.read(2, [0]) == [b""]
    assert ds.locate(0, 0) == str(tmp_path / "a.md")
    assert ds.describe()["field"] == "body"
    assert str(tmp_path) not in json.dumps(ds.describe())
    assert pickle.loads(pickle.dumps(ds)).read(0, [0]) == [b"first\nwith two lines\n"]
    with pytest.raises(IndexError):
        ds.read(0, [1])


# ---------------------------------------------------------------- items


def test_items_are_inline_payloads_and_dicts_are_not_copied():
    doc = {"text": "hello", "n": 1}
    ds = zd.items([doc, "plain", np.arange(3, dtype=np.int32)], component_id=2, passes=3)
    assert isinstance(ds, zd.ItemsDataset) and ds.raw_format == "dict"
    [shard] = ds.shards()
    assert (shard.num_samples, shard.access, shard.path) == (3, "inline", None)
    first, second, third = ds.read(0, [0, 1, 2])
    assert first is doc and second == {"text": "plain"} and third.dtype == np.int32
    assert next(iter(ds.stream(0))) is doc
    assert ds.component_id == 2 and ds.passes == 3 and ds.locate(0, 1) == "items[1]"
    assert ds.describe()["shards"] == [["items", 3]]
    assert zd.items(x for x in ["a", "b"]).read(0, [1]) == [{"text": "b"}]


def test_items_errors_name_the_problem():
    with pytest.raises(ValueError, match="wrap it in a list"):
        zd.items("just one string")
    with pytest.raises(TypeError, match=r"items\[1\] is a int"):
        zd.items([{"text": "a"}, 5])
    with pytest.raises(ValueError, match="sequence of payloads"):
        zd.items(42)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("factory", [zd.jsonl, zd.parquet, zd.text_files])
def test_empty_paths_and_unmatched_globs_are_errors(tmp_path, factory):
    with pytest.raises(ValueError, match="paths is empty"):
        factory([])
    with pytest.raises(FileNotFoundError, match=r"nothing-\*\.jsonl.*matches no file"):
        factory(str(tmp_path / "nothing-*.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl.*matches no file"):
        factory([str(tmp_path / "missing.jsonl")])


def test_unknown_extensions_list_the_supported_ones(tmp_path, cache):
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(ValueError, match=r"a\.csv.*unsupported extension.*\.jsonl, \.jsonl\.gz"):
        zd.jsonl(tmp_path / "a.csv", cache_dir=cache)
    with pytest.raises(ValueError, match=r"unsupported extension; supported: \.parquet"):
        zd.parquet(tmp_path / "a.csv")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"on_error": "ignore"}, "on_error must be 'raise' or 'skip', got 'ignore'"),
        ({"component_id": -1}, "component_id must be an integer >= 0"),
        ({"passes": 0}, "passes must be a positive integer or None"),
        ({"name": ""}, "name must be a non-empty string"),
    ],
)
def test_bad_options_are_rejected_by_every_source(tmp_path, cache, kwargs, message):
    path = write_lines(tmp_path / "a.jsonl", docs(1))
    write_parquet(tmp_path / "a.parquet", token_table(1), row_group_size=1)
    with pytest.raises(ValueError, match=message):
        zd.jsonl(path, cache_dir=cache, **kwargs)
    with pytest.raises(ValueError, match=message):
        zd.parquet(tmp_path / "a.parquet", **kwargs)
    with pytest.raises(ValueError, match=message):
        zd.text_files(path, **kwargs)
    with pytest.raises(ValueError, match=message):
        zd.items(["x"], **kwargs)


def test_default_names_and_options_are_kept(tmp_path, cache):
    path = write_lines(tmp_path / "a.jsonl", docs(1))
    ds = zd.jsonl(path, cache_dir=cache, component_id=3, passes=None, on_error="skip")
    assert (ds.name, ds.component_id, ds.passes, ds.on_error) == ("jsonl", 3, None, "skip")
    assert zd.text_files(path).name == "text_files"
    assert zd.jsonl(path, cache_dir=cache, name="web").describe()["name"] == "web"


def test_no_warnings_on_the_happy_path(tmp_path, cache):
    path = write_lines(tmp_path / "a.jsonl", docs(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zd.jsonl(path, cache_dir=cache).read(0, [0, 1, 2])


# ---------------------------------------------------------------- what a pass leaves cached


def test_read_once_cache_forgets_a_unit_once_its_rows_are_read():
    cache = caches.ReadOnceCache(2)
    cache.put("a", 0, "group 0", rows=5)
    cache.spend("a", 1, 5)  # another unit of the shard: not this one's rows
    assert cache.get("a", 0) == "group 0" and cache.get("a", 1) is None
    cache.spend("a", 0, 3)
    assert cache.get("a", 0) == "group 0"
    cache.spend("a", 0, 2)
    assert cache.get("a", 0) is None and len(cache) == 0
    for key in "bcd":
        cache.put(key, 0, key, rows=1)
    assert len(cache) == 2 and cache.get("b", 0) is None  # still an LRU
    assert len(pickle.loads(pickle.dumps(cache))) == 0


def test_a_parquet_pass_over_many_shards_leaves_no_row_group_cached(tmp_path):
    # A pass over more shards than the cache holds: each row group is decoded once,
    # kept while its rows are read in micro-batches, then dropped; memory after the
    # pass does not depend on how many shards there were.
    for k in range(7):
        write_parquet(tmp_path / f"p{k}.parquet", token_table(10), row_group_size=4)
    decodes: list[tuple[int, int]] = []

    class Counting(zd.ParquetDataset):
        def _read_row_group(self, shard_id: int, row_group: int) -> pa.Table:
            decodes.append((shard_id, row_group))
            return super()._read_row_group(shard_id, row_group)

    ds = Counting(str(tmp_path / "*.parquet"))
    most = 0
    for shard in range(7):
        ids = list(range(10))
        for i in range(0, 10, 3):
            if shard % 2:
                ds.read(shard, ids[i:i + 3])
            else:
                ds.read_columns(shard, ids[i:i + 3])
            most = max(most, len(ds._groups))
    assert sorted(decodes) == [(s, g) for s in range(7) for g in range(3)]
    assert most == 1 and len(ds._groups) == 0


def test_a_jsonl_pass_over_many_files_leaves_no_block_cached(tmp_path, cache):
    for k in range(6):
        write_lines(tmp_path / f"part-{k}.jsonl", docs(7, prefix=f"f{k}-"))
    ds = zd.jsonl(str(tmp_path / "part-*.jsonl"), cache_dir=cache)
    for shard in range(6):
        got = [json.loads(line)["text"] for i in range(0, 7, 2)
               for line in ds.read(shard, list(range(i, min(i + 2, 7))))]
        assert got == [f"f{shard}-{i}" for i in range(7)]
        assert len(ds._last_block) == 0


# ---------------------------------------------------------------- index cache write advice


_FILL_FDS = r"""
import os, resource, sys, warnings
import numpy as np
from zephon_torch.sources.index_cache import describe_index, save_index

index = np.zeros((1, 2), dtype=np.int64)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    name = save_index(sys.argv[1], "0" * 40, index, describe_index(index, "lf"))
for fd in held:
    os.close(fd)
assert name is None
print(caught[0].message)
"""


def test_a_cache_write_failing_for_lack_of_file_handles_advises_the_open_file_limit(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FILL_FDS, str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert done.returncode == 0, done.stderr
    message = done.stdout
    assert "Too many open files" in message
    assert "raise the open-file limit" in message and "ulimit -n" in message
    assert "writable folder" not in message
    assert (tmp_path / "cache").is_dir()  # the folder itself was fine


@pytest.mark.parametrize(("code", "advice", "not_advice"), [
    (errno.ENOSPC, "free some space", "writable folder"),
    (errno.EDQUOT, "free some space", "writable folder"),
    (errno.EROFS, "a writable folder", "open-file limit"),
    (errno.EACCES, "a writable folder", "open-file limit"),
    (errno.ENFILE, "raise the open-file limit", "writable folder"),
])
def test_the_cache_write_advice_follows_the_error(code, advice, not_advice):
    from zephon_torch.sources.index_cache import cache_write_advice

    text = cache_write_advice(OSError(code, os.strerror(code)))
    assert advice in text and not_advice not in text


def test_a_cache_folder_that_is_a_file_advises_a_writable_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    path = write_lines(tmp_path / "a.jsonl", docs(3))
    with pytest.warns(RuntimeWarning, match=r"cannot write the JSONL index cache .*Pass "
                                            r"cache_dir= or set ZEPHON_CACHE_DIR to a writable "
                                            r"folder"):
        zd.jsonl(path, cache_dir=blocker / "sub")
