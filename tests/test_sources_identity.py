"""Which files a source reads, and noticing when they are not what they were.

One file reached by two paths is read once; a glob match that cannot be read
is an error or a counted skip; files rewritten in place are caught, by a
resume (the fingerprint's content table) and by a pipeline reading them (the
line index is checked against the bytes); old Mac (CR-only) line endings are
lines.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from corpus import assert_scanned_as
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.checkpoint import accept_changed_data, merge_states, state_checksum
from zephon_torch.pipeline import Pipeline
from zephon_torch.sources import datasets as zd
from zephon_torch.sources.handles import DataChangedError
from zephon_torch.sources.lines import LineScanner, iter_lines, read_lines_at
from zephon_torch.sources.streams import TruncatedStreamError


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "index-cache"
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(cache))
    return cache


def doc_lines(n: int, start: int = 0, tag: str = "doc") -> list[bytes]:
    # Lengths vary, so reordering lines moves where they start.
    return [json.dumps({"id": i, "text": f"{tag} {i} " + "word " * (i % 7)}).encode()
            for i in range(start, start + n)]


def write(path: Path, lines: list[bytes], end: bytes = b"\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(line + end for line in lines))
    return path


def write_parquet(path: Path, n: int, start: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(start, start + n)),
                             "text": [f"row {i}" for i in range(start, start + n)]}), path)
    return path


def ids_delivered(pipe: Pipeline) -> list[int]:
    """Every document id the pipeline delivers (``verify=True``: the accounting holds)."""
    with pipe.iter(runner="inline", verify=True) as it:
        return [int(r.payload["id"]) for r in it]


def caught_warnings(make: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = make()
    return value, [str(w.message) for w in caught if w.category is RuntimeWarning]


# ---------------------------------------------------------------- one file, two paths


def test_a_glob_through_a_symlinked_folder_reads_each_file_once(tmp_path):
    write(tmp_path / "data" / "real" / "a.jsonl", doc_lines(10))
    os.symlink("real", tmp_path / "data" / "link")
    pipe, warned = caught_warnings(lambda: Pipeline.from_jsonl(
        str(tmp_path / "data" / "**" / "*.jsonl"), num_lanes=1).fetch().decode_text())
    assert sorted(ids_delivered(pipe)) == list(range(10))
    assert len(warned) == 1 and "'" + str(tmp_path / "data" / "link") + "'" in warned[0]
    assert str(tmp_path / "data" / "real") in warned[0] and "read once" in warned[0]


@pytest.mark.parametrize("how", ["dot-slash", "symlink", "hardlink"])
def test_one_file_named_by_two_paths_is_one_shard_with_a_warning(tmp_path, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.jsonl", doc_lines(10))
    write(tmp_path / "b.jsonl", doc_lines(5, 10))
    if how == "dot-slash":
        paths, twin = ["a.jsonl", "./a.jsonl", "b.jsonl"], "a.jsonl"
    elif how == "symlink":
        os.symlink("a.jsonl", tmp_path / "same.jsonl")
        paths, twin = ["*.jsonl"], "same.jsonl"
    else:
        os.link(tmp_path / "a.jsonl", tmp_path / "same.jsonl")
        paths, twin = ["*.jsonl"], "same.jsonl"
    pipe, warned = caught_warnings(
        lambda: Pipeline.from_jsonl(paths, num_lanes=2).fetch().decode_text())
    assert sorted(ids_delivered(pipe)) == list(range(15))
    assert len(warned) == 1
    assert f"{twin!r} is the same file as" in warned[0] and "read once" in warned[0]


def test_parquet_and_text_files_read_a_twice_named_file_once(tmp_path):
    write_parquet(tmp_path / "p" / "a.parquet", 6)
    os.symlink("a.parquet", tmp_path / "p" / "b.parquet")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("one document")
    os.link(tmp_path / "t" / "a.txt", tmp_path / "t" / "b.txt")
    parquet, warned_p = caught_warnings(lambda: zd.parquet(str(tmp_path / "p" / "*.parquet")))
    text, warned_t = caught_warnings(lambda: zd.text_files(str(tmp_path / "t")))
    assert len(parquet) == 6 and len(text) == 1
    assert "b.parquet" in warned_p[0] and "b.txt" in warned_t[0]


def test_a_url_given_twice_in_two_spellings_is_read_once(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/zt-ident/a.jsonl", b"\n".join(doc_lines(4)) + b"\n")
    try:
        ds, warned = caught_warnings(lambda: zd.jsonl(
            ["memory://zt-ident/a.jsonl", "memory://zt-ident/*.jsonl"],
            cache_dir=tmp_path / "c"))
        assert len(ds) == 4 and len(ds.shards()) == 1
        assert len(warned) == 1 and "is the same file as" in warned[0]
    finally:
        fs.rm("/zt-ident", recursive=True)


@pytest.mark.timeout(120)
def test_a_recursive_glob_through_a_symlink_loop_ends_and_reads_each_file_once(tmp_path):
    # glob.glob follows "up -> .." under ** without end (d/real/up/real/up/...).
    write(tmp_path / "d" / "real" / "a.jsonl", doc_lines(3))
    write(tmp_path / "d" / "b.jsonl", doc_lines(2, 3))
    os.symlink("..", tmp_path / "d" / "real" / "up")
    os.symlink("real", tmp_path / "d" / "link")
    ds, warned = caught_warnings(lambda: zd.jsonl(str(tmp_path / "d" / "**" / "*.jsonl")))
    assert sorted(int(json.loads(line)["id"]) for s in ds.shards()
                  for line in ds.read(s.shard_id, range(s.num_samples))) == [0, 1, 2, 3, 4]
    assert len(warned) == 1
    # Sorted walk: d/link is entered first, so the loop is met as d/link/up.
    assert f"'{tmp_path / 'd' / 'link' / 'up'}' leads back to '{tmp_path / 'd'}' (a symlink " \
           "loop)" in warned[0]
    assert f"folder '{tmp_path / 'd' / 'real'}' is the same as" in warned[0]


def test_a_recursive_glob_matches_what_glob_glob_matches_in_a_tree_without_links(
        tmp_path, monkeypatch):
    # ``**`` is walked by our own code (see the loop test); it must match the same files.
    import glob

    for rel in ["a.jsonl", "x/b.jsonl", "x/y/c.jsonl", "x/.hidden/d.jsonl", ".e.jsonl",
                "x/y/z/f.jsonl", "w/g.jsonl", "x/y/h.txt", "x/y/z/[k].txt"]:
        write(tmp_path / rel, doc_lines(1))
    monkeypatch.chdir(tmp_path)
    for root in (str(tmp_path) + os.sep, ""):
        for pattern in ["**/*.jsonl", "x/**/*.jsonl", "**/y/*.jsonl", "x/**", "*/**/c.jsonl",
                        "**/.hidden/*.jsonl", "x/y/**/*", "**/*.txt", "x/**/y/**/*.*"]:
            full = root + pattern
            expected = sorted(p for p in glob.glob(full, recursive=True) if os.path.isfile(p))
            got = [s.path for s in zd.text_files(full).shards()]
            assert got == expected, full


def test_files_without_duplicates_keep_their_shards_and_no_warning(tmp_path):
    for name in ["b.jsonl", "a.jsonl", "sub/c.jsonl"]:
        write(tmp_path / name, doc_lines(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = zd.jsonl([str(tmp_path / "*.jsonl"), str(tmp_path / "**" / "c.jsonl")])
    assert [s.name for s in ds.shards()] == ["a.jsonl", "b.jsonl", "sub/c.jsonl"]


# ---------------------------------------------------------------- unreadable matches


@pytest.mark.parametrize("factory", [zd.jsonl, zd.parquet, zd.text_files])
@pytest.mark.parametrize("where", ["glob", "folder"])
def test_a_dangling_symlink_among_the_matches_is_an_error_naming_it(tmp_path, factory, where):
    suffix = ".parquet" if factory is zd.parquet else ".jsonl"
    if factory is zd.parquet:
        write_parquet(tmp_path / "d" / f"a{suffix}", 3)
    else:
        write(tmp_path / "d" / f"a{suffix}", doc_lines(3))
    os.symlink("/mnt/unmounted-volume/b" + suffix, tmp_path / "d" / f"b{suffix}")
    target = str(tmp_path / "d" / ("*" + suffix if where == "glob" else ""))
    with pytest.raises(FileNotFoundError, match=(
            rf"1 path\(s\) matched by a glob or found in a folder cannot be read: "
            rf".*b{suffix}' is a symlink to '/mnt/unmounted-volume/b{suffix}', which does not "
            r"exist .*on_error='skip'")):
        factory(target.rstrip(os.sep))


@pytest.mark.parametrize("factory", [zd.jsonl, zd.parquet, zd.text_files])
def test_a_dangling_symlink_skipped_is_counted_and_warned(tmp_path, factory):
    suffix = ".parquet" if factory is zd.parquet else ".jsonl"
    if factory is zd.parquet:
        write_parquet(tmp_path / f"a{suffix}", 3)
    else:
        write(tmp_path / f"a{suffix}", doc_lines(3))
    for name in ("b", "c"):
        os.symlink(f"/mnt/unmounted-volume/{name}{suffix}", tmp_path / f"{name}{suffix}")
    ds, warned = caught_warnings(lambda: factory(str(tmp_path / f"*{suffix}"), on_error="skip"))
    assert [s.name for s in ds.shards()] == [f"a{suffix}"]
    assert len(warned) == 1 and "leaves out 2 path(s) that cannot be read" in warned[0]
    assert f"b{suffix}" in warned[0] and f"c{suffix}" in warned[0]
    assert [p for p, _ in ds.skipped_paths] == [str(tmp_path / f"b{suffix}"),
                                                  str(tmp_path / f"c{suffix}")]


def test_a_symlink_loop_says_it_is_a_loop(tmp_path):
    write(tmp_path / "a.jsonl", doc_lines(2))
    os.symlink("loop.jsonl", tmp_path / "loop.jsonl")
    with pytest.raises(FileNotFoundError, match=r"loop\.jsonl' is a symlink loop"):
        zd.jsonl(str(tmp_path / "*.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"loop\.jsonl' is a symlink loop"):
        zd.jsonl(str(tmp_path / "loop.jsonl"))  # named explicitly
    with pytest.raises(FileNotFoundError, match=r"matches no readable file: .*symlink loop"):
        zd.jsonl(str(tmp_path / "loop*.jsonl"), on_error="skip")  # nothing left to read


def test_an_explicit_dangling_symlink_names_its_missing_target(tmp_path):
    os.symlink("/mnt/gone/a.jsonl", tmp_path / "a.jsonl")
    with pytest.raises(FileNotFoundError, match=r"a\.jsonl' is a symlink to '/mnt/gone/a\.jsonl'"
                                                r", which does not exist"):
        zd.jsonl(str(tmp_path / "a.jsonl"), on_error="skip")


# ---------------------------------------------------------------- data rewritten before a resume


def reorder(path: Path, how: str) -> None:
    lines = path.read_bytes().splitlines()
    if how == "reverse":
        lines.reverse()
    else:  # keep the first and last 4 KiB: swap two lines of different lengths in the middle
        middle = len(lines) // 2
        lines[middle], lines[middle + 3] = lines[middle + 3], lines[middle]
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def resumable(tmp_path: Path, tokenizer: Any, files: int = 3, lines: int = 12) -> Pipeline:
    for k in range(files):
        write(tmp_path / "data" / f"part-{k}.jsonl", doc_lines(lines, k * lines))
    return (Pipeline.from_jsonl(str(tmp_path / "data" / "*.jsonl"), num_lanes=2, chunk_size=4)
            .fetch().decode_text().tokenize(tokenizer).shuffle(6, seed=1).batch(2))


def saved(pipe: Pipeline, batches: int) -> dict[str, Any]:
    with pipe.iter(runner="inline") as it:
        for _ in range(batches):
            next(it)
        return json.loads(json.dumps(it.state_dict()))


def delivered_ids(it: Any) -> list[int]:
    return [int(r.payload["id"]) for batch in it for r in batch.records]


def test_files_reordered_in_place_refuse_the_resume_naming_the_file(tmp_path, tokenizer):
    pipe = resumable(tmp_path, tokenizer)
    state = saved(pipe, 4)
    for path in sorted((tmp_path / "data").glob("*.jsonl")):
        size = path.stat().st_size
        reorder(path, "reverse")
        assert path.stat().st_size == size  # same size, same line count
    fresh = (Pipeline.from_jsonl(str(tmp_path / "data" / "*.jsonl"), num_lanes=2, chunk_size=4)
             .fetch().decode_text().tokenize(tokenizer).shuffle(6, seed=1).batch(2))
    with pytest.raises(ValueError) as info:
        fresh.iter(runner="inline").load_state_dict(state)
    message = str(info.value)
    assert message.startswith("the data changed since the state was saved: dataset 'jsonl' "
                              "(datasets[0]) shard 0 'part-0.jsonl': same size ("), message
    assert "'part-1.jsonl'" in message and "'part-2.jsonl'" in message
    assert "zephon_torch.checkpoint.accept_changed_data(state)" in message
    # The explicit opt-out resumes on the changed data, with the documented consequence.
    with fresh.iter(runner="inline") as it:
        it.load_state_dict(accept_changed_data(state))
        rest = delivered_ids(it)
    assert rest and set(rest) <= set(range(36))


def test_lines_swapped_in_the_middle_of_a_big_file_are_caught_by_the_line_index(tmp_path):
    path = write(tmp_path / "big.jsonl", doc_lines(400))
    assert path.stat().st_size > 16384  # the middle is outside the first and last 4 KiB
    pipe = Pipeline.from_jsonl(str(path), num_lanes=1, chunk_size=8).fetch().decode_text()
    state = saved(pipe, 5)
    head, tail = path.read_bytes()[:4096], path.read_bytes()[-4096:]
    reorder(path, "middle")
    assert path.read_bytes()[:4096] == head and path.read_bytes()[-4096:] == tail
    fresh = Pipeline.from_jsonl(str(path), num_lanes=1, chunk_size=8).fetch().decode_text()
    with pytest.raises(ValueError, match=r"the data changed .* shard 0 'big\.jsonl': same size"):
        fresh.iter(runner="inline").load_state_dict(state)


def test_a_file_that_grew_is_named_with_both_sizes(tmp_path):
    path = write(tmp_path / "a.jsonl", doc_lines(6))
    pipe = Pipeline.from_jsonl(str(path), num_lanes=1, chunk_size=2).fetch().decode_text()
    state = saved(pipe, 1)
    before = path.stat().st_size
    path.write_bytes(path.read_bytes().replace(b"doc 3", b"doc 3 (edited)"))
    with pytest.raises(ValueError, match=rf"shard 0 'a\.jsonl': {before} bytes then, "
                                         rf"{before + 9} now"):
        Pipeline.from_jsonl(str(path), num_lanes=1, chunk_size=2).fetch().decode_text().iter(
            runner="inline").load_state_dict(state)


def test_parquet_and_text_files_rewritten_in_place_refuse_the_resume(tmp_path):
    write_parquet(tmp_path / "a.parquet", 8)
    (tmp_path / "t").mkdir()
    for i in range(4):
        (tmp_path / "t" / f"{i}.txt").write_text(f"document number {i}")
    pipes = {
        "parquet": lambda: Pipeline.from_parquet(str(tmp_path / "a.parquet"), num_lanes=1,
                                                 chunk_size=2).fetch(),
        "text": lambda: Pipeline.from_text_files(str(tmp_path / "t"), num_lanes=1,
                                                 chunk_size=1).fetch().decode_text(),
    }
    states = {name: saved(make(), 1) for name, make in pipes.items()}
    pq.write_table(pa.table({"id": list(range(7, -1, -1)),
                             "text": [f"row {i}" for i in range(7, -1, -1)]}),
                   tmp_path / "a.parquet")
    (tmp_path / "t" / "2.txt").write_text("document NUMBER 2")
    with pytest.raises(ValueError, match=r"data changed .*shard 0 'a\.parquet'"):
        pipes["parquet"]().iter(runner="inline").load_state_dict(states["parquet"])
    with pytest.raises(ValueError, match=r"data changed .*shard 2 '2\.txt': same size"):
        pipes["text"]().iter(runner="inline").load_state_dict(states["text"])


def test_a_new_or_longer_file_is_named_in_the_configuration_error(tmp_path):
    write(tmp_path / "a.jsonl", doc_lines(6))
    write(tmp_path / "b.jsonl", doc_lines(6, 6))
    def make():
        return (Pipeline.from_jsonl(str(tmp_path / "*.jsonl"), num_lanes=1, chunk_size=2)
                .fetch().decode_text())

    state = saved(make(), 1)
    write(tmp_path / "b.jsonl", doc_lines(8, 6))
    write(tmp_path / "c.jsonl", doc_lines(1, 20))
    with pytest.raises(ValueError) as info:
        make().iter(runner="inline").load_state_dict(state)
    message = str(info.value)
    assert "different pipeline configuration: datasets differ(s) (dataset 'jsonl' " \
           "(datasets[0]): 2 shard(s) in the state, 3 now; new: 'c.jsonl'; 'b.jsonl' has 8 " \
           "samples, 6 in the state)" in message, message


def test_an_unchanged_copy_elsewhere_resumes_exactly(tmp_path):
    # Location-free: the data copied (new paths, new mtimes) is the same data.
    write(tmp_path / "one" / "a.jsonl", doc_lines(20))
    def make(where):
        return (Pipeline.from_jsonl(str(tmp_path / where / "*.jsonl"), num_lanes=2,
                                    chunk_size=3).fetch().decode_text().batch(2))

    whole = [[int(r.payload["id"]) for r in b.records] for b in make("one").iter(runner="inline")]
    state = saved(make("one"), 3)
    write(tmp_path / "two" / "a.jsonl", (tmp_path / "one" / "a.jsonl").read_bytes().splitlines())
    with make("two").iter(runner="inline") as it:
        it.load_state_dict(state)
        rest = [[int(r.payload["id"]) for r in b.records] for b in it]
    assert rest == whole[3:]


def test_a_state_saved_before_content_tables_still_loads(tmp_path):
    write(tmp_path / "a.jsonl", doc_lines(10))
    def make():
        return (Pipeline.from_jsonl(str(tmp_path / "a.jsonl"), num_lanes=1, chunk_size=2)
                .fetch().decode_text())

    whole = [int(r.payload["id"]) for r in make().iter(runner="inline")]
    state = saved(make(), 2)
    old = {k: v for k, v in state.items() if k != "checksum"}
    old["fingerprint"] = {k: v for k, v in state["fingerprint"].items() if k != "data"}
    old["checksum"] = state_checksum(old)
    with make().iter(runner="inline") as it:
        it.load_state_dict(old)
        assert [int(r.payload["id"]) for r in it] == whole[2:]


def test_accept_changed_data_marks_every_state_inside_a_checkpoint(tmp_path):
    write(tmp_path / "a.jsonl", doc_lines(12))
    def make():
        return (Pipeline.from_jsonl(str(tmp_path / "a.jsonl"), num_lanes=2, chunk_size=2)
                .fetch().decode_text())

    pipe = make()
    ranks = []
    for rank in range(2):
        with pipe.iter(runner="inline", rank=rank, world_size=2) as it:
            next(it)
            ranks.append(it.state_dict())
    weights = np.zeros(3)
    checkpoint = {"model": {"w": weights}, "loader": {"workers": [ranks[0], ranks[1]]},
                  "step": 7}
    reorder(tmp_path / "a.jsonl", "reverse")
    marked = accept_changed_data(checkpoint)
    assert marked["model"] is checkpoint["model"] and marked["step"] == 7
    assert "accept_changed_data" not in ranks[0]  # the original is left alone
    merged = merge_states(marked["loader"]["workers"])
    with make().iter(runner="inline") as it:
        it.load_state_dict(merged)
        assert len(list(it)) == 10
    with pytest.raises(ValueError, match="data changed"):
        make().iter(runner="inline").load_state_dict(merge_states(ranks))
    with pytest.raises(ValueError, match="no pipeline state"):
        accept_changed_data({"model": {}})
    edited = {**ranks[0], "num_lanes": 3}
    with pytest.raises(ValueError, match="corrupted state"):
        accept_changed_data(edited)


def test_accept_changed_data_reaches_the_torch_dataset_wrapper(tmp_path):
    pytest.importorskip("torch")
    write(tmp_path / "a.jsonl", doc_lines(12))
    def make():
        return (Pipeline.from_jsonl(str(tmp_path / "a.jsonl"), num_lanes=1, chunk_size=2)
                .fetch().decode_text().to_torch_dataset(runner="inline"))

    dataset = make()
    it = iter(dataset)
    next(it)
    state = dataset.state_dict()
    reorder(tmp_path / "a.jsonl", "reverse")
    refused = make()
    refused.load_state_dict(state)
    with pytest.raises(ValueError, match="accept_changed_data"):
        list(refused)
    accepted = make()
    accepted.load_state_dict(accept_changed_data(state))
    assert len(list(accepted)) == 11


# ---------------------------------------------------------------- a stale line index


def rewrite_keeping_size_and_times(path: Path, new: bytes) -> None:
    st = path.stat()
    assert len(new) == st.st_size
    path.write_bytes(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_rewrite_keeping_size_and_mtime_is_indexed_again(tmp_path, _cache):
    lines = [b'{"id": 0, "text": "a"}', b'{"id": 1, "text": "bbbbbbbbbbbb"}',
             b'{"id": 2, "text": "cc"}', b'{"id": 3, "text": "ddddddd"}']
    path = write(tmp_path / "a.jsonl", lines)
    built_before = {on_error: Pipeline.from_jsonl(str(path), num_lanes=1, on_error=on_error,
                                                  shuffle=False).fetch().decode_text()
                    for on_error in ("raise", "skip")}
    swapped = [lines[1], lines[0], lines[3], lines[2]]  # other line lengths, same bytes
    rewrite_keeping_size_and_times(path, b"".join(line + b"\n" for line in swapped))
    after = zd.jsonl(str(path))  # built after the rewrite: a new index
    assert after.read(0, [0, 1, 2, 3]) == swapped
    # A pipeline built before the rewrite fails loudly, even when skipping bad samples.
    for pipe in built_before.values():
        with pytest.raises(DataChangedError, match=rf"{re.escape(repr(str(path)))} changed "
                                                   "since it was indexed"):
            list(pipe.iter(runner="inline"))


def test_a_middle_rewrite_with_the_same_edges_is_caught_when_read_and_indexed_again(tmp_path,
                                                                                       _cache):
    lines = doc_lines(400)
    path = write(tmp_path / "big.jsonl", lines)
    assert len(zd.jsonl(str(path)).read(0, [200])) == 1
    swapped = list(lines)
    swapped[200], swapped[203] = swapped[203], swapped[200]
    assert len(swapped[200]) != len(swapped[203])
    rewrite_keeping_size_and_times(path, b"".join(line + b"\n" for line in swapped))
    stale = zd.jsonl(str(path), on_error="skip")  # same path, size, mtime, edges: stale entry
    pipe = Pipeline.from_sources([stale], num_lanes=1, shuffle=False).fetch().decode_text()
    with pytest.raises(DataChangedError, match=r"big\.jsonl' no longer (has a line starting at "
                                               r"byte|holds one line between bytes) .*its "
                                               r"cached index is removed"):
        list(pipe.iter(runner="inline"))
    fresh = zd.jsonl(str(path))
    assert fresh.read(0, range(400)) == swapped


def split_line_keeping_size(line: bytes, new_id: int, end: bytes) -> bytes:
    """``line`` cut into two documents (the second has id ``new_id``), same byte count."""
    head = json.dumps({"id": json.loads(line)["id"], "text": "a"}).encode() + end
    shell = json.dumps({"id": new_id, "text": ""}).encode()
    pad = len(line) - len(head) - len(shell)
    assert pad >= 0
    return head + json.dumps({"id": new_id, "text": "x" * pad}).encode()


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_a_same_size_rewrite_splitting_one_line_in_two_is_not_a_lost_line(tmp_path, end):
    lines = doc_lines(400)
    path = write(tmp_path / "big.jsonl", lines, end)
    assert zd.jsonl(str(path)).shards()[0].num_samples == 400  # indexed and cached
    changed = list(lines)
    changed[200] = split_line_keeping_size(lines[200], 400, end)
    rewrite_keeping_size_and_times(path, b"".join(line + end for line in changed))
    assert path.read_bytes()[:2048] == b"".join(line + end for line in lines)[:2048]
    stale = zd.jsonl(str(path))  # same path, size, mtime and edges: the cached index
    pipe = Pipeline.from_sources([stale], num_lanes=1, shuffle=False).fetch().decode_text()
    with pytest.raises(DataChangedError, match=r"big\.jsonl' no longer holds one line between "
                                               r"bytes .*its cached index is removed"):
        ids_delivered(pipe)
    fresh = Pipeline.from_jsonl(str(path), num_lanes=1, shuffle=False).fetch().decode_text()
    assert ids_delivered(fresh) == [*range(201), 400, *range(201, 400)]


@pytest.mark.parametrize("change", ["blank_to_content", "content_to_blank", "blank_removed"])
def test_a_same_size_rewrite_of_blank_lines_is_caught_when_read(tmp_path, change):
    lines = doc_lines(400)  # the changes lie outside the first and last 4 KiB
    body = [line + b"\n" for line in lines]
    body[200] += b"  \n"  # a blank line after line 201
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(body))
    ds = zd.jsonl(str(path))
    assert ds.locate(0, 201) == f"{path} line 203"
    if change == "blank_to_content":  # a new document where a blank line was
        body[200] = lines[200] + b"\n{}\n"
    elif change == "content_to_blank":  # a document gone
        body[210] = b" " * len(lines[210]) + b"\n"
    else:  # the blank line folded into its neighbour: later lines are numbered one less
        body[200] = lines[200] + b"   \n"
    rewrite_keeping_size_and_times(path, b"".join(body))
    stale = zd.jsonl(str(path))
    with pytest.raises(DataChangedError, match="the file changed since it was indexed"):
        stale.read(0, range(400))
    fresh = zd.jsonl(str(path))
    expected = {"blank_to_content": 401, "content_to_blank": 399, "blank_removed": 400}[change]
    assert fresh.shards()[0].num_samples == expected


def cached_entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.npy"))


def delete_a_row(entry: Path, row: int) -> None:
    index = np.load(entry)
    np.save(entry, np.delete(index, row, axis=0))


def test_a_cached_index_missing_a_row_is_indexed_again(tmp_path, _cache):
    lines = doc_lines(400)
    path = write(tmp_path / "big.jsonl", lines)
    zd.jsonl(str(path))
    (entry,) = cached_entries(_cache)
    delete_a_row(entry, 100)
    again = zd.jsonl(str(path))
    assert again.shards()[0].num_samples == 400
    assert again.read(0, range(400)) == lines
    pipe = Pipeline.from_sources([again], num_lanes=1, shuffle=False).fetch().decode_text()
    assert ids_delivered(pipe) == list(range(400))


def test_a_cached_index_damaged_after_the_pipeline_was_built_is_indexed_again(tmp_path, _cache):
    lines = doc_lines(400)
    path = write(tmp_path / "big.jsonl", lines)
    shipped = pickle.loads(pickle.dumps(zd.jsonl(str(path))))  # as a worker gets it
    (entry,) = cached_entries(_cache)
    delete_a_row(entry, 100)
    assert shipped.read(0, range(400)) == lines
    assert shipped.locate(0, 399) == f"{path} line 400"


# ---------------------------------------------------------------- CR-only line endings


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_old_mac_line_endings_are_lines(tmp_path, suffix, on_error):
    body = b"".join(line + b"\r" for line in doc_lines(20)) + b"  \r\r"
    packed = {".jsonl": body, ".jsonl.gz": gzip.compress(body),
              ".jsonl.zst": zstandard.compress(body)}[suffix]
    path = tmp_path / f"mac{suffix}"
    path.write_bytes(packed)
    pipe = (Pipeline.from_jsonl(str(path), num_lanes=1, on_error=on_error, shuffle=False)
            .fetch().decode_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ids_delivered(pipe) == list(range(20))
    ds = zd.jsonl(str(path))
    assert ds.locate(0, 19) == f"{path} line 20"
    if suffix == ".jsonl":
        assert ds.read(0, [19, 0]) == [doc_lines(20)[19], doc_lines(20)[0]]


def test_a_bad_line_in_an_old_mac_file_is_one_tombstone(tmp_path):
    lines = [*doc_lines(5), b'{"id": 5, "text": broken}', *doc_lines(4, 6)]
    path = write(tmp_path / "mac.jsonl", lines, end=b"\r")
    pipe = (Pipeline.from_jsonl(str(path), num_lanes=1, on_error="skip", shuffle=False)
            .fetch().decode_text())
    with pipe.iter(runner="inline", verify=True) as it, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = [int(r.payload["id"]) for r in it]
        stats = it.stats()
    assert out == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert stats["lanes"][0]["tombstoned"] == {"decode_error": 1}


@settings(max_examples=150, deadline=None)
@given(
    lines=st.lists(st.sampled_from(["", " ", "\t", "a", "bc", " x ", "{}", "é", "\x00"]),
                   max_size=30),
    final_cr=st.booleans(),
    block=st.integers(1, 9),
    cut=st.integers(0, 40),
)
def test_cr_only_scanner_reader_and_stream_agree_with_a_naive_split(lines, final_cr, block, cut):
    data = "\r".join(lines).encode() + (b"\r" if final_cr and lines else b"")
    expected, offset = [], 0
    for number, line in enumerate(data.split(b"\r"), start=1):
        if line.strip():
            expected.append((offset, number, line))
        offset += len(line) + 1
    scanner = assert_scanned_as(data, block, expected)
    index = scanner.finish()
    if b"\r" in data:
        assert scanner.line_end == "cr"

    class Bytes:
        path = "memory"

        def read_at(self, offset: int, size: int) -> bytes:
            return data[offset:offset + size]

    if len(index):
        ids = np.arange(len(index))
        assert read_lines_at(Bytes(), index[:, 0], len(data), ids,
                             scanner.line_end) == [line for _, _, line in expected]

    # A stream cut short keeps the complete lines, counted and streamed alike.
    cut = min(cut, len(data))

    def failing() -> Any:
        yield from (data[:cut][i:i + block] for i in range(0, cut, block))
        raise TruncatedStreamError("cut")

    partial = LineScanner()
    partial.feed(data[:cut])
    complete = partial.finish(complete_only=True)
    got: list[bytes] = []
    with pytest.raises(TruncatedStreamError):
        for line in iter_lines(failing()):
            got.append(line)
    assert len(got) == len(complete)


def test_normal_line_endings_are_unchanged_by_cr_support(tmp_path):
    rng = random.Random(0)
    lines = [json.dumps({"text": "x" * rng.randrange(0, 50), "r": "\r"}).encode()
             for _ in range(300)]
    crlf = write(tmp_path / "crlf.jsonl", lines, end=b"\r\n")
    lf = write(tmp_path / "lf.jsonl", lines, end=b"\n")
    for path in (crlf, lf):
        ds = zd.jsonl(str(path))
        assert ds.read(0, range(300)) == lines and list(ds.stream(0)) == lines
