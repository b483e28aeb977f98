"""Tests for ``zephon_torch.ops.mixture``: per-lane smooth weighted round-robin."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from contract_registry import ContractData, cases_for, check_case
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.ops.base import OpContext
from zephon_torch.ops.mixture import EnsureMixture, MixtureAccumulator
from zephon_torch.types import SampleMeta, SampleRecord


def _rec(i: int, comp: int, *, lane: int = 0, chunk: int = 0, n: int = 3,
         counts: dict[int, int] | None = None,
         tokens: dict[int, int] | None = None) -> SampleRecord:
    meta = SampleMeta((comp, lane, i), lane_id=lane, chunk_id=chunk, chunk_offset=i,
                      component_sample_counts={comp: 1} if counts is None else counts,
                      component_token_counts=tokens)
    return SampleRecord(meta, {"input_ids": np.arange(n, dtype=np.int32)})


def _comp(rec: SampleRecord) -> int:
    return rec.meta.sample_id[0]


def _drive(acc: MixtureAccumulator, records, *, flush: bool = True) -> list[SampleRecord]:
    out: list[SampleRecord] = []
    for rec in records:
        for mb in acc.push_many([rec]):
            out.extend(mb)
    if flush:
        for mb in acc.flush():
            out.extend(mb)
        assert not acc.has_pending_data()
    return out


def _stream(counts: dict[int, int], seed: int = 0, *, lane: int = 0,
            lengths: dict[int, tuple[int, int]] | None = None) -> list[SampleRecord]:
    """Records of each component in a seeded random arrival order."""
    rng = np.random.default_rng(seed)
    comps = np.concatenate([np.full(k, c) for c, k in counts.items()])
    rng.shuffle(comps)
    records = []
    for i, c in enumerate(comps.tolist()):
        lo, hi = (3, 4) if lengths is None else lengths[c]
        records.append(_rec(i, c, lane=lane, chunk=i // 50, n=int(rng.integers(lo, hi))))
    return records


# --------------------------------------------------------------------------- golden values


def test_docstring_example_emits_0_1_0_0_1_0():
    acc = MixtureAccumulator({0: 2, 1: 1}, weight_by="samples")
    records = [_rec(i, c) for i, c in enumerate([0, 0, 1, 1, 0, 0])]
    out = _drive(acc, records)
    assert [r.meta.chunk_offset for r in out] == [0, 2, 1, 4, 3, 5]
    assert [_comp(r) for r in out] == [0, 1, 0, 0, 1, 0]


# Pins the emitted sequence for a fixed input, so an accidental change to the
# round-robin (tie-breaking, when steps run, flush order) fails loudly. Only
# update it for a deliberate, announced change.
_GOLDEN_OFFSETS = [0, 4, 1, 2, 5, 3, 7, 12, 8, 6, 13, 9, 10, 15, 11, 14, 16, 17, 18, 19]


def test_golden_emission_sequence_is_pinned():
    comps = [0, 0, 2, 0, 1, 1, 2, 0, 0, 0, 0, 0, 1, 1, 2, 1, 0, 0, 2, 0]
    records = [_rec(i, c) for i, c in enumerate(comps)]
    acc = MixtureAccumulator({0: 3, 1: 2, 2: 1}, weight_by="samples", max_buffer_size=6)
    out = _drive(acc, records)
    assert [r.meta.chunk_offset for r in out] == _GOLDEN_OFFSETS
    # The components it gives: 3:2:1 cycles while all three are buffered.
    assert [comps[i] for i in _GOLDEN_OFFSETS[:12]] == [0, 1, 0, 2, 1, 0] * 2


# --------------------------------------------------------------------------- ratios


def test_ratios_track_70_30_by_samples_at_every_prefix():
    records = _stream({0: 700, 1: 300}, seed=1)
    acc = MixtureAccumulator({0: 70, 1: 30}, weight_by="samples", max_buffer_size=1000)
    out = _drive(acc, records)
    assert sorted(r.meta.sample_id for r in out) == sorted(r.meta.sample_id for r in records)
    zeros = np.cumsum([_comp(r) == 0 for r in out])
    n = np.arange(1, len(out) + 1)
    assert np.all(np.abs(zeros[99:] / n[99:] - 0.7) <= 0.01)
    # Smoothness: never more than one sample away from the exact share.
    assert np.max(np.abs(zeros - 0.7 * n)) <= 1.0


def test_ratios_are_corrected_when_the_input_is_off_target():
    # The input is 50/50; what leaves before the end is 70/30, the surplus
    # waits in the buffer and leaves at the final flush (nothing dropped).
    records = _stream({0: 1000, 1: 1000}, seed=2)
    acc = MixtureAccumulator({0: 0.7, 1: 0.3}, weight_by="samples", max_buffer_size=5000)
    live = _drive(acc, records, flush=False)
    share = np.mean([_comp(r) == 0 for r in live])
    assert len(live) > 1000 and abs(share - 0.7) <= 0.01
    rest = [r for mb in acc.flush() for r in mb]
    assert len(live) + len(rest) == 2000


def test_ratios_track_targets_by_tokens():
    # Component 1's documents are ~5x longer: a 70/30 token mix is ~92/8 in samples.
    records = _stream({0: 1500, 1: 500}, seed=3, lengths={0: (10, 50), 1: (100, 200)})
    acc = MixtureAccumulator({0: 7, 1: 3}, weight_by="tokens", max_buffer_size=5000)
    assert acc.reads_payload is True
    live = _drive(acc, records, flush=False)
    tokens = {0: 0, 1: 0}
    worst = 0.0
    for r in live:
        tokens[_comp(r)] += len(r.payload["input_ids"])
        total = tokens[0] + tokens[1]
        if total >= 20_000:
            worst = max(worst, abs(tokens[0] / total - 0.7))
    assert tokens[0] + tokens[1] > 40_000
    assert worst <= 0.01
    rest = [r for mb in acc.flush() for r in mb]
    assert len(live) + len(rest) == len(records)


def test_token_counts_from_meta_are_accounted_per_component():
    # A packed record {0: 30 tokens, 1: 10 tokens} waits in component 0's
    # queue but credits component 1 with its 10 tokens.
    packed = _rec(0, 0, counts={0: 1, 1: 1}, tokens={0: 30, 1: 10})
    acc = MixtureAccumulator({0: 1, 1: 1}, weight_by="tokens")
    acc.push_many([packed])
    assert acc.has_pending_data(0)  # waits for component 1
    out = acc.push_many([_rec(1, 1, n=20), _rec(2, 0, n=20)])
    # After the packed row (0 is 10 ahead), the 20-token record of 1 goes next.
    assert [r.meta.chunk_offset for mb in out for r in mb] == [0, 1]


def test_packed_record_waits_in_its_dominant_component():
    acc = MixtureAccumulator({0: 1, 1: 1}, weight_by="samples")
    # Dominant component 1: it waits in queue 1, so 0 is still missing.
    assert acc.push_many([_rec(0, 0, counts={0: 1, 1: 3}), _rec(1, 1)]) == []
    # A tie goes to the lowest id: queue 0, and now both queues hold records;
    # both heads weigh 4 samples, so the tie in scores also goes to 0.
    out = acc.push_many([_rec(2, 0, counts={0: 2, 1: 2})])
    assert [r.meta.chunk_offset for mb in out for r in mb] == [2]
    assert acc.buffered_count(0) == 2


# --------------------------------------------------------------------------- buffering


@pytest.mark.parametrize("limit", [1, 5, 37])
def test_max_buffer_size_bounds_each_lane(limit):
    # Component 1 never comes: records leave only through the buffer bound.
    acc = MixtureAccumulator({0: 1, 1: 1}, weight_by="samples", max_buffer_size=limit)
    emitted = 0
    for i in range(200):
        emitted += sum(len(mb) for mb in acc.push_many([_rec(i, 0, lane=i % 2)]))
        assert acc.buffered_count(0) <= limit and acc.buffered_count(1) <= limit
    assert emitted == 200 - 2 * limit
    assert sum(len(mb) for mb in acc.flush()) == 2 * limit


def test_records_without_a_target_pass_straight_through():
    acc = MixtureAccumulator({0: 1, 1: 0}, weight_by="samples")
    out = acc.push_many([_rec(0, 1), _rec(1, 5), _rec(2, 0, counts={})])
    assert [r.meta.chunk_offset for mb in out for r in mb] == [0, 1, 2]
    assert not acc.has_pending_data()


def test_without_targets_seen_components_get_equal_weights():
    acc = MixtureAccumulator(None, weight_by="samples")
    records = [_rec(i, c) for i, c in enumerate([0] * 6 + [1] * 3)]
    out = _drive(acc, records, flush=False)
    # Component 0 alone flows freely; once 1 is seen, it waits for a 0 to pair with.
    assert [_comp(r) for r in out] == [0] * 6
    out = _drive(acc, [_rec(10 + i, 0) for i in range(3)])
    assert [_comp(r) for r in out] == [0, 1, 0, 1, 0, 1]


@settings(max_examples=60, deadline=None)
@given(
    comps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(1, 9)),
                   max_size=60),
    weights=st.lists(st.integers(0, 5), min_size=4, max_size=4).filter(lambda w: sum(w) > 0),
    limit=st.integers(1, 10),
    weight_by=st.sampled_from(["samples", "tokens", "input_ids"]),
    cuts=st.lists(st.integers(0, 60), max_size=6),
)
def test_nothing_is_dropped_and_grouping_does_not_matter(comps, weights, limit, weight_by, cuts):
    records = [_rec(i, c, lane=lane, n=n) for i, (c, lane, n) in enumerate(comps)]
    targets = dict(enumerate(weights))

    def run(groups):
        acc = MixtureAccumulator(targets, weight_by=weight_by, max_buffer_size=limit)
        out = []
        for group in groups:
            for mb in acc.push_many(group):
                assert len({r.meta.lane_id for r in mb}) == 1
                out.extend(mb)
            assert all(acc.buffered_count(lane) <= limit for lane in range(3))
        for mb in acc.flush():
            out.extend(mb)
        assert not acc.has_pending_data()
        return {lane: [r.meta.chunk_offset for r in out if r.meta.lane_id == lane]
                for lane in range(3)}

    one_by_one = run([[r] for r in records])
    assert sorted(i for seq in one_by_one.values() for i in seq) == list(range(len(records)))
    bounds = [0, *sorted(c % (len(records) + 1) for c in cuts), len(records)]
    assert run([records[a:b] for a, b in itertools.pairwise(bounds)]) == one_by_one


# --------------------------------------------------------------------------- flush and lanes


def test_reset_flush_empties_one_lane_and_restarts_its_weights():
    acc = MixtureAccumulator({0: 2, 1: 1}, weight_by="samples")
    acc.push_many([_rec(0, 0, lane=0), _rec(1, 1, lane=0), _rec(2, 0, lane=0),
                   _rec(3, 0, lane=1), _rec(4, 0, lane=1)])
    drained = acc.flush(reset=True, lane_id=0)
    assert [[r.meta.chunk_offset for r in mb] for mb in drained] == [[2]]
    assert not acc.has_pending_data(0)
    assert acc.buffered_count(1) == 2  # lane 1 untouched

    later = [_rec(10 + i, c, lane=0) for i, c in enumerate([1, 0, 0, 1, 0, 1])]
    fresh = _drive(MixtureAccumulator({0: 2, 1: 1}, weight_by="samples"), later, flush=False)
    again = _drive(acc, later, flush=False)
    assert [r.meta.chunk_offset for r in again] == [r.meta.chunk_offset for r in fresh]
    assert [[r.meta.lane_id for r in mb] for mb in acc.flush()] == [[0, 0], [1, 1]]


def test_lanes_do_not_influence_each_other():
    lane0 = _stream({0: 60, 1: 40}, seed=4, lane=0)
    lane1 = _stream({0: 10, 1: 90}, seed=5, lane=1)
    mixed = [r for pair in zip(lane0, lane1) for r in pair]
    out = _drive(MixtureAccumulator({0: 1, 1: 1}, max_buffer_size=20), mixed)
    for lane, alone in ((0, lane0), (1, lane1)):
        solo = _drive(MixtureAccumulator({0: 1, 1: 1}, max_buffer_size=20), alone)
        assert [r for r in out if r.meta.lane_id == lane] == solo


# --------------------------------------------------------------------------- weight_by


def test_weight_by_field_and_callable():
    records = _stream({0: 300, 1: 300}, seed=6, lengths={0: (1, 10), 1: (10, 30)})
    by_field = _drive(MixtureAccumulator({0: 1, 1: 1}, weight_by="input_ids"), records)
    by_fn = _drive(MixtureAccumulator({0: 1, 1: 1},
                                      weight_by=lambda r: float(len(r.payload["input_ids"]))),
                   records)
    by_tokens = _drive(MixtureAccumulator({0: 1, 1: 1}, weight_by="tokens"), records)
    assert by_field == by_fn == by_tokens


def test_weight_by_errors_name_the_record():
    acc = MixtureAccumulator({0: 1}, weight_by="labels")
    with pytest.raises(ValueError, match="no payload field 'labels'"):
        acc.push_many([_rec(0, 0)])
    acc = MixtureAccumulator({0: 1}, weight_by=lambda r: -1)
    with pytest.raises(ValueError, match="returned -1"):
        acc.push_many([_rec(0, 0)])
    acc = MixtureAccumulator({0: 1}, weight_by="tokens")
    bare = SampleRecord(_rec(0, 0).meta, {"text": "hi"})
    with pytest.raises(ValueError, match="no token field"):
        acc.push_many([bare])


def test_auto_follows_the_plan_or_decides_per_record():
    op = EnsureMixture(mixture={0: 1, 1: 1})
    tokens = op.accumulator(deterministic=True, ctx=OpContext(plan={"has_tokens": True}))
    samples = op.accumulator(deterministic=True, ctx=OpContext(plan={"has_tokens": False}))
    unknown = op.accumulator(deterministic=True, ctx=OpContext())
    assert (tokens.weight_by, tokens.reads_payload) == ("tokens", True)
    assert (samples.weight_by, samples.reads_payload) == ("samples", False)
    assert (unknown.weight_by, unknown.reads_payload) == ("auto", True)
    records = _stream({0: 200, 1: 200}, seed=7, lengths={0: (1, 5), 1: (20, 40)})
    assert _drive(unknown, records) == _drive(
        MixtureAccumulator({0: 1, 1: 1}, weight_by="tokens"), records
    )
    texts = [SampleRecord(r.meta, {"text": "x"}) for r in records]
    assert _drive(op.accumulator(deterministic=True, ctx=OpContext()), texts) == _drive(
        MixtureAccumulator({0: 1, 1: 1}, weight_by="samples"), texts
    )


# --------------------------------------------------------------------------- operator surface


def test_targets_come_from_mixture_else_the_sources():
    ctx = OpContext(component_weights={0: 0.25, 1: 0.75})
    assert EnsureMixture().accumulator(deterministic=True, ctx=ctx).targets == {0: 0.25, 1: 0.75}
    own = EnsureMixture(mixture={0: 1, 1: 1}).accumulator(deterministic=True, ctx=ctx)
    assert own.targets == {0: 1, 1: 1}
    assert EnsureMixture().accumulator(deterministic=True, ctx=OpContext()).targets is None
    with pytest.raises(ValueError, match="source component weights"):
        EnsureMixture().accumulator(deterministic=True,
                                    ctx=OpContext(component_weights={0: -1.0}))


def test_traits_and_config():
    op = EnsureMixture(weight_by="samples", max_buffer_size=10, mixture={1: 3, 0: 1})
    assert op.name == "ensure_mixture"
    assert op.traits().preserves_cursor_order is False
    config = op.config()
    assert config["mixture"] == [[0, 1], [1, 3]]
    assert config["weight_by"] == "samples" and config["max_buffer_size"] == 10
    fn_config = EnsureMixture(weight_by=_comp).config()
    assert fn_config["weight_by"].endswith("test_ops_mixture._comp")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_buffer_size": 0}, "max_buffer_size.*0"),
        ({"max_buffer_size": 2.0}, "max_buffer_size.*2.0"),
        ({"mixture": {0: -1}}, "component 0.*-1"),
        ({"mixture": {0: float("nan")}}, "component 0.*nan"),
        ({"mixture": {0: 0, 1: 0}}, "sum to more than 0"),
        ({"mixture": {}}, "non-empty mapping"),
        ({"mixture": {"a": 1}}, "integers.*'a'"),
        ({"mixture": {0: True}}, "component 0.*True"),
        ({"weight_by": ""}, "weight_by.*'auto', 'samples', 'tokens'"),
        ({"weight_by": 3}, "weight_by.*3"),
    ],
)
def test_bad_parameters_are_value_errors_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EnsureMixture(**kwargs)


@settings(max_examples=40, deadline=None)
@given(
    events=st.lists(st.tuples(st.booleans(), st.integers(0, 1), st.integers(0, 2)), max_size=60),
    limit=st.integers(1, 8),
)
def test_each_reset_flush_starts_the_lane_over(events, limit):
    # events: (True, lane, _) is a flush sentinel, (False, lane, comp) a record.
    def fresh() -> MixtureAccumulator:
        return MixtureAccumulator({0: 3, 1: 2, 2: 1}, weight_by="samples",
                                  max_buffer_size=limit)

    acc = fresh()
    got: dict[int, list[int]] = {0: [], 1: []}
    segments: dict[int, list[list[SampleRecord]]] = {0: [[]], 1: [[]]}

    def take(micro_batches):
        for mb in micro_batches:
            for r in mb:
                got[r.meta.lane_id].append(r.meta.chunk_offset)

    for i, (is_flush, lane, comp) in enumerate(events):
        if is_flush:
            take(acc.flush(reset=True, lane_id=lane))
            assert not acc.has_pending_data(lane)
            segments[lane].append([])
        else:
            rec = _rec(i, comp, lane=lane)
            segments[lane][-1].append(rec)
            take(acc.push_many([rec]))
    take(acc.flush())
    for lane, parts in segments.items():
        expected = [r.meta.chunk_offset for part in parts for r in _drive(fresh(), part)]
        assert got[lane] == expected


@pytest.mark.parametrize("case", cases_for("zephon_torch.ops.mixture"))
def test_ensure_mixture_keeps_the_operator_contract(
        case: str, contract_data: ContractData) -> None:
    """Every runner, worker count and micro-batch size gives the inline output, each lane
    the same on any number of ranks, every sample is delivered or tombstoned once, and a
    checkpoint after any output resumes exactly (``zephon_torch.testing``)."""
    check_case(case, contract_data)
