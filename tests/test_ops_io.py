"""The fetch and decode_text operators on hand-built pointer records."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from contract_registry import ContractData, cases_for, check_case

from zephon_torch.ops import OpContext, Operator, OpTraits
from zephon_torch.ops.accumulators import CountingAccumulator
from zephon_torch.ops.base import TOMBSTONE_DETAIL_TAG, TOMBSTONE_REASON_TAG, tombstone
from zephon_torch.ops.io import DecodeText, Fetch
from zephon_torch.sources import datasets as zd
from zephon_torch.sources.base import POINTER
from zephon_torch.types import SampleBatch, SampleMeta, SampleRecord


def pointer(dataset_id: int, shard: int, local: int, *, offset: int = 0) -> SampleRecord:
    meta = SampleMeta((dataset_id, shard, local), lane_id=0, chunk_id=0, chunk_offset=offset,
                      component_sample_counts={0: 1})
    return SampleRecord(meta, POINTER)


def ctx_for(datasets: dict) -> OpContext:
    return OpContext(plan={"datasets": datasets})


def ready(op: Operator, datasets: dict) -> Operator:
    op.setup(ctx_for(datasets))
    return op


def reason(record: SampleRecord) -> str | None:
    return record.meta.tags.get(TOMBSTONE_REASON_TAG) if record.meta.tombstone else None


@pytest.fixture
def corpus(tmp_path: Path) -> dict:
    a0 = tmp_path / "a0.jsonl"
    a0.write_text("\n".join(json.dumps({"text": f"a{i}"}) for i in range(5)) + "\n")
    a1 = tmp_path / "a1.jsonl"
    a1.write_text("\n".join(json.dumps({"text": f"b{i}"}) for i in range(3)) + "\n")
    table = pa.table({"text": ["p0", "p1", "p2"],
                      "ids": pa.array([[1], [2, 3], []], type=pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=2)
    (tmp_path / "doc.txt").write_text("a whole document")
    return {
        0: zd.jsonl(str(tmp_path / "a*.jsonl"), cache_dir=tmp_path / "cache"),
        1: zd.parquet(tmp_path / "p.parquet"),
        2: zd.text_files(tmp_path / "doc.txt"),
        3: zd.items(["inline", {"text": "dict"}]),
    }


# ---------------------------------------------------------------- fetch


def test_fetch_contract():
    op = Fetch()
    assert op.name == "fetch" and op.default_microbatch_size == 512
    assert op.traits() == OpTraits(accepts_pointers=True, elementwise=True)
    assert op.config() == {"op": "zephon_torch.ops.io.Fetch"}
    acc = op.accumulator(deterministic=True, ctx=OpContext(microbatch_size=None))
    assert isinstance(acc, CountingAccumulator) and acc.max_batch == 512


def test_fetch_reads_pointers_of_every_format_in_input_order(corpus):
    op = ready(Fetch(), corpus)
    inline = SampleRecord(pointer(3, 0, 0).meta, {"text": "already here"})
    dead = tombstone(pointer(0, 0, 4), "filter")
    elems = [pointer(0, 1, 2), pointer(1, 0, 2), inline, pointer(0, 0, 3), dead,
             pointer(2, 0, 0), pointer(0, 0, 0), pointer(1, 0, 1)]
    out = op.process_many(elems)
    assert [r.meta for r in out] == [e.meta for e in elems]
    assert out[0].payload == b'{"text": "b2"}'
    assert out[1].payload["text"] == "p2" and out[1].payload["ids"].dtype == np.int32
    assert out[2] is inline and out[4] is dead
    assert out[3].payload == b'{"text": "a3"}' and out[6].payload == b'{"text": "a0"}'
    assert out[5].payload == b"a whole document"
    assert out[7].payload["ids"].tolist() == [2, 3]


def test_fetch_reads_each_shard_with_one_call(corpus):
    calls = []

    class Spy(zd.JsonlDataset):
        def read(self, shard_id, local_ids):
            calls.append((shard_id, list(local_ids)))
            return super().read(shard_id, local_ids)

    spy = corpus[0]
    spy.__class__ = Spy
    op = ready(Fetch(), {0: spy})
    op.process_many([pointer(0, 0, 4), pointer(0, 1, 0), pointer(0, 0, 1), pointer(0, 0, 4)])
    assert calls == [(0, [4, 1, 4]), (1, [0])]


def test_fetch_passes_items_and_batches_through_and_is_stateless(corpus):
    op = ready(Fetch(), corpus)
    items = corpus[3].read(0, [0, 1])
    recs = [SampleRecord(pointer(3, 0, i).meta, p) for i, p in enumerate(items)]
    batch = SampleBatch(recs)
    assert op.process_many([*recs, batch]) == [*recs, batch]
    elems = [pointer(0, 0, 1), pointer(1, 0, 0)]
    assert op.process_many(elems) == op.process_many(elems)
    assert op.process_one(elems[0]) == op.process_many(elems[:1])


def test_fetch_item_pointers_read_the_inline_payloads(corpus):
    op = ready(Fetch(), corpus)
    out = op.process_many([pointer(3, 0, 1), pointer(3, 0, 0)])
    assert [r.payload for r in out] == [{"text": "dict"}, {"text": "inline"}]


def test_fetch_errors_without_setup_or_with_unknown_dataset(corpus):
    with pytest.raises(ValueError, match="setup"):
        Fetch().process_many([pointer(0, 0, 0)])
    assert Fetch().process_many([]) == []
    with pytest.raises(ValueError, match="no dataset with id 9"):
        ready(Fetch(), corpus).process_many([pointer(9, 0, 0)])
    with pytest.raises(ValueError, match=r"ctx\.plan\['datasets'\]"):
        Fetch().setup(OpContext())


def test_fetch_pickles_after_setup_and_reads_in_the_copy(corpus):
    op = ready(Fetch(), corpus)
    op.process_many([pointer(0, 0, 0), pointer(1, 0, 0)])
    clone = pickle.loads(pickle.dumps(op))
    assert clone.process_many([pointer(0, 1, 1)])[0].payload == b'{"text": "b1"}'


def test_fetch_one_shard_micro_batch_matches_the_general_path(corpus):
    op = ready(Fetch(), corpus)
    one = [pointer(1, 0, 2, offset=0), pointer(1, 0, 0, offset=1), pointer(1, 0, 2, offset=2)]
    out = op.process_many(one)  # pointers of one shard only
    assert [r.meta for r in out] == [r.meta for r in one]
    assert [r.payload["text"] for r in out] == ["p2", "p0", "p2"]
    assert out[0].payload["ids"] is not out[2].payload["ids"]
    # A record that is not a pointer in front: every record is looked at one by one.
    item = SampleRecord(pointer(3, 0, 0).meta, {"text": "x"})
    mixed = op.process_many([item, *one])
    assert mixed[0] is item and mixed[1:] == out


class _BadSector(zd.JsonlDataset):
    """A JSON Lines dataset whose line 3 of every file cannot be read."""

    def read(self, shard_id, local_ids):
        if 2 in list(local_ids):
            raise OSError("bad sector")
        return super().read(shard_id, local_ids)


@pytest.mark.parametrize("other_shard", [False, True], ids=["one-shard", "two-shards"])
def test_fetch_read_failures_skip_or_name_the_line(corpus, tmp_path, other_shard):
    pointers = [pointer(0, 0, i, offset=i) for i in range(4)]
    if other_shard:
        pointers.append(pointer(0, 1, 1, offset=4))
    paths = str(tmp_path / "a*.jsonl")
    skip = _BadSector(paths, cache_dir=tmp_path / "cache", on_error="skip")
    out = ready(Fetch(), {0: skip}).process_many(pointers)
    assert [r.meta.sample_id for r in out] == [p.meta.sample_id for p in pointers]
    assert [reason(r) for r in out] == [None, None, "read_error", None] + [None] * other_shard
    assert out[2].meta.tags[TOMBSTONE_DETAIL_TAG] == "OSError: bad sector"
    assert [r.payload for r in out if not r.meta.tombstone][:3] == [
        b'{"text": "a0"}', b'{"text": "a1"}', b'{"text": "a3"}']
    strict = _BadSector(paths, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"cannot read .*a0\.jsonl line 3 .*OSError: bad sector"):
        ready(Fetch(), {0: strict}).process_many(pointers)


# ---------------------------------------------------------------- decode_text


def fetched(corpus: dict, *pointers: SampleRecord) -> list[SampleRecord]:
    return ready(Fetch(), corpus).process_many(list(pointers))


def test_decode_text_contract():
    op = DecodeText()
    assert op.name == "decode_text" and op.default_microbatch_size == 512
    assert op.traits().preserves_cursor_order and not op.traits().accepts_pointers
    assert op.config() == {"op": "zephon_torch.ops.io.DecodeText", "field": "text",
                           "on_error": "raise"}
    assert DecodeText(field="body", on_error="skip").config()["field"] == "body"
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip'"):
        DecodeText(on_error="drop")
    with pytest.raises(ValueError, match="field must be a non-empty string"):
        DecodeText(field="")


def test_decode_text_turns_every_raw_format_into_dicts(corpus):
    recs = fetched(corpus, pointer(0, 0, 2), pointer(1, 0, 1), pointer(2, 0, 0),
                   pointer(3, 0, 1))
    out = ready(DecodeText(), corpus).process_many(recs)
    assert [r.meta for r in out] == [r.meta for r in recs]
    assert out[0].payload == {"text": "a2"}
    assert out[1] is recs[1]  # Parquet rows are dicts already
    assert out[2].payload == {"text": "a whole document"}
    assert out[3] is recs[3]


def test_decode_text_uses_the_text_dataset_field(tmp_path):
    (tmp_path / "d.txt").write_text("body text")
    datasets = {0: zd.text_files(tmp_path / "d.txt", field="content")}
    rec = fetched(datasets, pointer(0, 0, 0))
    assert ready(DecodeText(), datasets).process_many(rec)[0].payload == {"content": "body text"}
    explicit = ready(DecodeText(field="body"), datasets).process_many(rec)
    assert explicit[0].payload == {"body": "body text"}


def test_decode_text_reads_another_json_field(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"content": "x", "text": 3}\n')
    datasets = {0: zd.jsonl(tmp_path / "a.jsonl", cache_dir=tmp_path / "cache")}
    rec = fetched(datasets, pointer(0, 0, 0))
    assert ready(DecodeText(field="content"), datasets).process_many(rec)[0].payload == {
        "content": "x", "text": 3}


def test_empty_documents_become_empty_tombstones(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": ""}\n{"text": "  \\n\\t"}\n{"text": "ok"}\n')
    (tmp_path / "blank.txt").write_text("   \n")
    datasets = {0: zd.jsonl(tmp_path / "a.jsonl", cache_dir=tmp_path / "cache"),
                1: zd.text_files(tmp_path / "blank.txt"),
                2: zd.items([{"text": ""}, {"input_ids": [1, 2]}])}
    recs = fetched(datasets, pointer(0, 0, 0), pointer(0, 0, 1), pointer(0, 0, 2),
                   pointer(1, 0, 0), pointer(2, 0, 0), pointer(2, 0, 1))
    out = ready(DecodeText(), datasets).process_many(recs)
    assert [reason(r) for r in out] == ["empty", "empty", None, "empty", "empty", None]
    assert out[0].payload is None and out[0].meta.sample_id == (0, 0, 0)
    assert out[2].payload == {"text": "ok"} and out[5] is recs[5]


BAD_LINES = [
    (b'{"text": "bad \xff byte"}', "invalid UTF-8"),
    (b'{"text": "unterminated', "malformed JSON"),
    (b'["a", "list"]', "is a list, not an object"),
    (b'{"body": "no text field"}', "has no 'text' field"),
    (b'{"text": 42}', "field 'text' is a int, not a string"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_bad_lines_raise_naming_file_line_sample_and_fix(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n\n' + line + b"\n")
    datasets = {0: zd.jsonl(path, cache_dir=tmp_path / "cache")}
    recs = fetched(datasets, pointer(0, 0, 0), pointer(0, 0, 1))
    with pytest.raises(ValueError) as info:
        ready(DecodeText(), datasets).process_many(recs)
    message = str(info.value)
    assert problem in message
    assert f"{path} line 3" in message
    assert "(0, 0, 1)" in message
    assert "on_error='skip'" in message


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_bad_lines_become_decode_error_tombstones_when_the_source_skips(tmp_path, line,
                                                                         problem):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + line + b"\n")
    datasets = {0: zd.jsonl(path, cache_dir=tmp_path / "cache", on_error="skip")}
    recs = fetched(datasets, pointer(0, 0, 0), pointer(0, 0, 1))
    out = ready(DecodeText(), datasets).process_many(recs)
    assert out[0].payload == {"text": "fine"}
    assert reason(out[1]) == "decode_error" and out[1].meta.tombstone


def test_operator_skip_overrides_a_raising_source(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"not json\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    datasets = {0: zd.jsonl(path, cache_dir=tmp_path / "cache"),
                1: zd.text_files(tmp_path / "latin1.txt")}
    recs = fetched(datasets, pointer(0, 0, 0), pointer(1, 0, 0))
    out = ready(DecodeText(on_error="skip"), datasets).process_many(recs)
    assert [reason(r) for r in out] == ["decode_error", "decode_error"]
    with pytest.raises(ValueError, match=r"invalid UTF-8.*latin1\.txt"):
        ready(DecodeText(), datasets).process_many(recs[1:])


def test_decode_text_rejects_pointers_and_passes_tombstones(corpus):
    op = ready(DecodeText(), corpus)
    with pytest.raises(ValueError, match=r"add \.fetch\(\) before \.decode_text\(\)"):
        op.process_many([pointer(0, 0, 0)])
    dead = tombstone(pointer(0, 0, 0), "filter")
    assert op.process_many([dead]) == [dead]


def test_decode_text_handles_bom_and_crlf(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    datasets = {0: zd.jsonl(path, cache_dir=tmp_path / "cache")}
    recs = fetched(datasets, pointer(0, 0, 0), pointer(0, 0, 1))
    out = ready(DecodeText(), datasets).process_many(recs)
    assert [r.payload for r in out] == [{"text": "first"}, {"text": "second"}]


def test_decode_text_without_a_plan_decodes_json_bytes():
    rec = SampleRecord(pointer(0, 0, 0).meta, b'{"text": "standalone"}')
    assert DecodeText().process_many([rec])[0].payload == {"text": "standalone"}


def test_decode_text_is_stateless_and_pickles(corpus):
    recs = fetched(corpus, pointer(0, 0, 1), pointer(2, 0, 0))
    op = ready(DecodeText(), corpus)
    first = op.process_many(recs)
    assert op.process_many(recs) == first
    assert pickle.loads(pickle.dumps(op)).process_many(recs) == first


def test_decode_text_reads_chat_jsonl_with_a_messages_field(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path.write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"messages": []}) + "\n"
                    + json.dumps({"messages": 7}) + "\n")
    datasets = {0: zd.jsonl(str(path), cache_dir=str(tmp_path / "cache"))}
    fetch = ready(Fetch(), datasets)
    decode = ready(DecodeText(field="messages"), datasets)
    out = decode.process_many(fetch.process_many([pointer(0, 0, 0), pointer(0, 0, 1)]))
    assert out[0].payload == {"messages": turns}
    assert reason(out[1]) == "empty"
    with pytest.raises(ValueError, match="field 'messages' is a int, not a string"):
        decode.process_many(fetch.process_many([pointer(0, 0, 2)]))


def test_a_lone_surrogate_in_a_chat_message_is_a_decode_error_but_an_emoji_pair_is_fine(
        tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    # json.dumps writes the paired emoji as "\ud83d\ude00" and the lone half as "\ud83d".
    lines = [{"messages": [{"role": "user", "content": "smile \U0001f600"}]},
             {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "cut \ud83d"}]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert b"\\ud83d\\ude00" in path.read_bytes()
    datasets = {0: zd.jsonl(str(path), cache_dir=str(tmp_path / "cache"))}
    recs = fetched(datasets, pointer(0, 0, 0), pointer(0, 0, 1))
    with pytest.raises(ValueError) as info:
        ready(DecodeText(field="messages"), datasets).process_many(recs)
    assert str(info.value).startswith(
        "decode_text: a lone UTF-16 surrogate \\ud83d (character 4) in the content of message 1 "
        f"of field 'messages' (not valid Unicode, so no tokenizer can encode it; often half of "
        f"an emoji cut by a scraper) at {path} line 2 (sample (0, 0, 1))"), str(info.value)
    out = ready(DecodeText(field="messages", on_error="skip"), datasets).process_many(recs)
    assert out[0].payload == lines[0] and reason(out[1]) == "decode_error"
    assert "lone UTF-16 surrogate \\ud83d" in out[1].meta.tags[TOMBSTONE_DETAIL_TAG]


def _nested(depth: int) -> bytes:
    return b'{"text": "deep", "n": ' + b"[" * depth + b"]" * depth + b"}"


def _at_depth(frames: int, call: Any) -> Any:
    """``call()`` from ``frames`` more Python frames down the stack."""
    return call() if frames <= 0 else _at_depth(frames - 1, call)


def test_whether_a_deeply_nested_line_loads_depends_on_the_line_not_on_the_stack(
        tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_bytes(_nested(300) + b"\n" + _nested(100_000) + b"\n" + _nested(3) + b"\n")
    datasets = {0: zd.jsonl(path, cache_dir=tmp_path / "cache", on_error="skip")}
    recs = fetched(datasets, pointer(0, 0, 0), pointer(0, 0, 1), pointer(0, 0, 2))
    op = ready(DecodeText(), datasets)
    shallow = op.process_many(recs)
    limit = sys.getrecursionlimit()
    # 300 levels of brackets do not fit below 700 frames of caller (the old code raised a
    # bare RecursionError there); the decision must not change with the caller.
    deep = _at_depth(700, lambda: op.process_many(recs))
    assert [r.meta for r in deep] == [r.meta for r in shallow]
    assert [json.dumps(r.payload) for r in deep] == [json.dumps(r.payload) for r in shallow]
    assert json.dumps(shallow[0].payload).encode() == _nested(300)
    assert reason(shallow[1]) == "decode_error" and shallow[2].payload["text"] == "deep"
    detail = shallow[1].meta.tags[TOMBSTONE_DETAIL_TAG]
    assert detail.startswith("JSON nested too deeply for Python to load"), detail
    # The interpreter is left as it was: same limit, and deep recursion still works.
    assert sys.getrecursionlimit() == limit
    assert _at_depth(limit - 200, lambda: "bottom") == "bottom"
    with pytest.raises(ValueError, match=rf"nested too deeply .* at {path} line 2 "):
        ready(DecodeText(), {0: zd.jsonl(path, cache_dir=tmp_path / "cache")}).process_many(
            recs[1:2])


@pytest.mark.parametrize("case", cases_for("zephon_torch.ops.io"))
def test_fetch_and_decode_text_keep_the_operator_contract(
        case: str, contract_data: ContractData) -> None:
    """Every runner, worker count and micro-batch size gives the inline output, each lane
    the same on any number of ranks, every sample is delivered or tombstoned once, and a
    checkpoint after any output resumes exactly (``zephon_torch.testing``)."""
    check_case(case, contract_data)
