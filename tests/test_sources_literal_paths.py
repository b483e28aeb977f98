"""A path that names an existing file is that file, even when it looks like a glob.

``shard[1].jsonl`` may be a real file name (so may ``a*b.txt`` or ``what?.txt``).
Read as a glob it would match ``shard1.jsonl`` instead, or nothing at all. An
existing path is therefore taken literally before any glob expansion, and a
folder with such characters in its name may start a glob.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zephon_torch.sources import datasets as zd
from zephon_torch.sources.paths import expand_paths


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "index-cache"))


def write_jsonl(path: Path, tag: str, n: int = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"{tag} {i}"}) + "\n" for i in range(n)))
    return path


def write_parquet(path: Path, tag: str, n: int = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": [f"{tag} {i}" for i in range(n)]}), path)
    return path


def write_text(path: Path, tag: str, n: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tag)
    return path


def first_text(ds: zd.Dataset) -> str:
    value = ds.read(0, [0])[0]
    if isinstance(value, dict):
        return value["text"]
    if isinstance(value, bytes) and value.startswith(b"{"):
        return json.loads(value)["text"]
    return value.decode()


FORMATS = {
    "jsonl": (write_jsonl, zd.jsonl, ".jsonl"),
    "parquet": (write_parquet, zd.parquet, ".parquet"),
    "text": (write_text, zd.text_files, ".txt"),
}


def quiet(make):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return make()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_existing_file_with_brackets_is_read_without_a_sibling(tmp_path, fmt):
    write, make, suffix = FORMATS[fmt]
    target = write(tmp_path / f"shard[1]{suffix}", "bracketed")
    ds = quiet(lambda: make(str(target)))
    assert [s.path for s in ds.shards()] == [str(target)]
    assert first_text(ds).startswith("bracketed")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_existing_file_with_brackets_wins_over_its_glob_sibling(tmp_path, fmt):
    write, make, suffix = FORMATS[fmt]
    target = write(tmp_path / f"shard[1]{suffix}", "bracketed")
    write(tmp_path / f"shard1{suffix}", "sibling")
    with pytest.warns(RuntimeWarning, match=r"names an existing file and is read as that file"
                                            r".*as a glob it would also match .*shard1"):
        ds = make(str(target))
    assert [s.path for s in ds.shards()] == [str(target)]
    assert first_text(ds).startswith("bracketed")


@pytest.mark.parametrize("name", ["a*b.txt", "what?.txt", "x[a-z].txt", "[!].txt"])
def test_stars_and_question_marks_in_real_names_are_names(tmp_path, name):
    target = write_text(tmp_path / name, "literal")
    assert quiet(lambda: expand_paths(str(target), what="t", suffixes=None)) == [str(target)]


def test_a_glob_inside_a_folder_whose_name_has_brackets(tmp_path):
    a = write_jsonl(tmp_path / "run[1]" / "a.jsonl", "a")
    b = write_jsonl(tmp_path / "run[1]" / "b.jsonl", "b")
    write_jsonl(tmp_path / "run1" / "c.jsonl", "c")  # what the folder name means as a glob
    files = quiet(lambda: expand_paths(str(tmp_path / "run[1]" / "*.jsonl"), what="jsonl",
                                       suffixes=None))
    assert files == [str(a), str(b)]
    recursive = quiet(lambda: expand_paths(str(tmp_path / "run[1]" / "**" / "*.jsonl"),
                                           what="jsonl", suffixes=None))
    assert recursive == [str(a), str(b)]
    with pytest.warns(RuntimeWarning, match=r"run\[1\]' names an existing folder and is read "
                                            r"as that folder; as a glob it would also match "
                                            r"'.*run1'"):
        named = expand_paths(str(tmp_path / "run[1]"), what="jsonl", suffixes=(".jsonl",))
    assert named == [str(a), str(b)]


def test_a_glob_still_expands_when_no_file_has_its_name(tmp_path):
    one = write_jsonl(tmp_path / "shard1.jsonl", "one")
    two = write_jsonl(tmp_path / "shard2.jsonl", "two")
    assert quiet(lambda: expand_paths(str(tmp_path / "shard[12].jsonl"), what="jsonl",
                                      suffixes=None)) == [str(one), str(two)]
    assert quiet(lambda: expand_paths(str(tmp_path / "*.jsonl"), what="jsonl",
                                      suffixes=None)) == [str(one), str(two)]


def test_a_file_literally_named_star_warns_that_the_glob_is_not_expanded(tmp_path):
    # ``touch data/*.jsonl`` in a shell with no match leaves such a file behind.
    star = write_jsonl(tmp_path / "*.jsonl", "star")
    write_jsonl(tmp_path / "a.jsonl", "a")
    with pytest.warns(RuntimeWarning, match=r"\*\.jsonl' names an existing file and is read"):
        files = expand_paths(str(star), what="jsonl", suffixes=None)
    assert files == [str(star)]


def test_a_url_naming_an_existing_object_with_brackets_is_that_object(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.pipe("/lit/shard[1].jsonl", b'{"text": "bracketed"}\n')
    fs.pipe("/lit/shard1.jsonl", b'{"text": "sibling"}\n')
    with pytest.warns(RuntimeWarning, match="names an existing file"):
        files = expand_paths("memory://lit/shard[1].jsonl", what="jsonl", suffixes=None)
    assert files == ["memory://lit/shard[1].jsonl"]
    fs.rm("/lit/shard1.jsonl")
    assert quiet(lambda: expand_paths("memory://lit/shard[1].jsonl", what="jsonl",
                                      suffixes=None)) == ["memory://lit/shard[1].jsonl"]
