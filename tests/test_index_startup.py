"""Start-up over many JSONL shards: counts from one listing of the index cache,
indexes loaded when a shard is first read, and processes starting together
indexing each file once (issue 23, item 3)."""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zephon_torch.sources.datasets as zd
from zephon_torch import Pipeline
from zephon_torch.sources import index_cache
from zephon_torch.sources.formats import jsonl as jsonl_format
from zephon_torch.sources.handles import DataChangedError


def write_shards(folder: Path, count: int, lines: int = 5) -> list[bytes]:
    """``count`` shards of ``lines`` documents (with a blank line, some with CR endings
    and one gzip shard); the lines of all shards in order."""
    folder.mkdir(parents=True, exist_ok=True)
    every = []
    for shard in range(count):
        docs = [json.dumps({"id": shard * 100 + i, "text": "w" * (shard + i + 1)}).encode()
                for i in range(lines)]
        every.extend(docs)
        end = b"\r" if shard % 4 == 3 else b"\n"
        body = docs[0] + end + end + end.join(docs[1:]) + end
        if shard == 1:
            (folder / f"s{shard:03d}.jsonl.gz").write_bytes(gzip.compress(body))
        else:
            (folder / f"s{shard:03d}.jsonl").write_bytes(body)
    return every


def fingerprint_of(folder: Path, cache: Path) -> str:
    pipe = Pipeline.from_jsonl(str(folder), cache_dir=str(cache), num_lanes=2)
    text = json.dumps(pipe.fingerprint(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


class Loads:
    """Counts :func:`load_index` calls made by the JSONL dataset."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        real = jsonl_format.load_index

        def counted(cache_dir: str, name: str):  # type: ignore[no-untyped-def]
            self.calls.append(name)
            return real(cache_dir, name)

        monkeypatch.setattr(jsonl_format, "load_index", counted)


def test_cache_entries_carry_the_line_count_and_the_folder_keeps_only_entries(tmp_path):
    write_shards(tmp_path / "data", 6, lines=7)
    cache = tmp_path / "cache"
    zd.jsonl(str(tmp_path / "data"), cache_dir=cache)
    names = entries(cache)
    assert len(names) == 6  # no lock file left behind
    assert all(name.endswith(".7.npy") for name in names)


def test_a_warm_start_loads_no_index_until_its_shard_is_read(tmp_path, monkeypatch):
    lines = write_shards(tmp_path / "data", 8)
    cache = tmp_path / "cache"
    cold = zd.jsonl(str(tmp_path / "data"), cache_dir=cache)
    loads = Loads(monkeypatch)
    warm = zd.jsonl(str(tmp_path / "data"), cache_dir=cache)
    assert loads.calls == []
    assert warm.shards() == cold.shards()
    assert warm.content_signatures() == cold.content_signatures()
    assert [len(warm.blocks(s)) for s in range(8)] == [1] * 8
    assert loads.calls == []
    assert warm.read(5, [4, 0]) == [lines[5 * 5 + 4], lines[5 * 5]]
    assert len(loads.calls) == 1
    assert warm.locate(5, 1) == f"{tmp_path / 'data' / 's005.jsonl'} line 3"
    assert len(loads.calls) == 1  # kept once loaded


def test_the_fingerprint_is_the_same_cold_warm_and_from_entries_named_without_counts(
        tmp_path, monkeypatch):
    lines = write_shards(tmp_path / "data", 9)
    cache = tmp_path / "cache"
    cold = fingerprint_of(tmp_path / "data", cache)
    assert fingerprint_of(tmp_path / "data", cache) == cold
    # Entries as written before the count was in the name: still read (each loaded
    # once at start-up), then renamed to carry the count.
    for name in entries(cache):
        key, about, _count, npy = name.split(".")
        os.rename(cache / name, cache / f"{key}.{about}.{npy}")
    loads = Loads(monkeypatch)
    assert fingerprint_of(tmp_path / "data", cache) == cold
    assert len(loads.calls) == 9  # every entry, the gzip shard's too
    assert all(name.count(".") == 3 for name in entries(cache))
    loads.calls.clear()
    assert fingerprint_of(tmp_path / "data", cache) == cold
    assert loads.calls == []
    pipe = (Pipeline.from_jsonl(str(tmp_path / "data"), cache_dir=str(cache), num_lanes=1,
                                shuffle=False).fetch().decode_text())
    with pipe.iter(runner="inline") as it:
        got = [r.payload["id"] for r in it]
    assert got == [json.loads(line)["id"] for line in lines]


def test_a_state_saved_on_a_cold_cache_resumes_on_a_warm_one(tmp_path):
    write_shards(tmp_path / "data", 6)
    cache = tmp_path / "cache"

    def pipe() -> Pipeline:
        return (Pipeline.from_jsonl(str(tmp_path / "data"), cache_dir=str(cache), num_lanes=2,
                                    seed=3).fetch().decode_text())

    with pipe().iter(runner="inline") as it:
        whole = [r.payload for r in it]
    for name in entries(cache):
        os.unlink(cache / name)
    with pipe().iter(runner="inline") as it:  # indexes every file again
        head = [next(it).payload for _ in range(7)]
        state = it.state_dict()
    with pipe().iter(runner="inline") as it:  # counts from the listing only
        it.load_state_dict(state)
        tail = [r.payload for r in it]
    assert head + tail == whole


def test_an_entry_whose_name_miscounts_fails_at_first_read_and_is_removed(tmp_path):
    write_shards(tmp_path / "data", 3, lines=6)
    cache = tmp_path / "cache"
    zd.jsonl(str(tmp_path / "data" / "s002.jsonl"), cache_dir=cache)
    (entry,) = entries(cache)
    lied = entry.replace(".6.npy", ".9.npy")
    os.rename(cache / entry, cache / lied)
    trusting = zd.jsonl(str(tmp_path / "data" / "s002.jsonl"), cache_dir=cache)
    assert trusting.shards()[0].num_samples == 9  # the name is trusted until the read
    with pytest.raises(DataChangedError, match=r"s002.jsonl.*changed since it was indexed "
                                               r"\(9 lines then, 6 now\)"):
        trusting.read(0, [0])
    assert entries(cache) == []
    again = zd.jsonl(str(tmp_path / "data" / "s002.jsonl"), cache_dir=cache)
    assert again.shards()[0].num_samples == 6
    assert entries(cache) == [entry]


def test_the_indexing_lock_excludes_a_second_holder_and_is_removed(tmp_path):
    import fcntl

    cache = tmp_path / "cache"
    with index_cache.indexing_lock(str(cache), ["a" * 40], "test") as held:
        assert held
        (lock,) = [p for p in cache.iterdir() if p.name.startswith(".lock-")]
        fd = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert list(cache.iterdir()) == []


def test_a_cache_folder_that_cannot_hold_a_lock_indexes_without_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with index_cache.indexing_lock(str(blocker), ["a" * 40], "test") as held:
        assert held is False


_RANK = r"""
import hashlib, json, os, sys, time
from zephon_torch.sources.formats import jsonl as J

data, cache, log, go = sys.argv[1:5]
real = J.JsonlDataset._scan

def counted(self, file):
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (os.path.basename(file.path) + "\n").encode())
    os.close(fd)
    time.sleep(0.01)  # a scan that takes a while, so unlocked processes would overlap
    return real(self, file)

J.JsonlDataset._scan = counted
import zephon_torch as zt
while not os.path.exists(go):
    time.sleep(0.002)
pipe = zt.Pipeline.from_jsonl(data, cache_dir=cache, num_lanes=2)
print(hashlib.sha256(json.dumps(pipe.fingerprint(), sort_keys=True, default=str)
                     .encode()).hexdigest())
"""


def test_processes_starting_together_on_a_cold_cache_index_each_file_once(tmp_path):
    write_shards(tmp_path / "data", 30)
    cache, log, go = tmp_path / "cache", tmp_path / "scans.log", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(tmp_path / "data"), str(cache),
                               str(log), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    time.sleep(1.0)  # let them import and wait for the start
    go.write_text("")
    outs = [rank.communicate(timeout=120) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err for _, err in outs]
    fingerprints = {out.strip() for out, _ in outs}
    assert len(fingerprints) == 1
    scans = collections.Counter(log.read_text().split())
    assert len(scans) == 30 and set(scans.values()) == {1}, scans
    assert fingerprint_of(tmp_path / "data", cache) in fingerprints
    assert len(entries(cache)) == 30


@pytest.mark.parametrize("paths", [
    ["/data/a/x.jsonl", "/data/b/y.jsonl"],
    ["/data/x.jsonl", "/data/sub/deeper/y.jsonl", "/data/sub/z.jsonl"],
    ["/x.jsonl", "/data/y.jsonl"],
    ["/x.jsonl"],
    ["rel/a.jsonl", "rel/../other/b.jsonl", "./c.jsonl"],
    ["s3://bucket/a/x.jsonl", "s3://bucket/a//b/y.jsonl"],
    ["/data/a.jsonl", "s3://bucket/b.jsonl"],
])
def test_shard_names_are_the_paths_relative_to_their_common_folder(paths):
    from zephon_torch.sources.formats.common import shard_names

    def reference(paths):  # the definition, one relpath a path
        import posixpath

        from zephon_torch.sources.paths import is_url
        normed = [p.split("://", 1)[1] if is_url(p) else os.path.abspath(p) for p in paths]
        try:
            root = posixpath.commonpath([posixpath.dirname(p) for p in normed])
        except ValueError:
            return [posixpath.basename(p) for p in normed]
        if not root:
            return [p.lstrip("/") for p in normed]
        return [posixpath.relpath(p, root) for p in normed]

    assert shard_names(paths) == reference(paths)
