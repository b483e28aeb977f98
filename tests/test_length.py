"""Pipeline.num_batches: exact where it is known without reading the data, else None."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from harness import collect

import zephon_torch as zt
from zephon_torch.length import unknown_reason


def items(n: int, **config: Any) -> zt.Pipeline:
    return zt.Pipeline.from_items([f"doc {i}" for i in range(n)], **config)


def delivered(pipe: zt.Pipeline, **kwargs: Any) -> int:
    return len(collect(pipe, runner="inline", **kwargs))


CASES = list(itertools.product(
    (1, 7, 50, 103),           # items
    (1, 3),                    # num_lanes
    (4, 16),                   # chunk_size
    (1, 5),                    # batch size
    (True, False),             # drop_last
    (None, 1, 3),              # flush_every_k_chunks
))


@pytest.mark.parametrize(("n", "lanes", "chunk", "size", "drop_last", "flush"), CASES)
def test_the_count_is_what_iteration_delivers_on_every_rank(
        n: int, lanes: int, chunk: int, size: int, drop_last: bool, flush: int | None) -> None:
    pipe = (items(n, num_lanes=lanes, chunk_size=chunk, shuffle=True, seed=3,
                  flush_every_k_chunks=flush)
            .shuffle(6, seed=1).batch(size, drop_last=drop_last))
    assert pipe.num_batches(rank=0, world_size=1) == delivered(pipe)
    if lanes > 1:
        for rank in range(2):
            count = pipe.num_batches(rank=rank, world_size=2)
            assert count == delivered(pipe, rank=rank, world_size=2)
    # the same in another epoch: epochs reorder, they do not change what a lane reads
    assert pipe.num_batches(rank=0, world_size=1) == delivered(pipe, epoch=3)


def test_records_without_batch_passes_and_mixtures_are_counted_exactly() -> None:
    pipe = items(23, num_lanes=4, chunk_size=3, passes=3).shuffle(5)
    assert pipe.num_batches(rank=0, world_size=1) == delivered(pipe) == 69
    a = zt.sources.items([f"a{i}" for i in range(40)], component_id=0, name="a")
    b = zt.sources.items([f"b{i}" for i in range(7)], component_id=1, name="b")
    for exhausted in ("repeat", "stop"):
        mix = zt.Pipeline.from_sources([a, b], {0: 0.7, 1: 0.3}, num_lanes=3, chunk_size=5,
                                       exhausted=exhausted).batch(4, drop_last=False)
        for world in (1, 3):
            for rank in range(world):
                assert (mix.num_batches(rank=rank, world_size=world)
                        == delivered(mix, rank=rank, world_size=world)), (exhausted, rank)


def test_a_parquet_source_of_token_arrays_is_counted_from_its_metadata(
        corpus_dir: Path) -> None:
    pipe = (zt.Pipeline.from_parquet(str(corpus_dir / "tokens" / "*.parquet"), num_lanes=4,
                                     chunk_size=16, seed=0)
            .fetch().shuffle(8).batch(3))
    assert pipe.num_batches(rank=1, world_size=2) == delivered(pipe, rank=1, world_size=2)


def test_in_memory_items_tokenized_are_counted(tokenizer: Any) -> None:
    pipe = items(40, num_lanes=2, chunk_size=8).decode_text().tokenize(tokenizer).batch(3)
    assert pipe.num_batches(rank=0, world_size=1) == delivered(pipe)


@pytest.mark.parametrize(("build", "why"), [
    (lambda c, t: items(10).filter(lambda p: True).batch(2), "filter may drop"),
    (lambda c, t: items(10).map_transform(lambda p: p).batch(2), "map_transform may drop"),
    (lambda c, t: items(10).tokenize(t).pack_flat(16).batch(2), "pack_flat may drop"),
    (lambda c, t: items(10).batch(2).shuffle(16), "batch is followed by other stages"),
    (lambda c, t: items(10, passes=None).batch(2), "repeats forever"),
    (lambda c, t: zt.Pipeline.from_items(["a", "", "b"]).batch(1),
     "holds empty texts"),
    (lambda c, t: zt.Pipeline.from_items([{"text": "a", "m": " "}]).decode_text("m"),
     "holds empty texts"),
    (lambda c, t: zt.Pipeline.from_items(["a"], on_error="skip").batch(1),
     "on_error='skip'"),
    (lambda c, t: items(10).tokenize(t, on_error="skip"), "tokenize has on_error='skip'"),
    (lambda c, t: zt.Pipeline.from_jsonl(str(c / "code" / "*.jsonl")).fetch().decode_text(),
     "decode_text turns empty documents of files"),
    (lambda c, t: zt.Pipeline.from_jsonl(str(c / "web" / "*.jsonl.gz")).fetch(),
     "is read as a stream"),
])
def test_a_count_that_depends_on_the_data_is_none_with_a_reason(
        build: Any, why: str, corpus_dir: Path, tokenizer: Any) -> None:
    pipe = build(corpus_dir, tokenizer)
    assert pipe.num_batches(rank=0, world_size=1) is None
    assert why in unknown_reason(pipe)


def test_the_reason_names_every_cause_and_is_public(corpus_dir: Path, tokenizer: Any) -> None:
    """A JSONL pipeline that packs: packing alone makes the count data-dependent (issue 21)."""
    pipe = (zt.Pipeline.from_jsonl(str(corpus_dir / "code" / "*.jsonl")).fetch().decode_text()
            .tokenize(tokenizer).pack_flat(64).batch(2))
    assert pipe.num_batches(rank=0, world_size=1) is None
    reason = pipe.num_batches_reason()
    assert reason == ("decode_text turns empty documents of files into tombstones (seen only "
                      "by reading); pack_flat may drop, merge or hold back records")
    assert unknown_reason(pipe) == reason
    assert items(10).shuffle(64).batch(2).num_batches_reason() is None


def test_len_of_a_loader_over_a_packing_pipeline_names_the_packer(corpus_dir: Path,
                                                                  tokenizer: Any) -> None:
    pytest.importorskip("torch")
    pipe = (zt.Pipeline.from_jsonl(str(corpus_dir / "code" / "*.jsonl")).fetch().decode_text()
            .tokenize(tokenizer).pack_flat(64).batch(2))
    loader = zt.DataLoader(pipe, to_training=False)
    with pytest.raises(TypeError, match=r"has no len\(\): .*decode_text turns empty .*; "
                                        r"pack_flat may drop, merge or hold back records"):
        len(loader)
    loader.close()
