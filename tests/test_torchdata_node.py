"""PipelineNode inside real torchdata.nodes graphs: save and restore at several points."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nodes = pytest.importorskip("torchdata.nodes")

import zephon_torch as zt  # noqa: E402
from zephon_torch.torch import PipelineNode  # noqa: E402

NUM_DOCS = 64


def make_pipe() -> zt.Pipeline:
    items = [{"input_ids": np.arange(i, i + 6, dtype=np.int32)} for i in range(NUM_DOCS)]
    return zt.Pipeline.from_items(items, num_lanes=4, chunk_size=4).shuffle(8).batch(2)


def ids(batch: Any) -> list[tuple[int, ...]]:
    if isinstance(batch, dict):  # a to_training dict
        return [tuple(sid) for sid in batch["ids"]]
    return [r.meta.sample_id for r in batch]


@pytest.fixture(scope="module")
def pipe() -> zt.Pipeline:
    return make_pipe()


@pytest.fixture(scope="module")
def expected(pipe: zt.Pipeline) -> list[list[tuple]]:
    return [ids(b) for b in pipe.iter(runner="inline")]


def plain(pipe: zt.Pipeline) -> Any:
    return PipelineNode(pipe, runner="inline")


def mapped_prefetched(pipe: zt.Pipeline) -> Any:
    node = PipelineNode(pipe, runner="threads", num_workers=2)
    node = nodes.Mapper(node, lambda batch: batch.to_training(return_labels=True))
    return nodes.Prefetcher(node, prefetch_factor=3)


def check_restores(pipe: zt.Pipeline, expected: list[list[tuple]],
                   build: Callable[[zt.Pipeline], Any], points: list[int]) -> None:
    for k in points:
        loader = nodes.Loader(build(pipe))
        it = iter(loader)
        head = [ids(next(it)) for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint carries it
        restored = nodes.Loader(build(pipe))
        restored.load_state_dict(state)
        assert head + [ids(b) for b in restored] == expected, f"saved after {k} items"


def test_loader_over_the_node_yields_the_pipeline_stream(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    assert [ids(b) for b in nodes.Loader(plain(pipe))] == expected
    # A second epoch starts over, as torchdata's Loader resets its root.
    loader = nodes.Loader(plain(pipe))
    assert [ids(b) for b in loader] == [ids(b) for b in loader] == expected


def test_node_restores_exactly_at_several_points(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    check_restores(pipe, expected, plain, [0, 1, 6, 17, len(expected) - 1])


def test_node_under_mapper_and_prefetcher_restores_exactly(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    check_restores(pipe, expected, mapped_prefetched, [0, 4, 13, len(expected) - 2])


def test_node_state_is_a_pipeline_state(pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    node = plain(pipe)
    head = [ids(next(node)) for _ in range(7)]
    state = node.state_dict()
    it = pipe.iter(runner="inline")
    it.load_state_dict(state)  # the node's state loads anywhere a pipeline state does
    assert head + [ids(b) for b in it] == expected


def test_reset_with_a_state_then_save_before_moving(
        pipe: zt.Pipeline, expected: list[list[tuple]]) -> None:
    node = plain(pipe)
    head = [ids(next(node)) for _ in range(5)]
    other = plain(pipe)
    other.reset(node.state_dict())
    again = plain(pipe)
    again.reset(other.state_dict())  # nothing taken since the reset: same position
    assert head + [ids(b) for b in again] == expected
    node.close()
    other.close()


def test_node_rejects_bad_arguments_and_states(pipe: zt.Pipeline) -> None:
    with pytest.raises(ValueError, match="unknown iter"):
        PipelineNode(pipe, prefetch=2)
    with pytest.raises(TypeError, match="Pipeline"):
        PipelineNode(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pipeline state"):
        plain(pipe).reset({"root": {}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PinMemory needs CUDA")
def test_pin_memory_node_restores_exactly(pipe: zt.Pipeline,
                                          expected: list[list[tuple]]) -> None:
    def build(p: zt.Pipeline) -> Any:
        node = PipelineNode(p, runner="threads", num_workers=2)
        node = nodes.Mapper(node, lambda batch: batch.to_training(return_labels=True))
        return nodes.PinMemory(node)

    first = next(iter(nodes.Loader(build(pipe))))
    assert first["input_ids"].is_pinned()
    check_restores(pipe, expected, build, [0, 9])


def test_a_node_runs_the_epoch_its_iter_kwargs_name_and_resumes_in_it(pipe: zt.Pipeline) -> None:
    want = [ids(b) for b in pipe.iter(runner="inline", epoch=2)]
    assert want != [ids(b) for b in pipe.iter(runner="inline")]
    loader = nodes.Loader(zt.torch.PipelineNode(pipe, runner="inline", epoch=2))
    it = iter(loader)
    head = [ids(next(it)) for _ in range(3)]
    state = loader.state_dict()
    restored = nodes.Loader(zt.torch.PipelineNode(pipe, runner="inline"))
    restored.load_state_dict(state)  # no epoch=: the state's
    assert head + [ids(b) for b in restored] == want
