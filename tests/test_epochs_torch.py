"""Epochs, ``len()`` and ``stats()`` of ``zephon_torch.DataLoader`` and the torch wrappers.

Every order is compared with the core's ``pipe.iter(runner="inline", epoch=n)``,
the definition of epoch ``n`` (``docs/epochs.md``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import zephon_torch as zt
from zephon_torch.epochs import EpochCounter
from zephon_torch.logs import metrics
from zephon_torch.torch.loader import DataLoader

pytestmark = pytest.mark.timeout(120)


def _pipe(n: int = 48, num_lanes: int = 4) -> zt.Pipeline:
    items = [{"input_ids": np.arange(i, i + 5, dtype=np.int32), "text": f"doc {i}"}
             for i in range(n)]
    return (zt.Pipeline.from_items(items, num_lanes=num_lanes, chunk_size=4)
            .shuffle(8, seed=3).batch(2))


def _ids(batches: Any) -> list[list[Any]]:
    return [list(b["ids"]) for b in batches]


def _epoch(pipe: zt.Pipeline, epoch: int) -> list[list[Any]]:
    return _ids(b.to_training() for b in pipe.iter(runner="inline", epoch=epoch))


MODES = {"inline": {}, "lanes": {"num_workers": 2},
         "engine": {"num_workers": 1, "runner": "process"}}


@pytest.mark.parametrize("mode", list(MODES))
def test_each_iteration_of_the_loader_runs_the_next_epoch_in_its_own_reproducible_order(
        mode: str) -> None:
    pipe = _pipe()
    loader = DataLoader(pipe, **MODES[mode])
    got = [_ids(loader) for _ in range(3)]
    assert got == [_epoch(pipe, e) for e in range(3)]
    assert len({str(order) for order in got}) == 3
    assert _ids(DataLoader(pipe)) == got[0]  # a new loader starts at epoch 0 again


def test_set_epoch_where_lightning_calls_it_chooses_the_next_iterations_epoch() -> None:
    pipe = _pipe()
    loader = DataLoader(pipe)
    assert isinstance(loader.sampler, EpochCounter)
    assert loader.batch_sampler.sampler is loader.sampler
    loader.batch_sampler.sampler.set_epoch(2)
    assert _ids(loader) == _epoch(pipe, 2)
    loader.sampler.set_epoch(1)
    assert _ids(loader) == _epoch(pipe, 1)
    loader.set_epoch(1)  # the same epoch again: the same order
    assert _ids(loader) == _epoch(pipe, 1)
    assert loader.epoch == 1
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        loader.set_epoch(-1)


def test_the_loader_still_refuses_sampler_and_batch_sampler_arguments() -> None:
    for name in ("sampler", "batch_sampler"):
        with pytest.raises(TypeError, match=f"takes no '{name}'"):
            DataLoader(_pipe(), **{name: None})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_mid_epoch_2_resumes_exactly_there(num_workers: int) -> None:
    pipe = _pipe()
    loader = DataLoader(pipe, num_workers=num_workers)
    for _ in range(2):
        _ids(loader)
    seen = []
    for batch in loader:  # epoch 2
        seen.append(list(batch["ids"]))
        if len(seen) == 5:
            break
    state = loader.state_dict()
    assert state["epoch"] == 2
    resumed = DataLoader(pipe, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert resumed.epoch == 2
    assert seen + _ids(resumed) == _epoch(pipe, 2)
    assert _ids(resumed) == _epoch(pipe, 3)  # and on into the next epoch


def test_a_state_saved_at_the_end_of_an_epoch_starts_the_next_epoch_afresh() -> None:
    pipe = _pipe()
    loader = DataLoader(pipe)
    _ids(loader)
    _ids(loader)
    state = loader.state_dict()  # the end of epoch 1
    assert state["epoch"] == 1
    resumed = DataLoader(pipe)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["epoch"] == 2
    assert _ids(resumed) == _epoch(pipe, 2)


def test_set_epoch_to_another_epoch_than_a_loaded_states_is_refused() -> None:
    pipe = _pipe()
    loader = DataLoader(pipe, epoch=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    resumed = DataLoader(pipe)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)
    with pytest.raises(ValueError, match="saved in epoch 1, but this iterator runs epoch 3"):
        next(iter(resumed))


def test_len_is_the_number_of_batches_the_rank_gets() -> None:
    pipe = (zt.Pipeline.from_items([{"input_ids": np.arange(3, dtype=np.int32)}] * 50,
                                   num_lanes=4, chunk_size=4).shuffle(8).batch(3, drop_last=False))
    for rank in (0, 1):
        loader = DataLoader(pipe, rank=rank, world_size=2)
        assert len(loader) == len(list(loader)) == pipe.num_batches(rank=rank, world_size=2)
    assert len(DataLoader(pipe)) == 17


def test_len_raises_type_error_naming_why_the_count_depends_on_the_data() -> None:
    pipe = zt.Pipeline.from_items(["a b c"] * 10).map_transform(lambda p: p).batch(2)
    loader = DataLoader(pipe, to_training=False)
    with pytest.raises(TypeError, match="map_transform may drop, merge or hold back records"):
        len(loader)
    with pytest.raises(TypeError):  # what torch's and Lightning's has_len catch
        len(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stats_describe_the_loaders_iteration(num_workers: int) -> None:
    pipe = _pipe()
    loader = DataLoader(pipe, num_workers=num_workers)
    with pytest.raises(RuntimeError, match="has not started an iteration yet"):
        loader.stats()
    _ids(loader)
    stats = loader.stats()
    assert stats["epoch"] == 0
    assert stats["throughput"]["outputs"] == 24
    assert stats["delivered"] == 48
    flat = metrics(stats)
    assert flat["data/epoch"] == 0.0
    _ids(loader)
    assert loader.stats()["epoch"] == 1


def test_stats_of_an_engine_process_say_where_they_are_not() -> None:
    loader = DataLoader(_pipe(), num_workers=1, runner="process")
    next(iter(loader))
    with pytest.raises(RuntimeError, match="in an engine process"):
        loader.stats()
    loader.close()

