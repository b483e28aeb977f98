"""Epochs: a new, reproducible order per epoch; the epoch in states; EpochCounter."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from harness import assert_restores_everywhere, assert_same, collect

import zephon_torch as zt
from zephon_torch.checkpoint import merge_states, state_checksum
from zephon_torch.epochs import EpochCounter, epoch_seed, state_epoch, state_finished
from zephon_torch.ops.base import OpContext, Operator


def texts(outputs: list[Any]) -> list[str]:
    """The texts of records, or of the records of batches, in order."""
    out = []
    for item in outputs:
        records = item.records if isinstance(item, zt.SampleBatch) else [item]
        out.extend(r.payload["text"] for r in records)
    return out


def shuffled_items(n: int = 40, **config: Any) -> zt.Pipeline:
    config = {"num_lanes": 2, "chunk_size": 4, "shuffle": True, "seed": 1, **config}
    return zt.Pipeline.from_items([f"d{i}" for i in range(n)], **config)


def test_epoch_zero_is_the_order_of_an_iterator_without_epoch() -> None:
    pipe = shuffled_items().shuffle(8, seed=2).batch(3)
    assert_same(collect(pipe, runner="inline"), collect(pipe, runner="inline", epoch=0))
    assert epoch_seed(123, 0) == 123


def test_each_epoch_has_its_own_order_the_same_on_every_run() -> None:
    pipe = shuffled_items().shuffle(8, seed=2).batch(3, drop_last=False)
    orders = [texts(collect(pipe, runner="inline", epoch=e)) for e in range(3)]
    assert len({tuple(o) for o in orders}) == 3, "two epochs gave the same order"
    for e, order in enumerate(orders):
        assert texts(collect(pipe, runner="inline", epoch=e)) == order  # reproducible
        assert sorted(order) == sorted(f"d{i}" for i in range(40))  # each sample once


def test_a_shuffle_over_an_unshuffled_source_reshuffles_per_epoch() -> None:
    for algorithm in ("streaming", "block", "block_warmup"):
        pipe = shuffled_items(shuffle=False).shuffle(8, seed=2, algorithm=algorithm)
        first, second = (texts(collect(pipe, runner="inline", epoch=e)) for e in (0, 1))
        assert first != second, algorithm
        assert sorted(first) == sorted(second)


def test_a_pipeline_without_shuffling_repeats_its_order_every_epoch() -> None:
    pipe = shuffled_items(shuffle=False).batch(3)
    assert_same(collect(pipe, runner="inline", epoch=0), collect(pipe, runner="inline", epoch=4))


def test_every_pass_of_an_epoch_is_reshuffled_and_epochs_reshuffle_all_passes() -> None:
    pipe = shuffled_items(12, num_lanes=1, chunk_size=12, passes=2)
    by_epoch = [texts(collect(pipe, runner="inline", epoch=e)) for e in range(2)]
    passes = [(order[:12], order[12:]) for order in by_epoch]
    for first, second in passes:
        assert first != second and sorted(first) == sorted(second)
    assert passes[0][0] != passes[1][0] and passes[0][1] != passes[1][1]


def test_operators_see_the_epochs_seed_in_their_context() -> None:
    seen: list[int] = []

    class Spy(Operator):
        name = "spy"

        def setup(self, ctx: OpContext) -> None:
            seen.append(ctx.seed)

    pipe = shuffled_items(4).apply(Spy())
    for e in (0, 1, 2):
        collect(pipe, runner="inline", epoch=e)
    assert seen[0] == 1 and len(set(seen)) == 3


def test_the_state_records_the_epoch_and_a_resume_continues_in_it() -> None:
    pipe = shuffled_items().shuffle(8, seed=2).batch(3)
    reference = collect(pipe, runner="inline", epoch=3)
    it = pipe.iter(runner="inline", epoch=3)
    head = [next(it) for _ in range(4)]
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    assert state["epoch"] == 3 and state_epoch(state) == 3
    resumed = pipe.iter(runner="threads", num_workers=2)  # no epoch=: the state's
    resumed.load_state_dict(state)
    assert resumed.epoch == 3
    assert_same(reference, head + list(resumed))
    assert resumed.stats()["epoch"] == 3


def test_a_process_runner_resumes_a_state_of_another_epoch_in_that_epoch() -> None:
    pipe = shuffled_items().shuffle(8, seed=2, algorithm="block").batch(3)
    reference = collect(pipe, runner="inline", epoch=2)
    it = pipe.iter(runner="inline", epoch=2)
    head = [next(it) for _ in range(3)]
    state = it.state_dict()
    it.close()
    with pipe.iter(runner="process", num_workers=2) as resumed:  # built for epoch 0
        resumed.load_state_dict(state)
        assert_same(reference, head + list(resumed))


def test_resume_mid_epoch_two_is_exact_at_every_cut() -> None:
    pipe = shuffled_items(30, flush_every_k_chunks=2).shuffle(6, seed=2).batch(2)
    assert_restores_everywhere(pipe, epoch=2, resume_settings=(
        {"runner": "inline"}, {"runner": "threads", "num_workers": 2}))


def test_an_explicit_epoch_refuses_a_state_of_another_epoch() -> None:
    pipe = shuffled_items().batch(3)
    it = pipe.iter(runner="inline", epoch=3)
    next(it)
    state = it.state_dict()
    it.close()
    other = pipe.iter(runner="inline", epoch=1)
    with pytest.raises(ValueError, match=r"the state was saved in epoch 3, but this iterator "
                                         r"runs epoch 1.*pipe.iter\(epoch=3\)"):
        other.load_state_dict(state)
    assert other.epoch == 1  # nothing was loaded
    assert_same(collect(pipe, runner="inline", epoch=1), list(other))


def test_a_state_saved_before_epochs_existed_loads_as_epoch_zero() -> None:
    pipe = shuffled_items().shuffle(8, seed=2).batch(3)
    reference = collect(pipe, runner="inline")
    it = pipe.iter(runner="inline")
    head = [next(it) for _ in range(2)]
    state = it.state_dict()
    it.close()
    del state["epoch"]
    state["checksum"] = state_checksum(state)
    resumed = pipe.iter(runner="inline", epoch=0)
    resumed.load_state_dict(state)
    assert_same(reference, head + list(resumed))


def test_a_corrupted_epoch_in_a_state_is_refused() -> None:
    pipe = shuffled_items().batch(3)
    it = pipe.iter(runner="inline")
    state = it.state_dict()
    it.close()
    state["epoch"] = -1
    state["checksum"] = state_checksum(state)
    with pytest.raises(ValueError, match="corrupted state: 'epoch' must be an integer >= 0"):
        pipe.iter(runner="inline").load_state_dict(state)


def test_an_epoch_must_be_a_nonnegative_integer() -> None:
    with pytest.raises(ValueError, match=r"epoch must be an integer >= 0 \(the first epoch is "
                                         r"0\), got -2"):
        shuffled_items().iter(runner="inline", epoch=-2)
    with pytest.raises(ValueError, match="got True"):
        EpochCounter().set_epoch(True)


def test_merge_states_refuses_states_of_different_epochs() -> None:
    pipe = shuffled_items().batch(3)
    states = []
    for rank, epoch in ((0, 1), (1, 2)):
        it = pipe.iter(runner="inline", rank=rank, world_size=2, epoch=epoch)
        states.append(it.state_dict())
        it.close()
    with pytest.raises(ValueError, match="merge_states: state 1 was saved in epoch 2, state 0 "
                                         "in epoch 1"):
        merge_states(states)
    same = []
    for rank in (0, 1):
        it = pipe.iter(runner="inline", rank=rank, world_size=2, epoch=2)
        same.append(it.state_dict())
        it.close()
    assert merge_states(same)["epoch"] == 2


def test_a_state_is_finished_only_once_every_lane_has_ended() -> None:
    pipe = shuffled_items(12).batch(3)
    it = pipe.iter(runner="inline", epoch=1)
    total = len(collect(pipe, runner="inline"))
    [next(it) for _ in range(total)]  # every batch, before the iterator saw the end
    assert not state_finished(it.state_dict())
    assert list(it) == []
    assert state_finished(it.state_dict())


def test_epoch_counter_advances_on_each_start_unless_set() -> None:
    counter = EpochCounter()
    assert [counter.start(), counter.start(), counter.start()] == [0, 1, 2]
    counter.set_epoch(7)  # Lightning calls it before each epoch
    assert counter.epoch == 2 and counter.next_epoch == 7
    assert counter.start() == 7 and counter.epoch == 7
    counter.set_epoch(8)
    counter.set_epoch(8)  # twice (sampler and batch_sampler.sampler) changes nothing
    assert counter.start() == 8
    counter.load_state_dict({"epoch": 3})
    assert counter.start() == 3
    assert counter.state_dict() == {"epoch": 4}


def test_epoch_counter_resumes_a_state_in_its_epoch_or_goes_on_after_a_finished_one() -> None:
    pipe = shuffled_items(12).batch(3)
    it = pipe.iter(runner="inline", epoch=2)
    next(it)
    mid = it.state_dict()
    rest = list(it)
    done = it.state_dict()
    counter = EpochCounter()
    assert counter.resume(mid) is mid
    counter.set_epoch(2)  # what Lightning calls after restoring epoch 2
    assert counter.begin(mid) == 2
    resumed = pipe.iter(runner="inline", epoch=2)
    resumed.load_state_dict(mid)
    assert_same(rest, list(resumed))
    assert counter.resume(done) is None  # epoch 2 was over: the next one starts afresh
    assert counter.begin() == 3
    counter.resume(mid)
    counter.set_epoch(5)
    with pytest.raises(ValueError, match="the state was saved in epoch 2, but this iterator "
                                         "runs epoch 5"):
        counter.begin(mid)


def test_epochs_deliver_the_same_samples_from_files(corpus_dir: Any, tokenizer: Any) -> None:
    pipe = (zt.Pipeline.from_jsonl(str(corpus_dir / "code" / "*.jsonl"), num_lanes=2,
                                   chunk_size=8, seed=0)
            .fetch().decode_text().tokenize(tokenizer).shuffle(6, seed=1).batch(4, drop_last=False))
    runs = [collect(pipe, runner="inline", epoch=e) for e in (0, 1)]
    ids = [[r.meta.sample_id for b in run for r in b] for run in runs]
    assert ids[0] != ids[1]
    assert Counter(ids[0]) == Counter(ids[1])
