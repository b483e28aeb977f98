"""Tests for ``map_transform`` and ``filter`` (``zephon_torch.ops.transform``)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import pickle
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from contract_registry import ContractData, cases_for, check_case
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.ops.accumulators import CountingAccumulator
from zephon_torch.ops.base import TOMBSTONE_REASON_TAG, OpContext, live_records, tombstone
from zephon_torch.ops.transform import PLACEMENTS, Filter, MapTransform, callable_config
from zephon_torch.types import FLUSH_SENTINEL_TAG, SampleBatch, SampleMeta, SampleRecord


def _rec(i: int, payload, *, lane: int = 0) -> SampleRecord:
    meta = SampleMeta(sample_id=(0, 1, i), lane_id=lane, chunk_id=2, chunk_offset=i)
    return SampleRecord(meta, payload)


def _flush_sentinel(lane: int = 0) -> SampleRecord:
    meta = SampleMeta(sample_id=(-1, -1, -1), lane_id=lane, chunk_id=5,
                      tags={FLUSH_SENTINEL_TAG: True})
    return SampleRecord(meta, None)


def _add_length(payload):
    return {**payload, "n": len(payload["text"])}


def _is_long(payload):
    return len(payload["text"]) > 3


class _Boom(RuntimeError):
    pass


def _explode(payload):
    raise _Boom(f"bad payload {payload!r}")


# --------------------------------------------------------------------------- map_transform


def test_map_rebuilds_payload_and_keeps_meta():
    rec = _rec(0, {"text": "hello"})
    (out,) = MapTransform(_add_length).process_many([rec])
    assert type(out) is SampleRecord
    assert out.meta is rec.meta
    assert out.payload == {"text": "hello", "n": 5}
    assert rec.payload == {"text": "hello"}  # the input payload is not mutated


def test_map_returning_its_input_reuses_the_record():
    recs = [_rec(i, {"text": "x" * i}) for i in range(3)]
    out = MapTransform(lambda p: p).process_many(recs)
    assert all(o is r for o, r in zip(out, recs, strict=True))


def test_map_mutating_in_place_and_returning_input_reuses_the_record():
    rec = _rec(0, {"text": "ab"})

    def mutate(p):
        p["seen"] = True
        return p

    (out,) = MapTransform(mutate).process_many([rec])
    assert out is rec and out.payload["seen"] is True


def test_map_none_becomes_tombstone_with_reason():
    rec = _rec(4, {"text": "drop me"})
    (out,) = MapTransform(lambda p: None).process_many([rec])
    assert out.meta.tombstone and out.meta.is_sentinel
    assert out.meta.tags[TOMBSTONE_REASON_TAG] == "map_none"
    assert out.payload is None
    # The tombstone still closes the same base offset.
    assert out.meta.cursor == rec.meta.cursor
    assert out.meta.contribution_cursors() == rec.meta.contribution_cursors()


def test_map_none_is_kept_as_payload_without_drop_none():
    rec = _rec(1, {"text": "x"})
    (out,) = MapTransform(lambda p: None, drop_none=False).process_many([rec])
    assert not out.meta.tombstone
    assert out.meta is rec.meta and out.payload is None


def test_map_exceptions_propagate_with_their_type():
    with pytest.raises(_Boom, match="bad payload"):
        MapTransform(_explode).process_many([_rec(0, {"text": "a"})])
    with pytest.raises(KeyError):
        MapTransform(lambda p: p["missing"]).process_many([_rec(0, {"text": "a"})])


def test_map_placement_is_validated_and_stored():
    assert PLACEMENTS == ("local", "remote")
    assert MapTransform(_add_length).placement == "local"
    assert MapTransform(_add_length, placement="remote").placement == "remote"
    with pytest.raises(ValueError, match="placement"):
        MapTransform(_add_length, placement="gpu")


def test_map_and_filter_reject_non_callables():
    with pytest.raises(TypeError, match="callable"):
        MapTransform("not a function")
    with pytest.raises(TypeError, match="callable"):
        Filter(42)


def test_map_keeps_output_order_and_mixed_outcomes():
    recs = [_rec(i, {"text": "y" * i}) for i in range(6)]

    def fn(p):
        n = len(p["text"])
        if n % 3 == 0:
            return None
        return p if n % 3 == 1 else {"text": p["text"].upper()}

    out = MapTransform(fn).process_many(recs)
    assert [o.meta.sample_id for o in out] == [r.meta.sample_id for r in recs]
    assert [o.meta.tombstone for o in out] == [True, False, False, True, False, False]
    assert out[1] is recs[1] and out[4] is recs[4]
    assert out[2].payload == {"text": "YY"}


# --------------------------------------------------------------------------- filter


def test_filter_tombstones_failing_records_and_forwards_passing_ones():
    recs = [_rec(i, {"text": "z" * i}) for i in range(6)]
    out = Filter(_is_long).process_many(recs)
    for rec, res in zip(recs, out, strict=True):
        if len(rec.payload["text"]) > 3:
            assert res is rec
        else:
            assert res.meta.tombstone
            assert res.meta.tags[TOMBSTONE_REASON_TAG] == "filter"
            assert res.payload is None
            assert res.meta.cursor == rec.meta.cursor


def test_filter_exceptions_propagate_with_their_type():
    with pytest.raises(_Boom):
        Filter(_explode).process_many([_rec(0, {"text": "a"})])


# --------------------------------------------------------------------------- shared behaviour


OPS = [
    pytest.param(lambda: MapTransform(_explode), id="map"),
    pytest.param(lambda: MapTransform(_explode, drop_none=False), id="map-keep-none"),
    pytest.param(lambda: Filter(_explode), id="filter"),
]


@pytest.mark.parametrize("make_op", OPS)
def test_tombstones_and_flush_sentinels_pass_through_untouched(make_op):
    op = make_op()  # the user function raises: it must never be called on these
    dead = tombstone(_rec(0, {"text": "gone"}), "earlier")
    sentinel = _flush_sentinel()
    out = op.process_many([dead, sentinel])
    assert out[0] is dead and out[1] is sentinel


@pytest.mark.parametrize("op", [MapTransform(_add_length), Filter(_is_long)], ids=["map", "filter"])
def test_batches_are_rejected_with_a_clear_error(op):
    batch = SampleBatch([_rec(0, {"text": "abcd"})])
    with pytest.raises(TypeError, match="before batch"):
        op.process_many([batch])


@pytest.mark.parametrize("op", [MapTransform(_add_length), Filter(_is_long)], ids=["map", "filter"])
def test_default_accumulator_counts_without_latency_bound(op):
    acc = op.accumulator(deterministic=True, ctx=OpContext())
    assert isinstance(acc, CountingAccumulator)
    assert acc.max_batch == 512 and acc.max_latency_ms is None
    acc = op.accumulator(deterministic=True, ctx=OpContext(microbatch_size=7))
    assert acc.max_batch == 7 and acc.max_latency_ms is None
    assert op.traits().preserves_cursor_order


def test_names_and_default_microbatch_sizes():
    assert (MapTransform.name, MapTransform.default_microbatch_size) == ("map_transform", 512)
    assert (Filter.name, Filter.default_microbatch_size) == ("filter", 512)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 8), max_size=20),
    cuts=st.lists(st.integers(0, 20), max_size=4),
)
def test_outputs_do_not_depend_on_micro_batch_boundaries(lengths, cuts):
    recs = [_rec(i, {"text": "q" * n}) for i, n in enumerate(lengths)]
    bounds = sorted({0, len(recs), *(c for c in cuts if c <= len(recs))})
    for op in (MapTransform(lambda p: None if len(p["text"]) == 2 else _add_length(p)),
               Filter(_is_long)):
        whole = op.process_many(recs)
        pieces = [o for a, b in itertools.pairwise(bounds) for o in op.process_many(recs[a:b])]
        assert pieces == whole


# --------------------------------------------------------------------------- pickling


def test_pickle_round_trip_with_module_level_functions():
    recs = [_rec(i, {"text": "w" * i}) for i in range(5)]
    for op in (MapTransform(_add_length, drop_none=False, placement="remote"), Filter(_is_long)):
        back = pickle.loads(pickle.dumps(op))
        assert back.process_many(recs) == op.process_many(recs)
        assert back.config() == op.config()
    assert pickle.loads(pickle.dumps(MapTransform(_add_length, placement="remote"))).placement \
        == "remote"


def test_cloudpickle_round_trip_with_lambdas_and_closures():
    cloudpickle = pytest.importorskip("cloudpickle")
    limit = 2
    recs = [_rec(i, {"text": "v" * i}) for i in range(5)]
    for op in (MapTransform(lambda p: {**p, "big": len(p["text"]) > limit}),
               Filter(lambda p: len(p["text"]) > limit)):
        back = cloudpickle.loads(cloudpickle.dumps(op))
        assert back.process_many(recs) == op.process_many(recs)
        assert back.config() == op.config()


# --------------------------------------------------------------------------- fingerprints


def _compile(source: str, name: str = "fn", filename: str = "<a>"):
    namespace: dict = {}
    exec(compile(textwrap.dedent(source), filename, "exec"), namespace)
    return namespace[name]


def test_config_is_json_and_names_the_function():
    cfg = MapTransform(_add_length).config()
    assert json.loads(json.dumps(cfg)) == cfg
    assert cfg["fn"]["name"].endswith("test_ops_transform._add_length")
    assert cfg["drop_none"] is True
    assert "placement" not in cfg  # where it runs does not change the output
    assert Filter(_is_long).config()["predicate"]["name"].endswith("._is_long")


def test_code_hash_changes_when_the_code_changes():
    base = _compile("def fn(p):\n    return len(p) > 3\n")
    same_elsewhere = _compile("\n\n\ndef fn(p):\n    return len(p) > 3\n", filename="<b>")
    other_const = _compile("def fn(p):\n    return len(p) > 4\n")
    other_name = _compile("def fn(p):\n    return sum(p) > 3\n")
    other_op = _compile("def fn(p):\n    return len(p) >= 3\n")
    nested = _compile("def fn(p):\n    return [x for x in p if x > 1]\n")
    nested_changed = _compile("def fn(p):\n    return [x for x in p if x > 2]\n")

    def digest(f):
        return Filter(f).config()["predicate"]["code_sha256"]

    # Moving a function (another file, other line numbers) keeps its hash.
    assert digest(base) == digest(same_elsewhere)
    hashes = {digest(f) for f in (base, other_const, other_name, other_op, nested,
                                  nested_changed)}
    assert len(hashes) == 6


def test_code_hash_covers_plain_closure_values_and_defaults():
    def make(limit):
        return lambda p: len(p) > limit

    def with_default(p, limit=3):
        return len(p) > limit

    assert callable_config(make(3)) == callable_config(make(3))
    assert callable_config(make(3)) != callable_config(make(4))
    assert callable_config(with_default) != callable_config(functools.partial(with_default,
                                                                              limit=4))
    assert callable_config(functools.partial(with_default, limit=4)) == callable_config(
        functools.partial(with_default, limit=4))


def test_config_of_callable_objects_builtins_and_methods():
    class Threshold:
        def __call__(self, p):
            return len(p) > 1

    class Other:
        def __call__(self, p):
            return len(p) > 2

        def method(self, p):
            return p

    cfg = callable_config(Threshold())
    assert cfg["name"].endswith("Threshold")
    assert cfg == callable_config(Threshold())
    assert cfg["code_sha256"] != callable_config(Other())["code_sha256"]
    assert callable_config(len)["name"] == "builtins.len"
    assert callable_config(Other().method)["name"].endswith("Other.method")


def test_code_hash_is_the_same_in_every_process():
    # A set literal compiles to a frozenset constant whose iteration order
    # follows the string hash seed: the fingerprint must not.
    script = textwrap.dedent("""
        from zephon_torch.ops.transform import callable_config
        def fn(p):
            return p["lang"] in {"en", "fr", "de", "es", "it", "pt", "nl"}
        print(callable_config(fn)["code_sha256"])
    """)
    digests = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                capture_output=True, text=True)
        digests.add(result.stdout.strip())
    assert len(digests) == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=20), st.booleans())
def test_a_map_over_a_block_drops_the_nones_its_records_would_drop(rows: list[Any],
                                                                    drop_none: bool) -> None:
    # Array payloads (== would refuse them), None returns, rows already tombstones.
    import numpy as np

    from zephon_torch.block import blocks_from_elements

    records = []
    for i, (kind, dead) in enumerate(rows):
        record = SampleRecord(SampleMeta((0, 0, i), 1, 0, i, {0: 1}),
                              np.arange(kind + 2) if kind else {"k": i})
        records.append(tombstone(record, "filter") if dead else record)
    op = MapTransform(lambda p: None if isinstance(p, np.ndarray) and len(p) == 3 else p,
                      drop_none=drop_none)
    expected = op.process_many(records)
    got = [r for block in blocks_from_elements(records) for r in
           op.process_block(block).records()]
    assert got == expected


# --------------------------------------------------------------------------- live_records


@given(st.lists(st.sampled_from(["data", "tagged", "tombstone", "flush", "same_flush"]),
                max_size=40))
@settings(max_examples=200, deadline=None)
def test_live_records_skips_exactly_the_control_records(kinds):
    flush = _flush_sentinel()
    elems = []
    for i, kind in enumerate(kinds):
        rec = _rec(i, {"text": str(i)})
        if kind == "tagged":  # tags that mark no control record
            rec = SampleRecord(rec.meta._replace(tags={"note": 1}), rec.payload)
        elif kind == "tombstone":
            rec = tombstone(rec, "filter")
        elif kind == "flush":
            rec = _flush_sentinel()
        elif kind == "same_flush":  # one object standing twice
            rec = flush
        elems.append(rec)
    expected = [(i, rec) for i, rec in enumerate(elems) if not rec.meta.is_sentinel]
    got = list(live_records(elems, "stage"))
    assert [i for i, _ in got] == [i for i, _ in expected]
    assert all(a is b for (_, a), (_, b) in zip(got, expected))


def test_live_records_refuses_a_batch_where_it_stands():
    batch = SampleBatch([_rec(9, {"text": "x"})])
    seen = []
    with pytest.raises(TypeError, match="stage works on SampleRecord elements, got SampleBatch"):
        for i, _ in live_records([_rec(0, {}), _flush_sentinel(), _rec(2, {}), batch], "stage"):
            seen.append(i)
    assert seen == [0, 2]  # the work on earlier records came first


@pytest.mark.parametrize(
    "case", cases_for("zephon_torch.ops.transform", "zephon_torch.ops.fused"))
def test_map_transform_filter_and_fused_stages_keep_the_operator_contract(
        case: str, contract_data: ContractData) -> None:
    """Every runner, worker count and micro-batch size gives the inline output, each lane
    the same on any number of ranks, every sample is delivered or tombstoned once, and a
    checkpoint after any output resumes exactly (``zephon_torch.testing``)."""
    check_case(case, contract_data)
