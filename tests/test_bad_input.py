"""Bad input, case by case: the error names file, line/row, sample and fix, or,
with ``on_error="skip"``, the sample becomes a counted tombstone, one warning
sums the skips up, and accounting stays exact (every sample read is delivered
or tombstoned). Skips depend only on the data: outputs are identical on every
runner, and a resume replays them identically.
"""

from __future__ import annotations

import gzip
import json
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from harness import assert_conserved, assert_deterministic, assert_restores_everywhere, matrix

from zephon_torch.checks import assert_conserved as shipped_assert_conserved
from zephon_torch.ops.tokenize import Tokenize
from zephon_torch.pipeline import Pipeline
from zephon_torch.sources import datasets as zd


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "index-cache"))


def good_lines(n: int, start: int = 0) -> list[bytes]:
    return [json.dumps({"id": i, "text": f"document {i} about rivers"}).encode()
            for i in range(start, start + n)]


def write(path: Path, lines: list[bytes], *, final_newline: bool = True) -> Path:
    path.write_bytes(b"\n".join(lines) + (b"\n" if final_newline else b""))
    return path


def run(pipe: Pipeline, **kwargs: Any) -> tuple[list[Any], dict[str, Any], list[str]]:
    """Outputs, stats and the warnings raised, with verify=True."""
    kwargs.setdefault("runner", "inline")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = pipe.iter(verify=True, **kwargs)
        out = list(it)
        stats = shipped_assert_conserved(it)
    return out, stats, [str(w.message) for w in caught if w.category is RuntimeWarning]


# One bad line in the middle of a JSONL file: (line bytes, what the error says).
BAD_LINES = {
    "malformed_json": (b'{"text": "unterminated', r"malformed JSON"),
    "invalid_utf8": (b'{"text": "caf\xe9 \xff"}', r"invalid UTF-8"),
    "missing_field": (b'{"body": "no text here"}', r"no 'text' field \(keys: 'body'\)"),
    "non_string_text": (b'{"text": 12345}', r"field 'text' is a int, not a string"),
    # Valid JSON that no tokenizer can encode: half of an emoji, as web scrapes leave it.
    "lone_surrogate": (b'{"text": "emoji \\ud83d cut"}',
                       r"lone UTF-16 surrogate \\ud83d \(character 6\) in field 'text' "
                       r"\(not valid Unicode"),
    # Valid JSON that Python refuses to load.
    "huge_integer": (b'{"text": "fine", "n": ' + b"7" * 5000 + b"}",
                     r"JSON that Python refuses to load \(ValueError: Exceeds the limit"),
    "deep_nesting": (b'{"text": "fine", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                     r"JSON nested too deeply for Python to load"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_raises_naming_file_line_sample_and_fix(tmp_path: Path, case: str) -> None:
    bad, problem = BAD_LINES[case]
    path = write(tmp_path / "part-0.jsonl", [*good_lines(6), bad, *good_lines(5, 6)])
    pipe = Pipeline.from_jsonl(str(path), num_lanes=1, chunk_size=4).fetch().decode_text()
    with pytest.raises(ValueError) as info:
        run(pipe)
    message = str(info.value)
    assert re.search(problem, message), message
    assert f"{path} line 7" in message  # the 1-based line in the file
    assert "sample (0, 0, 6)" in message
    assert "on_error='skip'" in message


@pytest.mark.parametrize("case", sorted(BAD_LINES))
@pytest.mark.parametrize("where", ["source", "operator"])
def test_bad_line_skipped_is_a_counted_tombstone_with_one_warning(tmp_path: Path, case: str,
                                                                   where: str) -> None:
    bad, problem = BAD_LINES[case]
    lines = [*good_lines(6), bad, *good_lines(5, 6), bad, *good_lines(3, 11)]
    path = write(tmp_path / "part-0.jsonl", lines)
    source_mode = "skip" if where == "source" else "raise"
    pipe = (Pipeline.from_jsonl(str(path), num_lanes=2, chunk_size=4, on_error=source_mode)
            .fetch().decode_text(on_error="skip" if where == "operator" else "raise"))
    out, stats, warned = run(pipe)
    assert sorted(r.payload["id"] for r in out) == list(range(14))
    assert stats["read"] == 16 and stats["delivered"] == 14
    assert sum(c["tombstoned"].get("decode_error", 0) for c in stats["lanes"].values()) == 2
    assert len(warned) == 1, warned  # one summary, not one warning per sample
    assert "2 bad sample(s)" in warned[0] and "decode_error: 2" in warned[0]
    assert f"{path} line 7" in warned[0] and f"{path} line 13" in warned[0]
    assert re.search(problem, warned[0]), warned[0]
    bad_samples = stats["bad_samples"]
    assert sorted(b["sample_id"] for b in bad_samples) == [(0, 0, 6), (0, 0, 12)]
    assert all(re.search(problem, b["detail"]) for b in bad_samples)


def test_truncated_last_line_raises_saying_the_file_looks_truncated(tmp_path: Path) -> None:
    path = write(tmp_path / "cut.jsonl", [*good_lines(5), b'{"id": 5, "text": "half a li'],
                 final_newline=False)
    pipe = Pipeline.from_jsonl(str(path), num_lanes=1).fetch().decode_text()
    with pytest.raises(ValueError, match=r"cut\.jsonl line 6, the file's last line, which has no "
                                         r"line ending: the file looks truncated"):
        run(pipe)


def test_truncated_last_line_skipped(tmp_path: Path) -> None:
    path = write(tmp_path / "cut.jsonl", [*good_lines(5), b'{"id": 5, "text": "half a li'],
                 final_newline=False)
    pipe = Pipeline.from_jsonl(str(path), num_lanes=1, on_error="skip",
                               shuffle=False).fetch().decode_text()
    out, stats, warned = run(pipe)
    assert [r.payload["id"] for r in out] == [0, 1, 2, 3, 4]
    assert stats["lanes"][0]["tombstoned"] == {"decode_error": 1}
    assert len(warned) == 1 and "cut.jsonl line 6" in warned[0]


def test_a_complete_last_line_without_newline_is_fine(tmp_path: Path) -> None:
    path = write(tmp_path / "ok.jsonl", good_lines(5), final_newline=False)
    out, stats, warned = run(Pipeline.from_jsonl(str(path), num_lanes=1,
                                                 shuffle=False).fetch().decode_text())
    assert stats["read"] == stats["delivered"] == 5
    assert [r.payload["id"] for r in out] == [0, 1, 2, 3, 4] and not warned


def test_text_file_with_invalid_utf8(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a fine document")
    (tmp_path / "b.txt").write_bytes(b"broken \xc3\x28 bytes")
    glob = str(tmp_path / "*.txt")
    with pytest.raises(ValueError, match=r"invalid UTF-8 .* at .*b\.txt \(sample \(0, 1, 0\)\)"):
        run(Pipeline.from_text_files(glob, num_lanes=1).fetch().decode_text())
    out, stats, warned = run(
        Pipeline.from_text_files(glob, num_lanes=1, on_error="skip").fetch().decode_text())
    assert [r.payload["text"] for r in out] == ["a fine document"]
    assert stats["tombstoned"] == 1 and "b.txt" in warned[0]


# ---------------------------------------------------------------- compressed files


def _compress(body: bytes, suffix: str) -> bytes:
    return gzip.compress(body) if suffix.endswith(".gz") else zstandard.compress(body)


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_truncated_compressed_file_raises_naming_it(tmp_path: Path, suffix: str) -> None:
    packed = _compress(b"\n".join(good_lines(3000)) + b"\n", suffix)
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(packed[: len(packed) * 2 // 3])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.* is truncated or corrupt.*"
                                         r"re-create the file, or pass on_error='skip'"):
        Pipeline.from_jsonl(str(path))


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_truncated_compressed_file_skipped_keeps_the_complete_lines(tmp_path: Path,
                                                                    suffix: str) -> None:
    lines = good_lines(20_000)
    packed = _compress(b"\n".join(lines) + b"\n", suffix)
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    write(tmp_path / "whole.jsonl", good_lines(10, 50_000))
    with pytest.warns(RuntimeWarning, match=r"cut\.jsonl\.(gz|zst).*keeps the \d+ complete"):
        pipe = (Pipeline.from_jsonl(str(tmp_path / "*"), on_error="skip", num_lanes=2,
                                    chunk_size=256).fetch().decode_text())
    kept = len(pipe.source.datasets[0]) - 10
    assert 0 < kept < 20_000
    out, stats, _ = run(pipe)
    ids = sorted(r.payload["id"] for r in out)
    assert ids == [*range(kept), *range(50_000, 50_010)]  # a prefix of the damaged file
    assert stats["read"] == stats["delivered"] == kept + 10


# ---------------------------------------------------------------- parquet


def _parquet(path: Path, rows: int = 200, group: int = 50) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(rows)),
                      "text": [f"row {i} " + "words " * 40 for i in range(rows)]})
    pq.write_table(table, path, row_group_size=group, compression="snappy")
    return path


def test_truncated_parquet_raises_naming_the_file(tmp_path: Path) -> None:
    data = _parquet(tmp_path / "x.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.parquet' as a Parquet file .*on_error='skip'"):
        Pipeline.from_parquet(str(tmp_path / "cut.parquet"))


def test_truncated_parquet_skipped_is_an_empty_shard_with_a_warning(tmp_path: Path) -> None:
    data = _parquet(tmp_path / "a.parquet").read_bytes()
    (tmp_path / "b.parquet").write_bytes(data[:1000])
    with pytest.warns(RuntimeWarning, match=r"b\.parquet.*shard of 0 samples"):
        pipe = Pipeline.from_parquet(str(tmp_path / "*.parquet"), on_error="skip",
                                     num_lanes=2, chunk_size=16).fetch().decode_text()
    out, stats, _ = run(pipe)
    assert sorted(r.payload["id"] for r in out) == list(range(200))
    assert stats["read"] == stats["delivered"] == 200


def _corrupt_parquet(tmp_path: Path) -> Path:
    """A Parquet file whose footer is fine but whose second row group's pages are garbage."""
    import pyarrow.parquet as pq

    path = _parquet(tmp_path / "good.parquet")
    meta = pq.ParquetFile(path).metadata.row_group(1)
    start = min(meta.column(i).data_page_offset for i in range(meta.num_columns))
    data = bytearray(path.read_bytes())
    for k in range(start, start + 400):
        data[k] ^= 0x5A
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(data))
    path.unlink()
    return bad


def test_corrupted_parquet_raises_naming_file_rows_and_fix(tmp_path: Path) -> None:
    bad = _corrupt_parquet(tmp_path)
    pipe = Pipeline.from_parquet(str(bad), num_lanes=1, chunk_size=50,
                                 shuffle=False).fetch().decode_text()
    with pytest.raises(ValueError) as info:
        run(pipe)
    message = str(info.value)
    assert f"cannot read {bad} row 50 of dataset" in message, message  # the first bad row
    assert "truncated or corrupt" in message and "on_error='skip'" in message


def test_corrupted_parquet_skipped_rows_are_read_error_tombstones(tmp_path: Path) -> None:
    bad = _corrupt_parquet(tmp_path)
    pipe = Pipeline.from_parquet(str(bad), num_lanes=2, chunk_size=16,
                                 on_error="skip").fetch().decode_text()
    out, stats, warned = run(pipe)
    ids = sorted(r.payload["id"] for r in out)
    assert ids == [*range(50), *range(100, 200)]  # exactly the damaged row group is skipped
    assert stats["tombstoned"] == 50 and stats["read"] == 200
    assert {r for c in stats["lanes"].values() for r in c["tombstoned"]} == {"read_error"}
    assert len(warned) == 1 and "read_error: 50" in warned[0] and "bad.parquet row" in warned[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert_deterministic(pipe, [{"runner": "threads", "num_workers": 2},
                                    {"runner": "process", "num_workers": 2}])


# ---------------------------------------------------------------- paths


@pytest.mark.parametrize("builder", ["from_jsonl", "from_parquet", "from_text_files"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_missing_path_or_empty_glob_is_an_error_even_when_skipping(tmp_path: Path, builder: str,
                                                                   on_error: str) -> None:
    # Nothing to count or tombstone: a path that names nothing is a configuration error.
    make = getattr(Pipeline, builder)
    for path in (tmp_path / "nope.jsonl", tmp_path / "*.parquet", tmp_path / "missing" / "x"):
        with pytest.raises(FileNotFoundError, match=rf"{re.escape(repr(str(path)))} matches no "
                                                    "file.*check the path"):
            make(str(path), on_error=on_error)


def test_file_removed_after_the_pipeline_was_built(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    pipe = Pipeline.from_text_files(str(tmp_path / "*.txt"), num_lanes=1).fetch().decode_text()
    skipping = Pipeline.from_text_files(str(tmp_path / "*.txt"), num_lanes=1,
                                        on_error="skip").fetch().decode_text()
    (tmp_path / "b.txt").unlink()
    with pytest.raises(ValueError, match=r"cannot read .*b\.txt of dataset 'text_files': "
                                         r"FileNotFoundError"):
        run(pipe)
    out, stats, warned = run(skipping)
    assert [r.payload["text"] for r in out] == ["first"]
    assert stats["lanes"][0]["tombstoned"] == {"read_error": 1} and "b.txt" in warned[0]


# ---------------------------------------------------------------- large documents


def test_a_ten_million_character_document_is_read_decoded_and_tokenized(
        tmp_path: Path, tokenizer: Any) -> None:
    words = "river mountain seven blue "
    big = (words * (10_000_000 // len(words) + 1))[:10_000_000]
    assert len(big) == 10_000_000
    path = write(tmp_path / "big.jsonl", [json.dumps({"text": "small one"}).encode(),
                                          json.dumps({"text": big}).encode(),
                                          json.dumps({"text": "small two"}).encode()])
    pipe = (Pipeline.from_jsonl(str(path), num_lanes=1, shuffle=False).fetch().decode_text()
            .tokenize(tokenizer, special_tokens="none"))
    out, stats, _ = run(pipe)
    assert [len(r.payload["text"]) for r in out] == [9, 10_000_000, 9]
    expected = tokenizer.encode(big, add_special_tokens=False).ids
    assert np.array_equal(out[1].payload["input_ids"], np.asarray(expected, dtype=np.int32))
    assert stats["sample_bytes"] == path.stat().st_size
    assert stats["bytes_read"] >= path.stat().st_size  # read once, plus the file's checks


# ---------------------------------------------------------------- tokenize


def test_tokenize_missing_or_non_string_field(tmp_path: Path, tokenizer: Any) -> None:
    items = [{"text": "fine"}, {"body": "no text"}, {"text": ["a", "list"]}, {"text": "ok"}]
    raising = Pipeline.from_items(items, num_lanes=1).tokenize(tokenizer)
    with pytest.raises(ValueError, match=r"tokenize: sample \(0, 0, 1\) has no field 'text' "
                                         r"\(fields: \['body'\]\).*on_error='skip'"):
        run(raising)
    skipping = Pipeline.from_items(items, num_lanes=1).tokenize(tokenizer, on_error="skip")
    out, stats, warned = run(skipping)
    assert [r.payload["text"] for r in out] == ["fine", "ok"]
    assert stats["lanes"][0]["tombstoned"] == {"tokenize_error": 2}
    assert len(warned) == 1 and "tokenize_error: 2" in warned[0]
    assert "items[1]" in warned[0] and "is a list, not a str" in warned[0]


LONE_SURROGATE_ITEMS = ["fine one", "emoji \ud83d cut", "fine two", {"text": "x \udc00 y"},
                        "fine three", "fine four", "fine five"]


def test_a_text_tokenize_cannot_encode_is_located_not_an_anonymous_crash(tokenizer: Any) -> None:
    # from_items has no decode_text: tokenize itself must find the sample.
    pipe = Pipeline.from_items(LONE_SURROGATE_ITEMS, num_lanes=1, shuffle=False)
    with pytest.raises(ValueError) as info:
        run(pipe.tokenize(tokenizer))
    message = str(info.value)
    assert message.startswith("tokenize: sample (0, 0, 1) field 'text' holds a lone UTF-16 "
                              "surrogate \\ud83d (character 6)"), message
    assert ", at items[1]; fix the data, or pass tokenize(..., on_error='skip')" in message


@pytest.mark.parametrize("microbatch", [None, 1, 2, 5])
def test_texts_tokenize_cannot_encode_are_skipped_alone_whatever_the_microbatch_size(
        tokenizer: Any, microbatch: int | None) -> None:
    pipe = (Pipeline.from_items(LONE_SURROGATE_ITEMS, num_lanes=2, chunk_size=2, seed=1)
            .tokenize(tokenizer, on_error="skip"))
    sizes = None if microbatch is None else {"tokenize": microbatch}
    out, stats, warned = run(pipe, microbatch_sizes=sizes)
    assert sorted(r.payload["text"] for r in out) == sorted(
        t for t in LONE_SURROGATE_ITEMS if isinstance(t, str) and t.startswith("fine"))
    for r in out:  # the neighbours of a bad text are tokenized as if alone
        expected = tokenizer.encode(r.payload["text"], add_special_tokens=False).ids
        # The default special_tokens="eos": the text's ids, then one EOS.
        assert r.payload["input_ids"][:-1].tolist() == expected
    assert sum(c["tombstoned"].get("tokenize_error", 0) for c in stats["lanes"].values()) == 2
    assert sorted(b["sample_id"] for b in stats["bad_samples"]) == [(0, 0, 1), (0, 0, 3)]
    assert len(warned) == 1 and "items[1]" in warned[0] and "items[3]" in warned[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        # The reference is inline with the default sizes.
        assert_deterministic(pipe, matrix(workers=(2,), microbatch_sizes=(sizes,)))


def test_a_chat_message_tokenize_chat_cannot_encode_is_located_or_skipped(tokenizer: Any) -> None:
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo \ud83d"}]
    items = [{"messages": good}, {"messages": bad}, {"messages": good}]
    pipe = Pipeline.from_items(items, num_lanes=1, shuffle=False, on_error="skip")
    with pytest.raises(ValueError) as info:
        run(pipe.tokenize_chat(tokenizer))
    message = str(info.value)
    assert message.startswith("tokenize_chat: sample (0, 0, 1): the content of message 1 "
                              "(assistant) holds a lone UTF-16 surrogate \\ud83d"), message
    assert ", at items[1]; fix the data, or pass tokenize_chat(..., on_error='skip')" in message
    assert "the source's on_error='skip' covers only fetch and decode_text" in message
    out, stats, _ = run(pipe.tokenize_chat(tokenizer, on_error="skip"))
    assert len(out) == 2 and stats["lanes"][0]["tombstoned"] == {"tokenize_chat_error": 1}
    assert out[0].payload["input_ids"].tolist() == out[1].payload["input_ids"].tolist()


@pytest.mark.parametrize("value", [None, 7])
@pytest.mark.parametrize("source_on_error", ["raise", "skip"])
def test_a_null_or_integer_parquet_text_names_file_row_and_the_operator_to_skip(
        tmp_path: Path, tokenizer: Any, value: Any, source_on_error: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if value is None:
        column, bad_row = pa.array([None if i == 4 else f"row {i}" for i in range(6)]), 4
    else:  # a Parquet column has one type: the whole column holds integers
        column, bad_row = pa.array([value] * 6), 0
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"id": list(range(6)), "text": column}), path)
    pipe = (Pipeline.from_parquet(str(path), num_lanes=1, shuffle=False,
                                  on_error=source_on_error)
            .fetch().decode_text().tokenize(tokenizer))
    with pytest.raises(ValueError) as info:
        run(pipe)
    message = str(info.value)
    assert message.startswith(f"tokenize: sample (0, 0, {bad_row}) field 'text' is a "
                              f"{type(value).__name__}, not a str, at {path} row {bad_row}; "
                              "fix the data, set field=..., or pass tokenize(..., "
                              "on_error='skip') to drop such samples"), message
    covers = "the source's on_error='skip' covers only fetch and decode_text, not tokenize"
    assert (covers in message) == (source_on_error == "skip")


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe\x00garbage", b"TRUNCATE"])
def test_tokenizer_files_that_do_not_load_name_the_file(tmp_path: Path, tokenizer: Any,
                                                        content: bytes) -> None:
    path = tmp_path / "tokenizer.json"
    if content == b"TRUNCATE":
        text = tokenizer.to_str()
        content = text[: len(text) // 2].encode()
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"tokenizer.*{re.escape(repr(str(path)))}.*"
                                         r"tokenizer\.json"):
        Tokenize(str(path))
    with pytest.raises(ValueError, match=re.escape(repr(str(path)))):
        Tokenize(str(tmp_path))  # a folder holding the file


def test_missing_tokenizer_file_or_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*nope\.json' does not exist; "
                                                r"pass the path of a tokenizer\.json"):
        Tokenize(str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match=r"empty.tokenizer\.json' does not exist"):
        (tmp_path / "empty").mkdir()
        Tokenize(str(tmp_path / "empty"))


# ---------------------------------------------------------------- parameters


def _items() -> Pipeline:
    return Pipeline.from_items([f"doc {i}" for i in range(8)], num_lanes=2)


PARAMETERS = {
    "tokenize max_length=0": (lambda tok: _items().tokenize(tok, max_length=0),
                              r"max_length must be an int >= 1 .*got 0"),
    "pack_flat max_length=0": (lambda tok: _items().pack_flat(0, pad_token_id=0),
                               r"max_length must be an integer >= 1, got 0; pass the row length"),
    "batch microbatch_size=-1": (lambda tok: _items().batch(-1),
                                 r"microbatch_size must be a positive integer, got -1; it is the "
                                 r"number of records"),
    "microbatch_sizes override -1": (
        lambda tok: _items().tokenize(tok).iter(microbatch_sizes={"tokenize": -1}),
        r"microbatch_sizes\['tokenize'\] must be a positive integer, got -1; .*omit the stage"),
    "unknown shuffle algorithm": (lambda tok: _items().shuffle(16, algorithm="perfect"),
                                  r"unknown shuffle algorithm 'perfect'; choose one of "
                                  r"'streaming', 'block', 'block_warmup'"),
    "weights summing to zero": (
        lambda tok: Pipeline.from_sources([zd.items(["a"]), zd.items(["b"], component_id=1)],
                                          weights=[0, 0]),
        r"sum to a positive number, got \[0\.0, 0\.0\]; give each component its share"),
    "negative weight": (
        lambda tok: Pipeline.from_sources([zd.items(["a"]), zd.items(["b"], component_id=1)],
                                          weights={0: 2.0, 1: -1.0}),
        r"nonnegative .*got \[2\.0, -1\.0\]"),
    "num_lanes=0": (lambda tok: Pipeline.from_items(["a"], num_lanes=0),
                    r"num_lanes must be a positive integer, got 0; it is the unit of "
                    r"parallelism"),
    "world_size > num_lanes": (lambda tok: _items().iter(rank=0, world_size=3),
                               r"world_size 3 exceeds num_lanes 2: .*num_lanes >= 3"),
    "rank outside the world": (lambda tok: _items().iter(rank=2, world_size=2),
                               r"rank 2 is outside \[0, world_size=2\)"),
    "unknown runner": (lambda tok: _items().iter(runner="gpu"),
                       r"unknown runner 'gpu'; use one of"),
    "num_workers=0": (lambda tok: _items().iter(num_workers=0),
                      r"num_workers must be a positive integer, got 0"),
    "bad on_error": (lambda tok: Pipeline.from_items(["a"], on_error="ignore"),
                     r"on_error must be 'raise' or 'skip', got 'ignore'"),
}


@pytest.mark.parametrize("case", sorted(PARAMETERS))
def test_parameters_are_validated_naming_the_value_and_the_fix(case: str,
                                                               tokenizer: Any) -> None:
    build, message = PARAMETERS[case]
    with pytest.raises(ValueError, match=message):
        build(tokenizer)


# ---------------------------------------------------------------- determinism with skips


@pytest.fixture(scope="module")
def dirty_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three JSONL files (one gzipped) with every kind of bad line spread through them."""
    root = tmp_path_factory.mktemp("dirty")
    rng = np.random.default_rng(7)
    bads = [bad for bad, _ in BAD_LINES.values()]
    for f in range(3):
        lines = []
        for i in range(120):
            if rng.random() < 0.12:
                lines.append(bads[int(rng.integers(len(bads)))])
            else:
                words = " ".join(rng.choice(["lane", "river", "data", "seven"], size=int(
                    rng.integers(1, 30))))
                lines.append(json.dumps({"id": f * 1000 + i, "text": words}).encode())
        body = b"\n".join(lines) + b"\n"
        if f == 2:
            (root / "part-2.jsonl.gz").write_bytes(gzip.compress(body))
        else:
            (root / f"part-{f}.jsonl").write_bytes(body)
    return root


def _dirty_pipe(root: Path, tokenizer: Any) -> Pipeline:
    return (Pipeline.from_jsonl(str(root / "*"), on_error="skip", num_lanes=4, chunk_size=16,
                                seed=3)
            .fetch().decode_text().tokenize(tokenizer, max_length=40)
            .pack_flat(64, pad_token_id=0).shuffle(8, seed=2).batch(2, drop_last=False))


def test_skips_are_identical_on_every_runner_and_conserved(dirty_corpus: Path,
                                                           tokenizer: Any) -> None:
    pipe = _dirty_pipe(dirty_corpus, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        stats = assert_conserved(pipe, runner="inline")
        assert stats["tombstoned"] > 10
        assert_deterministic(pipe, matrix(workers=(1, 3)))


def test_skips_replay_identically_after_a_resume(dirty_corpus: Path, tokenizer: Any) -> None:
    pipe = _dirty_pipe(dirty_corpus, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        reference = assert_restores_everywhere(
            pipe, cut_points=[0, 3, 17, 40],
            resume_settings=({"runner": "threads", "num_workers": 2},
                             {"runner": "process", "num_workers": 2}))
    assert len(reference) > 40
