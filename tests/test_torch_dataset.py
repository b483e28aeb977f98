"""A pipeline inside torch's DataLoader and torchdata's StatefulDataLoader (real ones)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
stateful = pytest.importorskip("torchdata.stateful_dataloader")

from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

import zephon_torch as zt  # noqa: E402
from zephon_torch.torch import TorchIterableDataset, merged_state  # noqa: E402

StatefulDataLoader = stateful.StatefulDataLoader
# torchdata's own deprecation notice, and torch's advice on a 2-core CI machine.
pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create"),
]
NUM_DOCS = 64


def make_pipe(num_lanes: int = 4) -> zt.Pipeline:
    items = [{"text": f"doc {i}"} for i in range(NUM_DOCS)]
    return zt.Pipeline.from_items(items, num_lanes=num_lanes, chunk_size=4).shuffle(8).batch(2)


def ids(batch: Any) -> list[tuple[int, ...]]:
    return [r.meta.sample_id for r in batch]


def run_ids(iterable: Any) -> list[list[tuple[int, ...]]]:
    return [ids(batch) for batch in iterable]


@pytest.fixture(scope="module")
def pipe() -> zt.Pipeline:
    return make_pipe()


@pytest.fixture(scope="module")
def expected(pipe: zt.Pipeline) -> list[list[tuple[int, ...]]]:
    return run_ids(pipe.iter(runner="inline"))


def test_expected_stream_covers_every_document_once(expected: list[list[tuple]]) -> None:
    flat = [sid for batch in expected for sid in batch]
    assert len(flat) == NUM_DOCS == len(set(flat))


# ---------------------------------------------------------------- the virtual subclass


def test_pipeline_is_an_iterable_dataset_once_torch_is_imported(pipe: zt.Pipeline) -> None:
    assert isinstance(pipe, IterableDataset)
    assert issubclass(zt.Pipeline, IterableDataset)


@pytest.mark.parametrize("order", ["zephon_first", "torch_first"])
def test_registration_works_whichever_package_is_imported_first(order: str) -> None:
    first, second = ("zephon_torch", "torch") if order == "zephon_first" else ("torch",
                                                                              "zephon_torch")
    code = (
        f"import sys\nimport {first}\n"
        "alone = 'torch' in sys.modules\n"
        f"import {second}\n"
        "import zephon_torch as zt\n"
        "from torch.utils.data import IterableDataset\n"
        "pipe = zt.Pipeline.from_items(['a', 'b'], num_lanes=2, chunk_size=1)\n"
        "finders = [type(f).__name__ for f in sys.meta_path]\n"
        "print(alone, isinstance(pipe, IterableDataset), '_DatasetFinder' in finders)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    # zephon_torch alone pulls in no torch; torch alone obviously does.
    assert out == [str(order == "torch_first"), "True", "False"]


# ---------------------------------------------------------------- plain torch DataLoader


@pytest.mark.parametrize("num_workers", [0, 2])
def test_plain_dataloader_over_a_pipeline_matches_our_order(
        pipe: zt.Pipeline, expected: list[list[tuple]], num_workers: int) -> None:
    loader = DataLoader(pipe, batch_size=None, num_workers=num_workers)
    got = run_ids(loader)
    flat = [sid for batch in got for sid in batch]
    assert len(flat) == len(set(flat)) == NUM_DOCS  # no duplication, full coverage
    assert got == expected  # lanes produce equally here, so even the order is ours


def test_more_workers_than_lanes_leaves_the_extra_worker_idle() -> None:
    pipe = make_pipe(num_lanes=2)
    got = run_ids(DataLoader(pipe, batch_size=None, num_workers=3))
    assert got == run_ids(pipe.iter(runner="inline"))


def test_wrapper_in_workers_follows_the_rank(pipe: zt.Pipeline) -> None:
    dataset = pipe.to_torch_dataset(rank=1, world_size=2)
    got = run_ids(DataLoader(dataset, batch_size=None, num_workers=2))
    assert got == run_ids(pipe.iter(runner="inline", rank=1, world_size=2))
    assert {b.lane_ids[0] for b in pipe.iter(runner="inline", rank=1, world_size=2)} == {1, 3}


# ---------------------------------------------------------------- the explicit wrapper


def test_to_torch_dataset_returns_a_real_iterable_dataset(pipe: zt.Pipeline) -> None:
    dataset = pipe.to_torch_dataset(runner="inline")
    assert type(dataset) is TorchIterableDataset
    assert isinstance(dataset, IterableDataset)
    assert dataset.pipeline is pipe


def test_wrapper_resumes_outside_workers_with_the_thread_runner(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    dataset = pipe.to_torch_dataset(runner="threads", num_workers=2)
    it = iter(dataset)
    head = [ids(next(it)) for _ in range(5)]
    state = json.loads(json.dumps(dataset.state_dict()))
    dataset.close()
    fresh = pipe.to_torch_dataset(runner="threads", num_workers=2)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state  # before iterating: the state to resume from
    assert head + run_ids(fresh) == expected


def test_state_before_any_item_resumes_to_the_same_place(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    dataset = pipe.to_torch_dataset(runner="inline")
    it = iter(dataset)
    head = [ids(next(it)) for _ in range(6)]
    again = pipe.to_torch_dataset(runner="inline")
    again.load_state_dict(dataset.state_dict())
    iter(again)  # loaded, nothing delivered yet: the state must still be the position
    third = pipe.to_torch_dataset(runner="inline")
    third.load_state_dict(again.state_dict())
    assert head + run_ids(third) == expected


def test_wrapper_takes_per_worker_states_and_merges_them(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    states = []
    heads = []
    for lanes in ([0, 2], [1, 3]):
        it = pipe.iter(runner="inline", lanes=lanes)
        heads.append(run_ids(next(it) for _ in range(3)))
        states.append(it.state_dict())
    dataset = pipe.to_torch_dataset(runner="inline")
    dataset.load_state_dict(states)
    got = run_ids(dataset)
    flat = [sid for batch in heads[0] + heads[1] + got for sid in batch]
    assert sorted(flat) == sorted(sid for batch in expected for sid in batch)
    assert len(flat) == len(set(flat))


def test_wrapper_rejects_bad_arguments_and_states(pipe: zt.Pipeline) -> None:
    with pytest.raises(ValueError, match="unknown iter"):
        pipe.to_torch_dataset(batch_size=4)
    with pytest.raises(TypeError, match="Pipeline"):
        TorchIterableDataset([1, 2, 3])  # type: ignore[arg-type]
    dataset = pipe.to_torch_dataset()
    with pytest.raises(ValueError, match="not a pipeline state"):
        dataset.load_state_dict({"_snapshot": {}})
    other = make_pipe(num_lanes=2).iter(runner="inline").state_dict()
    dataset.load_state_dict(other)
    with pytest.raises(ValueError, match="different pipeline configuration"):
        iter(dataset)


def test_wrapper_pickles_without_its_live_iterator(pipe: zt.Pipeline) -> None:
    dataset = pipe.to_torch_dataset(runner="threads", num_workers=2)
    it = iter(dataset)
    next(it)
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone.state_dict()["lanes"].keys() == dataset.state_dict()["lanes"].keys()
    dataset.close()


# ---------------------------------------------------------------- one iteration at a time


def test_a_peek_inside_a_torch_loop_over_the_dataset_is_refused_and_the_loop_goes_on(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    ds = pipe.to_torch_dataset()
    loader = DataLoader(ds, batch_size=None)  # num_workers=0: iter(loader) calls iter(ds)
    got = []
    for i, batch in enumerate(loader):
        got.append(ids(batch))
        if i == 1:
            with pytest.raises(RuntimeError, match="one iteration at a time"):
                next(iter(loader))
            after_two = ds.state_dict()
    assert got == expected  # neither ended early nor restarted
    resumed = pipe.to_torch_dataset()
    resumed.load_state_dict(after_two)  # the position of the loop's two batches
    assert run_ids(DataLoader(resumed, batch_size=None)) == expected[2:]


def test_a_dataset_iterator_starts_once_the_one_in_progress_has_been_dropped(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    ds = pipe.to_torch_dataset()
    first = iter(ds)
    head = [ids(next(first)) for _ in range(3)]
    second = iter(ds)
    with pytest.raises(RuntimeError, match="iteration in progress"):
        next(second)
    assert ids(next(first)) == expected[3]  # the first goes on where it was
    assert head == expected[:3]
    del first  # dropped unfinished
    assert run_ids(second) == expected  # a new pass
    assert run_ids(ds) == expected  # after the end: another
    third, fourth = iter(ds), iter(ds)  # neither started: each is a pass of its own
    assert run_ids(third) == expected
    assert run_ids(fourth) == expected


def test_a_stateful_dataloader_started_over_after_a_break_saves_the_new_pass(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    loader = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    # StatefulDataLoader makes the new iterator (and calls iter(dataset)) while it still
    # holds the one left by the break: the state is nonetheless the new pass's start.
    it = iter(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    assert run_ids(it) == expected
    resumed = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None)
    resumed.load_state_dict(state)
    assert run_ids(resumed) == expected


# ---------------------------------------------------------------- StatefulDataLoader


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(
        pipe: zt.Pipeline, expected: list[list[tuple]], num_workers: int) -> None:
    total = len(expected)
    for k in (0, 3, 11, total - 1):
        loader = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None,
                                    num_workers=num_workers)
        it = iter(loader)
        head = [ids(next(it)) for _ in range(k)]
        # Through JSON, as a real checkpoint would carry it.
        state = json.loads(json.dumps(loader.state_dict()))
        del it, loader
        resumed = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None,
                                     num_workers=num_workers)
        resumed.load_state_dict(state)
        assert head + run_ids(resumed) == expected, f"saved after {k} batches"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_saves_right_after_a_restore(
        pipe: zt.Pipeline, expected: list[list[tuple]], num_workers: int) -> None:
    loader = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None,
                                num_workers=num_workers)
    it = iter(loader)
    head = [ids(next(it)) for _ in range(5)]
    state = loader.state_dict()
    del it, loader
    second = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None,
                                num_workers=num_workers)
    second.load_state_dict(state)
    it = iter(second)
    again = second.state_dict()  # restored, nothing taken yet
    del it, second
    third = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None,
                               num_workers=num_workers)
    third.load_state_dict(again)
    assert head + run_ids(third) == expected


def test_stateful_dataloader_with_an_idle_worker_resumes() -> None:
    pipe = make_pipe(num_lanes=2)
    expected = run_ids(pipe.iter(runner="inline"))
    loader = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None, num_workers=3)
    it = iter(loader)
    head = [ids(next(it)) for _ in range(7)]
    state = loader.state_dict()
    del it, loader
    resumed = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None, num_workers=3)
    resumed.load_state_dict(state)
    assert head + run_ids(resumed) == expected


def test_worker_states_merge_into_one_global_state(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    loader = StatefulDataLoader(pipe.to_torch_dataset(), batch_size=None, num_workers=2)
    it = iter(loader)
    head = [ids(next(it)) for _ in range(9)]
    state = merged_state(loader.state_dict())
    del it, loader
    assert sorted(state["lanes"]) == ["0", "1", "2", "3"]
    rest = pipe.iter(runner="inline")
    rest.load_state_dict(state)  # any consumer, any worker count
    assert head + run_ids(rest) == expected
    with pytest.raises(ValueError, match="no pipeline state"):
        merged_state({"_snapshot": {}})


def _epoch_ids(pipe: zt.Pipeline, epoch: int) -> list[list[tuple[int, ...]]]:
    return run_ids(pipe.iter(runner="inline", epoch=epoch))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_runs_that_epochs_order_as_hugging_faces_iterable_dataset_does(
        pipe: zt.Pipeline, num_workers: int) -> None:
    dataset = TorchIterableDataset(pipe)
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
    got = {}
    for epoch in (2, 1):
        dataset.set_epoch(epoch)
        got[epoch] = sorted(run_ids(loader))  # workers interleave: compare the batches
    assert got[2] == sorted(_epoch_ids(pipe, 2))
    assert got[1] == sorted(_epoch_ids(pipe, 1))
    assert got[1] != got[2]
    dataset.set_epoch(1)
    assert run_ids(dataset) == _epoch_ids(pipe, 1)  # in process: the epoch's exact order
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        dataset.set_epoch(-1)


def test_a_dataset_state_of_epoch_2_resumes_there_and_set_epoch_to_another_is_refused(
        pipe: zt.Pipeline) -> None:
    dataset = TorchIterableDataset(pipe)
    dataset.set_epoch(2)
    it = iter(dataset)
    head = [ids(next(it)) for _ in range(3)]
    state = dataset.state_dict()
    assert state["epoch"] == 2
    resumed = TorchIterableDataset(pipe)
    resumed.load_state_dict(state)
    assert head + run_ids(resumed) == _epoch_ids(pipe, 2)
    other = TorchIterableDataset(pipe)
    other.load_state_dict(state)
    other.set_epoch(3)
    with pytest.raises(ValueError, match="saved in epoch 2, but this iterator runs epoch 3"):
        iter(other)
