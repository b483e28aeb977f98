"""States that cannot be exact are refused loudly; states taken from another thread are exact.

Issue 13, items 5, 10 and part of 12: ``deterministic=False`` cannot
checkpoint (and every wrapper that snapshots per batch still iterates), a
``state_dict()`` from a checkpoint thread is a consistent position, and the
errors about lane keys and changed operators say what is wrong.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from harness import assert_same, collect

import zephon_torch as zt
from zephon_torch.checkpoint import NotCheckpointableError, merge_states, state_checksum
from zephon_torch.pipeline import Pipeline


def items_pipe(n: int = 80, **config: Any) -> Pipeline:
    config.setdefault("num_lanes", 3)
    config.setdefault("chunk_size", 4)
    texts = [f"doc {i} " + "word " * (i % 9) for i in range(n)]
    return zt.Pipeline.from_items(texts, **config)


def token_pipe(n: int = 96) -> Pipeline:
    items = [{"input_ids": np.arange(i % 50, i % 50 + 9, dtype=np.int32)} for i in range(n)]
    return (zt.Pipeline.from_items(items, num_lanes=4, chunk_size=4)
            .shuffle(8, seed=1).batch(2))


def resealed(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its checksum recomputed (an edit that the checksum cannot catch)."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return {**body, "checksum": state_checksum(body)}


def saved_state(pipe: Pipeline, steps: int = 3) -> dict[str, Any]:
    with pipe.iter(runner="inline") as it:
        for _ in range(steps):
            next(it)
        return it.state_dict()


def ids(batch: Any) -> list[tuple[int, ...]]:
    if isinstance(batch, dict):  # a to_training dict
        return [tuple(int(i) for i in sid) for sid in batch["ids"]]
    return [tuple(r.meta.sample_id) for r in batch]


# ---------------------------------------------------------------- deterministic=False (item 5)


def test_state_dict_of_a_non_deterministic_iterator_is_refused_with_the_reason() -> None:
    pipe = items_pipe().shuffle(8, seed=3).batch(2)
    with pipe.iter(runner="threads", num_workers=2, deterministic=False) as it:
        assert not it.checkpointable
        next(it)
        with pytest.raises(NotCheckpointableError,
                           match=r"deterministic=False.*completion order.*deterministic=True"):
            it.state_dict()
        rest = list(it)  # refusing a state does not disturb the iteration
    assert len(rest) == 39  # 80 documents in batches of 2, one taken before


def test_a_state_records_its_mode_and_a_non_deterministic_iterator_will_not_resume_it() -> None:
    pipe = items_pipe().shuffle(8, seed=3).batch(2)
    state = saved_state(pipe)
    assert state["deterministic"] is True
    with pipe.iter(runner="inline", deterministic=False) as it, \
            pytest.raises(NotCheckpointableError, match=r"deterministic=True"):
        it.load_state_dict(state)


def test_a_state_marked_non_deterministic_is_refused_on_load_and_on_merge() -> None:
    pipe = items_pipe().shuffle(8, seed=3).batch(2)
    state = resealed({**saved_state(pipe), "deterministic": False})
    with pipe.iter(runner="inline") as it, \
            pytest.raises(ValueError, match=r"deterministic=False.*cannot be resumed"):
        it.load_state_dict(state)
    with pytest.raises(ValueError, match=r"deterministic=False"):
        merge_states([state])


def test_a_state_without_the_mode_still_loads_as_deterministic() -> None:
    # States written before the mode was recorded came from deterministic iterators.
    pipe = items_pipe().shuffle(8, seed=3).batch(2)
    reference = collect(pipe, runner="inline")
    old = resealed({k: v for k, v in saved_state(pipe, 5).items() if k != "deterministic"})
    with pipe.iter(runner="inline") as it:
        it.load_state_dict(old)
        assert_same(reference[5:], list(it))


def test_a_non_deterministic_loader_iterates_and_refuses_its_state_dict() -> None:
    pytest.importorskip("torch")
    from zephon_torch.torch.loader import DataLoader

    pipe = token_pipe()
    loader = DataLoader(pipe, in_process=True, runner="threads", num_workers=2,
                        deterministic=False, to_training=False)
    assert not loader.checkpointable
    seen = sorted(sid for batch in loader for sid in ids(batch))
    assert seen == sorted(sid for b in collect(pipe, runner="inline") for sid in ids(b))
    with pytest.raises(NotCheckpointableError, match="deterministic=False"):
        loader.state_dict()
    with pytest.raises(NotCheckpointableError, match="deterministic=True"):
        loader.load_state_dict(saved_state(pipe))


def test_a_non_deterministic_lightning_stream_iterates_and_its_module_refuses_a_state() -> None:
    pytest.importorskip("lightning")
    from zephon_torch.lightning import ZephonDataModule

    pipe = token_pipe()
    module = ZephonDataModule(pipe, loader_kwargs={
        "in_process": True, "deterministic": False, "to_training": False})
    batches = list(module.train_dataloader())
    assert len(batches) == 48
    with pytest.raises(NotCheckpointableError, match="deterministic=False"):
        module.state_dict()


def test_a_non_deterministic_torchdata_node_iterates_under_a_prefetcher() -> None:
    nodes = pytest.importorskip("torchdata.nodes")
    from zephon_torch.torch import PipelineNode

    pipe = token_pipe()
    # The prefetcher snapshots its source's state with every item it buffers.
    loader = nodes.Loader(nodes.Prefetcher(
        PipelineNode(pipe, runner="threads", num_workers=2, deterministic=False), 3))
    with pytest.warns(RuntimeWarning, match=r"deterministic=False.*record only the mode"):
        it = iter(loader)
        head = [next(it) for _ in range(5)]
        state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint holds
        rest = list(it)
    assert len(head) + len(rest) == 48
    restored = nodes.Loader(nodes.Prefetcher(PipelineNode(pipe, runner="inline"), 3))
    with pytest.raises(ValueError, match=r"deterministic=False.*cannot be resumed"):
        restored.load_state_dict(state)
        next(iter(restored))


def test_a_non_deterministic_stateful_dataloader_iterates_with_workers() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from zephon_torch.torch.dataset import merged_state

    pipe = token_pipe()
    # Each worker snapshots the dataset's state after every batch it makes.
    loader = stateful.StatefulDataLoader(
        pipe.to_torch_dataset(deterministic=False), batch_size=None, num_workers=2)
    seen = sorted(sid for batch in loader for sid in ids(batch))
    assert len(seen) == 96
    with pytest.raises(ValueError, match=r"deterministic=False.*cannot be resumed"):
        merged_state(loader.state_dict())


# ---------------------------------------------------------------- state_dict() from a thread (10)


def test_state_dict_from_another_thread_is_an_exact_position_while_iterating() -> None:
    pipe = items_pipe(1200, num_lanes=4, chunk_size=6, flush_every_k_chunks=2)
    pipe = pipe.shuffle(8, seed=5).batch(3)
    reference = collect(pipe, runner="inline")
    states: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            try:
                states.append(it.state_dict())
            except BaseException as exc:  # the test reports every failure
                errors.append(exc)

    it = pipe.iter(runner="threads", num_workers=2)
    thread = threading.Thread(target=hammer)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: every interleaving gets its chance
    thread.start()
    try:
        out = list(it)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
        it.close()
    assert not errors, f"{len(errors)} of {len(errors) + len(states)} calls failed: {errors[0]!r}"
    assert_same(reference, out, "the iteration itself")
    # A state is the position after some item handed over: sum of per-lane outputs.
    positions = {sum(e["outputs"] for e in s["lanes"].values()): s for s in states}
    assert len(positions) > 3, f"too few distinct positions to test: {sorted(positions)}"
    keys = sorted(positions)
    picked = {keys[round(i * (len(keys) - 1) / 5)] for i in range(6)}
    for position in sorted(picked):
        with pipe.iter(runner="inline") as resumed:
            resumed.load_state_dict(json.loads(json.dumps(positions[position])))
            assert_same(reference[position:], list(resumed), f"resumed at {position}")


# ---------------------------------------------------------------- messages (item 12)


def test_integer_lane_keys_are_named_as_the_problem() -> None:
    pipe = items_pipe(num_lanes=4).batch(2)
    state = saved_state(pipe)
    as_ints = {**state, "lanes": {int(k): v for k, v in state["lanes"].items()}}
    with pipe.iter(runner="inline") as it, \
            pytest.raises(ValueError, match=r"lane keys must be strings.*\[0, 1, 2, 3\]"):
        it.load_state_dict(as_ints)


def test_mixed_lane_keys_are_a_clear_error_not_a_sorting_crash() -> None:
    pipe = items_pipe(num_lanes=4).batch(2)
    state = saved_state(pipe)
    lanes = dict(state["lanes"])
    lanes[0] = lanes.pop("0")
    mixed = {**state, "lanes": lanes}
    with pytest.raises(ValueError, match=r"lane keys must be strings.*\[0\]"):
        state_checksum(mixed)
    with pipe.iter(runner="inline") as it, \
            pytest.raises(ValueError, match=r"lane keys must be strings"):
        it.load_state_dict(mixed)
    with pytest.raises(ValueError, match=r"lane keys must be strings"):
        merge_states([mixed])


def test_a_changed_operator_is_named_with_the_parameter_and_both_values() -> None:
    # Issue 23 lets a resume change a shuffle's buffer_size (from each lane's next
    # epoch) and batch's drop_last (after the cursor), which this test once used;
    # the shuffle's seed and algorithm still rewrite the past and are refused.
    state = saved_state(items_pipe().shuffle(8, seed=3).batch(2))
    with items_pipe().shuffle(8, seed=4).batch(2).iter(runner="inline") as it, \
            pytest.raises(ValueError, match=r"ops\[0\] shuffle \(seed 3 -> 4\)"):
        it.load_state_dict(state)
    with items_pipe().shuffle(16, seed=3, algorithm="block").batch(2).iter(
            runner="inline") as it, \
            pytest.raises(ValueError, match=r'ops\[0\] shuffle \(algorithm "streaming" -> '
                                            r'"block", buffer_size 8 -> 16\)'):
        it.load_state_dict(state)


def test_a_replaced_or_added_operator_is_named() -> None:
    state = saved_state(items_pipe().shuffle(8, seed=3).batch(2))
    with items_pipe().batch(2).iter(runner="inline") as it, \
            pytest.raises(ValueError, match=r"ops\[0\] batch \(the operator was shuffle\)"):
        it.load_state_dict(state)
    longer = items_pipe().shuffle(8, seed=3).batch(2).map_transform(dict)
    with longer.iter(runner="inline") as it, \
            pytest.raises(ValueError, match=r"ops\[2\] map_transform \(not in the state's"):
        it.load_state_dict(state)


def _slowly(payload: Any) -> Any:
    time.sleep(0.002)  # a stage that keeps next() waiting on its workers, lock held
    return payload


def test_a_state_asked_from_another_thread_waits_for_one_item_at_most() -> None:
    # The iterating thread never pauses between items, so a plain lock (released and
    # taken again at once) would let it run on and starve the checkpoint thread.
    pipe = items_pipe(400, num_lanes=2, chunk_size=4).map_transform(_slowly)
    it = pipe.iter(runner="threads", num_workers=1, microbatch_sizes={"map_transform": 1})
    handed = [0]
    waits: list[int] = []
    done = threading.Event()

    def checkpoint() -> None:
        while not done.is_set() and len(waits) < 20:
            asked = handed[0]
            state = it.state_dict()
            waits.append(sum(e["outputs"] for e in state["lanes"].values()) - asked)

    thread = threading.Thread(target=checkpoint)
    thread.start()
    try:
        for _ in it:
            handed[0] += 1
    finally:
        done.set()
        thread.join()
        it.close()
    assert waits, "the checkpoint thread never got a state"
    assert max(waits) <= 2, f"a state waited for up to {max(waits)} items: {waits}"
