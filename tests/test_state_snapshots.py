"""The state kept after every batch, cheaply: ``PipelineIterator.state_snapshot()``.

``zephon_torch.DataLoader`` keeps a snapshot of the iterator's position after
every batch and builds the state dict only when ``state_dict()`` asks
(``runners/snapshots.py``). These tests hold a snapshot's ``state()`` to the
iterator's own ``state_dict()`` taken at the same moment, at every step, on
plans with and without flush sentinels, with tombstones, several ranks, lane
workers and a resumed run; and the loader's ``state_dict()`` at every step to
the inline iterator's after as many batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zephon_torch as zt
from zephon_torch.accounting import _closes, _count_epochs
from zephon_torch.block_views import BlockBatch
from zephon_torch.pipeline import Pipeline


def _items(n: int) -> list[dict[str, Any]]:
    return [{"input_ids": np.arange(i % 7 + 1, dtype=np.int32) + i, "text": f"doc {i}"}
            for i in range(n)]


def _drop_some(payload: dict[str, Any]) -> dict[str, Any] | None:
    return None if payload["text"].endswith("3") else payload


def _corpus(corpus_dir: Path, tokenizer: Any) -> Pipeline:
    return (Pipeline.from_jsonl(str(corpus_dir / "web" / "*"), num_lanes=4, chunk_size=16)
            .fetch().decode_text().tokenize(tokenizer).pack_flat(96, pad_token_id=0)
            .shuffle(8, seed=4).batch(2))


PIPES = {
    # flush sentinels (packing, shuffle), tombstones of empty documents
    "corpus": None,
    # no sentinels: each chunk is its own epoch, closed offset by offset
    "plain": lambda: Pipeline.from_items(_items(90), num_lanes=3, chunk_size=5),
    "plain-batches": lambda: Pipeline.from_items(_items(90), num_lanes=3,
                                                 chunk_size=5).batch(4),
    "tombstones": lambda: (Pipeline.from_items(_items(90), num_lanes=2, chunk_size=6)
                           .map_transform(_drop_some).batch(3)),
    "packed": lambda: (Pipeline.from_items(_items(150), num_lanes=4, chunk_size=8)
                       .pack_flat(16).batch(2)),
}


def _pipe(name: str, corpus_dir: Path, tokenizer: Any) -> Pipeline:
    return _corpus(corpus_dir, tokenizer) if name == "corpus" else PIPES[name]()


def _every_step(it: Any, stride: int = 1) -> int:
    """Check snapshots against ``state_dict()`` (every ``stride`` steps); steps taken."""
    kept = [(it.state_snapshot(), it.state_dict())]
    steps = 0
    for _ in it:
        steps += 1
        if steps % stride:
            continue
        snapshot = it.state_snapshot()
        now = it.state_dict()
        assert snapshot.state() == now, f"step {steps}"
        kept.append((snapshot, now))
    end = it.state_snapshot()
    kept.append((end, it.state_dict()))
    # A snapshot keeps its own moment whatever came after, and each state() is a fresh
    # dict that the caller may edit.
    for snapshot, state in kept:
        got = snapshot.state()
        assert got == state
        json.dumps(got)
        for entry in got["lanes"].values():
            entry["window"].append([99, 0])
            entry["outputs"] = -1
        got["lanes"].clear()
        assert snapshot.state() == state
    return steps


@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("name", list(PIPES))
def test_a_snapshot_is_the_state_dict_of_its_moment(name: str, stride: int, corpus_dir: Path,
                                                     tokenizer: Any) -> None:
    pipe = _pipe(name, corpus_dir, tokenizer)
    assert _every_step(pipe.iter(runner="inline"), stride) > 5


@pytest.mark.parametrize("name", ["corpus", "plain", "tombstones"])
def test_snapshots_of_a_resumed_run_and_of_each_rank(name: str, corpus_dir: Path,
                                                    tokenizer: Any) -> None:
    pipe = _pipe(name, corpus_dir, tokenizer)
    head = pipe.iter(runner="inline")
    for _ in range(7):
        next(head)
    state = json.loads(json.dumps(head.state_dict()))
    head.close()
    resumed = pipe.iter(runner="inline")
    resumed.load_state_dict(state)
    assert resumed.state_snapshot().state() == resumed.state_dict() == state
    _every_step(resumed)  # its lanes replay first: the loaded entries, then new ones
    for rank in (0, 1):
        _every_step(pipe.iter(runner="inline", rank=rank, world_size=2))


def test_snapshots_under_lane_workers(corpus_dir: Path, tokenizer: Any) -> None:
    it = _corpus(corpus_dir, tokenizer).iter(runner="lanes", num_workers=2)
    try:
        assert _every_step(it) > 5
    finally:
        it.close()


@pytest.mark.parametrize("name", list(PIPES))
def test_the_loaders_state_at_every_step_is_the_iterators(name: str, corpus_dir: Path,
                                                         tokenizer: Any) -> None:
    pipe = _pipe(name, corpus_dir, tokenizer)
    reference = pipe.iter(runner="inline")
    loader = zt.DataLoader(pipe, num_workers=0, to_training=False)
    want = [reference.state_dict()]
    got = [loader.state_dict()]
    for _ in zip(loader, reference):
        got.append(loader.state_dict())
        want.append(reference.state_dict())
    assert len(got) > 5
    assert got == want


def test_a_blocks_closes_and_epochs_count_as_their_rows_do(corpus_dir: Path,
                                                           tokenizer: Any) -> None:
    blocks = 0
    for name in ("corpus", "packed"):
        for item in _pipe(name, corpus_dir, tokenizer).iter(runner="inline"):
            if type(item) is not BlockBatch:
                continue
            block = item.block
            assert _closes(block) == int(block.close_counts().sum())
            blocks += block.contributors is not None
    assert blocks > 5
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, 40, size=int(rng.integers(1, 150)))
        if rng.random() < 0.5:
            ids = np.full(len(ids), ids[0])
        k = int(rng.integers(0, 9))
        got: dict[int, int] = {3: 1}
        _count_epochs(got, ids, k)
        want: dict[int, int] = {3: 1}
        for chunk in ids.tolist():
            epoch = chunk // k if k else chunk
            want[epoch] = want.get(epoch, 0) + 1
        assert got == want
