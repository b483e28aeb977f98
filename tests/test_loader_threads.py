"""One iteration at a time, under threads: two starts at the same moment, one runs.

``zephon_torch.DataLoader`` and ``TorchIterableDataset`` hold one position,
so a second iteration that starts while one is in progress is refused with
a ``RuntimeError``. These tests start two at the same moment, from two real
threads released by a barrier, many times over: exactly one runs (the whole
epoch 0, from its first batch), the other is refused, and the epoch advances
once.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import zephon_torch as zt
from zephon_torch.torch.loader import DataLoader

ROUNDS = 50


def _pipe() -> zt.Pipeline:
    return zt.Pipeline.from_items([f"d{i}" for i in range(24)], num_lanes=4, chunk_size=3,
                                  shuffle=True, seed=5).batch(2)


def _ids(batches: Any) -> list[Any]:
    return [batch.ids for batch in batches]


def _reference(epoch: int) -> list[Any]:
    return _ids(_pipe().iter(runner="inline", epoch=epoch))


def _race(iterable: Any, iter_first: bool) -> list[tuple[str, Any, Any]]:
    """Two threads start ``iterable`` at once; per thread ("batch", batch, iterator) or
    ("refused", error, iterator)."""
    barrier = threading.Barrier(2)
    results: list[Any] = [None, None]

    def start(i: int) -> None:
        it = iter(iterable) if iter_first else None
        barrier.wait()
        if it is None:
            it = iter(iterable)
        try:
            results[i] = ("batch", next(it), it)
        except RuntimeError as exc:
            results[i] = ("refused", exc, it)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    return results


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_threads_starting_one_loader_at_once_run_it_once(num_workers):
    want = [_reference(0), _reference(1)]
    for round_ in range(ROUNDS):
        loader = DataLoader(_pipe(), num_workers=num_workers, to_training=False)
        try:
            results = _race(loader, iter_first=round_ % 2 == 0)
            assert sorted(r[0] for r in results) == ["batch", "refused"], results
            (won,) = [r for r in results if r[0] == "batch"]
            (lost,) = [r for r in results if r[0] == "refused"]
            assert "one iteration at a time" in str(lost[1])
            # The winner runs epoch 0 whole, from its first batch; the epoch advanced once.
            assert _ids([won[1], *won[2]]) == want[0]
            assert loader.state_dict()["epoch"] == 0
            assert _ids(loader) == want[1]
        finally:
            loader.close()


def test_next_on_one_loader_iterator_from_a_second_thread_meanwhile_is_refused():
    started, release = threading.Event(), threading.Event()

    def slow(payload: dict[str, str]) -> dict[str, str]:
        if payload["text"] == "d0":  # the first document: hold the first batch back
            started.set()
            release.wait(30)
        return payload

    pipe = zt.Pipeline.from_items([f"d{i}" for i in range(8)], num_lanes=2, chunk_size=2)
    loader = DataLoader(pipe.map_transform(slow).batch(2), to_training=False)
    it = iter(loader)
    first: list[Any] = []
    thread = threading.Thread(target=lambda: first.append(next(it)))
    thread.start()
    assert started.wait(30)  # the first thread is inside next(), waiting for its batch
    with pytest.raises(RuntimeError, match="another thread is in next"):
        next(it)
    release.set()
    thread.join(30)
    want = _ids(pipe.batch(2).iter(runner="inline"))
    assert _ids(first + list(it)) == want  # nothing taken, nothing skipped
    loader.close()


def test_two_threads_starting_one_torch_dataset_at_once_run_it_once():
    want = _reference(0)
    for round_ in range(ROUNDS):
        dataset = _pipe().to_torch_dataset(runner="inline")
        try:
            results = _race(dataset, iter_first=round_ % 2 == 0)
            assert sorted(r[0] for r in results) == ["batch", "refused"], results
            (won,) = [r for r in results if r[0] == "batch"]
            (lost,) = [r for r in results if r[0] == "refused"]
            assert "one iteration at a time" in str(lost[1])
            assert _ids([won[1], *won[2]]) == want
        finally:
            dataset.close()
