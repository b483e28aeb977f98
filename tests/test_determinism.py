"""The determinism matrix: runner x workers x micro-batch sizes x world sizes.

Every built-in operator, alone and in the full chain, over generated JSONL
and Parquet corpora with heavy-tailed document lengths and a BPE tokenizer
trained at fixture time. Small chunks and a short flush period make sure
that sentinels, stalls, bin limits and shuffle buffers are really exercised
(and the tests check that they were).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import (
    assert_conserved,
    assert_deterministic,
    assert_elastic,
    collect,
    matrix,
    token_total,
)

import zephon_torch as zt
from zephon_torch.pipeline import Pipeline

CONFIG = {"num_lanes": 4, "chunk_size": 16, "flush_every_k_chunks": 2, "seed": 0}


def web(corpus: Path, **kw: Any) -> Any:
    return zt.sources.jsonl(str(corpus / "web" / "*.jsonl*"), component_id=0, **kw)


def code(corpus: Path, **kw: Any) -> Any:
    return zt.sources.jsonl(str(corpus / "code" / "*.jsonl"), component_id=1, **kw)


def text_pipe(corpus: Path) -> Pipeline:
    return Pipeline.from_sources([web(corpus)], **CONFIG).fetch().decode_text()


def tokenized(corpus: Path, tok: Any) -> Pipeline:
    return text_pipe(corpus).tokenize(tok)


def mixture(corpus: Path, tok: Any, weights: Any = "60/40") -> Pipeline:
    weights = {0: 0.6, 1: 0.4} if weights == "60/40" else weights
    return (Pipeline.from_sources([web(corpus), code(corpus)], weights, **CONFIG)
            .fetch().decode_text().tokenize(tok))


def word_count(payload: dict) -> dict:
    return {**payload, "words": len(payload["text"].split())}


def long_enough(payload: dict) -> bool:
    return payload["words"] > 5


def as_chat(payload: dict) -> dict:
    """A conversation cut from the document's words: user and assistant turns in turn."""
    words = payload["text"].split()
    turns = [" ".join(words[i:i + 7]) for i in range(0, len(words), 7)] or [""]
    return {"messages": [{"role": ("user", "assistant")[i % 2], "content": t}
                         for i, t in enumerate(turns)]}


#: A model-style Jinja chat template (tokenize_chat renders it as transformers does).
JINJA_CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
              "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


PIPELINES: dict[str, Callable[[Path, Any], Pipeline]] = {
    "fetch_decode": lambda c, t: text_pipe(c),
    "tokenize": tokenized,
    "map_filter": lambda c, t: text_pipe(c).map_transform(word_count).filter(long_enough),
    "pack_flat_first_fit": lambda c, t: tokenized(c, t).pack_flat(64, num_bins=4),
    "pack_flat_best_fit": lambda c, t: tokenized(c, t).pack_flat(64, num_bins=4,
                                                                  algorithm="best_fit"),
    "pack_flat_wrap": lambda c, t: tokenized(c, t).pack_flat(64, algorithm="wrap"),
    "pack_sequences": lambda c, t: tokenized(c, t).pack_sequences(96, num_bins=3),
    "tokenize_chat_pack": lambda c, t: text_pipe(c).map_transform(as_chat).tokenize_chat(
        t, max_length=80).pack_sequences(96, num_bins=3),
    "tokenize_chat_jinja_pack": lambda c, t: text_pipe(c).map_transform(as_chat).tokenize_chat(
        t, chat_template=JINJA_CHAT, max_length=80).pack_flat(96, num_bins=3),
    "pack_flat_best_fit_decreasing": lambda c, t: tokenized(c, t).pack_flat(
        64, algorithm="best_fit_decreasing", bfd_window=12),
    "pack_sequences_best_fit_decreasing": lambda c, t: tokenized(c, t).pack_sequences(
        96, algorithm="best_fit_decreasing", bfd_window=7),
    "ensure_mixture": lambda c, t: mixture(c, t).ensure_mixture(max_buffer_size=16),
    # 24 and 32 rows a lane: the buffer is shared by the 4 lanes
    "shuffle_streaming": lambda c, t: tokenized(c, t).shuffle(4 * 24, seed=3),
    "shuffle_block": lambda c, t: tokenized(c, t).shuffle(4 * 24, seed=3, algorithm="block"),
    "shuffle_block_warmup": lambda c, t: tokenized(c, t).shuffle(
        4 * 32, seed=3, algorithm="block_warmup"),
    "batch_drop_last": lambda c, t: tokenized(c, t).batch(5, drop_last=True),
    "batch_keep_last": lambda c, t: tokenized(c, t).batch(5, drop_last=False),
    "parquet_tokens": lambda c, t: Pipeline.from_parquet(
        str(c / "tokens" / "*.parquet"), **CONFIG).fetch().pack_flat(128).batch(4),
}


def full_chain(corpus: Path, tok: Any, *, drop_last: bool = True,
               algorithm: str = "streaming", weights: Any = "60/40") -> Pipeline:
    return (mixture(corpus, tok, weights).pack_flat(64, num_bins=4)
            .ensure_mixture(max_buffer_size=8)
            .shuffle(4 * 16, seed=5, algorithm=algorithm).batch(4, drop_last=drop_last))


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_each_operator_is_deterministic_across_runners(
        name: str, corpus_dir: Path, tokenizer: Any) -> None:
    pipe = PIPELINES[name](corpus_dir, tokenizer)
    small = {stage: 3 for stage in pipe.stage_names()
             if stage not in ("batch", "shuffle", "ensure_mixture")}
    settings = [
        {"runner": "threads", "num_workers": 2, "microbatch_sizes": small},
        {"runner": "threads", "num_workers": 4},
        {"runner": "process", "num_workers": 2, "microbatch_sizes": small},
        {"runner": "lanes", "num_workers": 3, "microbatch_sizes": small},
    ]
    reference = assert_deterministic(pipe, settings)
    assert reference, "the pipeline produced nothing"


@pytest.mark.parametrize("num_lanes", [4, 8])
def test_lane_workers_give_the_inline_output_for_1_to_4_workers(
        num_lanes: int, corpus_dir: Path, tokenizer: Any) -> None:
    pipe = full_chain(corpus_dir, tokenizer).with_source(num_lanes=num_lanes)
    settings = [{"runner": "lanes", "num_workers": n} for n in (1, 2, 3, 4)]
    reference = assert_deterministic(pipe, settings)
    assert len({b.lane_ids[0] for b in reference}) == num_lanes


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_each_operator_gives_every_lane_the_same_output_on_any_world_size(
        name: str, corpus_dir: Path, tokenizer: Any) -> None:
    assert_elastic(PIPELINES[name](corpus_dir, tokenizer), world_sizes=(2, 4))


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_each_operator_closes_every_input_sample_exactly_once(
        name: str, corpus_dir: Path, tokenizer: Any) -> None:
    stats = assert_conserved(PIPELINES[name](corpus_dir, tokenizer), runner="inline")
    # web: 3 x 60 + 30 docs; the mixture adds code at 40%, repeated until web is done
    # (210 web docs need 140 code docs: one pass of 100 and 40 more); Parquet: 2 x 120.
    expected = {"ensure_mixture": 350, "parquet_tokens": 240}.get(name, 210)
    assert stats["read"] == expected


def test_full_chain_full_matrix(corpus_dir: Path, tokenizer: Any) -> None:
    pipe = full_chain(corpus_dir, tokenizer)
    sizes = [None, {"fetch": 5, "decode_text": 7, "tokenize": 3, "pack_flat": 2}]
    reference = assert_deterministic(pipe, matrix(microbatch_sizes=sizes))
    assert len(reference) > 10


@pytest.mark.parametrize("algorithm", ["streaming", "block", "block_warmup"])
def test_full_chain_is_elastic_and_conserves(
        algorithm: str, corpus_dir: Path, tokenizer: Any) -> None:
    pipe = full_chain(corpus_dir, tokenizer, algorithm=algorithm)
    assert_elastic(pipe, world_sizes=(2, 4))
    assert_conserved(pipe, runner="threads", num_workers=2)


def test_full_chain_exercises_sentinels_stalls_and_buffers(
        corpus_dir: Path, tokenizer: Any) -> None:
    pipe = full_chain(corpus_dir, tokenizer)
    it = pipe.iter(runner="inline")
    out = list(it)
    stages = it.stats()["stages"]
    assert stages["pack_flat"]["sentinels"] >= 8
    assert stages["batch"]["stalled_sentinels"] > 0
    assert stages["shuffle"]["sentinels"] == stages["pack_flat"]["sentinels"]
    # the shuffle buffer really reorders: rows of a lane are not in cursor order
    rows = [r for b in out if b.lane_ids[0] == 0 for r in b]
    keys = [r.meta.as_cursor_key() for r in rows]
    assert keys != sorted(keys)


def test_full_chain_delivers_every_kept_token(corpus_dir: Path, tokenizer: Any) -> None:
    # weights in proportion to the sizes: one pass over each dataset, nothing repeated
    pipe = full_chain(corpus_dir, tokenizer, drop_last=False, weights=None)
    out = collect(pipe, runner="threads", num_workers=2)
    expected = 0
    for path in sorted((corpus_dir / "web").iterdir()) + sorted((corpus_dir / "code").iterdir()):
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        for line in raw.decode().splitlines():
            text = json.loads(line)["text"]
            if text.strip():
                # tokenize's default adds one EOS after each document
                expected += len(tokenizer.encode(text, add_special_tokens=False).ids) + 1
    assert token_total(out) == expected


def test_same_config_different_seed_changes_the_order(corpus_dir: Path, tokenizer: Any) -> None:
    a = collect(full_chain(corpus_dir, tokenizer), runner="inline")
    b = collect(full_chain(corpus_dir, tokenizer).with_source(seed=1), runner="inline")
    assert [r.meta.sample_id for x in a for r in x] != [r.meta.sample_id for x in b for r in x]


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_each_operator_in_epoch_two_is_deterministic_elastic_and_conserving(
        name: str, corpus_dir: Path, tokenizer: Any) -> None:
    pipe = PIPELINES[name](corpus_dir, tokenizer)
    small = {stage: 3 for stage in pipe.stage_names()
             if stage not in ("batch", "shuffle", "ensure_mixture")}
    reference = collect(pipe, runner="inline", epoch=2)
    assert_deterministic(pipe, [{"runner": "threads", "num_workers": 2,
                                 "microbatch_sizes": small, "epoch": 2}], reference)
    assert_elastic(pipe, world_sizes=(2,), epoch=2)
    stats = assert_conserved(pipe, runner="inline", epoch=2)
    assert stats["read"] == assert_conserved(pipe, runner="inline")["read"]
    # every source here is shuffled: epoch 2 is another order of the same samples
    epoch_zero = collect(pipe, runner="inline")
    assert [describe_ids(x) for x in reference] != [describe_ids(x) for x in epoch_zero]


def describe_ids(elem: Any) -> list[tuple[int, int, int]]:
    records = elem.records if isinstance(elem, zt.SampleBatch) else [elem]
    return [r.meta.sample_id for r in records]


def test_full_chain_epoch_two_full_matrix_and_exact_resume(
        corpus_dir: Path, tokenizer: Any) -> None:
    from harness import assert_restores_everywhere

    pipe = full_chain(corpus_dir, tokenizer)
    reference = collect(pipe, runner="inline", epoch=2)
    sizes = [None, {"fetch": 5, "decode_text": 7, "tokenize": 3, "pack_flat": 2}]
    settings = [{**s, "epoch": 2} for s in matrix(workers=(2,), microbatch_sizes=sizes)]
    assert_deterministic(pipe, settings, reference)
    assert_elastic(pipe, world_sizes=(2, 4), epoch=2)
    epoch_one = collect(pipe, runner="inline", epoch=1)
    assert [describe_ids(x) for x in reference] != [describe_ids(x) for x in epoch_one]
    # resume mid-epoch 2 on other runners and worker counts: exact
    assert_restores_everywhere(
        pipe, epoch=2, cut_points=[1, len(reference) // 2, len(reference) - 1],
        resume_settings=({"runner": "threads", "num_workers": 2},
                         {"runner": "process", "num_workers": 2},
                         {"runner": "inline"}))
