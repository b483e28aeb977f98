"""The contract registry: small pipelines that put every built-in operator through
:func:`zephon_torch.testing.check_operator_contract`.

Each :class:`Case` is a pipeline small enough for the restore check (a
checkpoint after every output), with the built-in operators it runs and the
``Pipeline`` builder methods it calls. ``tests/test_contract_registry.py``
checks that every concrete operator under ``zephon_torch.ops`` and every
builder method that adds a stage has a case here, and that each case really
runs what it claims; each ``tests/test_ops_*`` module runs the cases of its
operators (:func:`cases_for`; ``test_ops_transform`` also those of the fused
stage, which runs transforms together).

A new built-in operator (or builder method) therefore needs a case here, and
its test module a line that runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corpus import documents, write_jsonl, write_token_parquet

import zephon_torch as zt
from zephon_torch.ops import Operator
from zephon_torch.ops.batch import Batch
from zephon_torch.ops.fused import FusedOperator
from zephon_torch.ops.io import DecodeText, Fetch
from zephon_torch.ops.mixture import EnsureMixture
from zephon_torch.ops.packing import PackFlat, PackSequences
from zephon_torch.ops.shuffle import Shuffle
from zephon_torch.ops.tokenize import Tokenize, TokenizeChat
from zephon_torch.ops.transform import Filter, MapTransform
from zephon_torch.pipeline import Pipeline
from zephon_torch.testing import check_operator_contract, matrix, small_microbatch_sizes


@dataclass(frozen=True)
class ContractData:
    """What the cases read: a small corpus on disk and a trained tokenizer."""

    root: Path
    tokenizer: Any


def write_contract_corpus(root: Path) -> Path:
    """Two JSONL components (web: 2 files, with empty documents; code: 1 file) and a
    Parquet file of token ids: a few dozen samples in all."""
    for folder in ("web", "code", "tokens"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for i in range(2):
        write_jsonl(root / "web" / f"part-{i}.jsonl",
                    documents(14, seed=300 + i, mean_words=12, empty_every=6))
    write_jsonl(root / "code" / "part-0.jsonl",
                documents(10, seed=310, mean_words=8, prefix="def "))
    write_token_parquet(root / "tokens" / "part-0.parquet", 24, seed=320, rows_per_group=8)
    return root


#: Four lanes of small chunks, flushed often: sentinels, stalls and bin limits happen.
CONFIG = {"num_lanes": 4, "chunk_size": 3, "flush_every_k_chunks": 2, "seed": 0}


def web(data: ContractData) -> Any:
    return zt.sources.jsonl(str(data.root / "web" / "*.jsonl"), component_id=0)


def code(data: ContractData) -> Any:
    return zt.sources.jsonl(str(data.root / "code" / "*.jsonl"), component_id=1)


def texts(data: ContractData) -> Pipeline:
    return Pipeline.from_sources([web(data)], **CONFIG).fetch().decode_text()


def tokens(data: ContractData) -> Pipeline:
    return texts(data).tokenize(data.tokenizer)


def word_count(payload: dict) -> dict:
    return {**payload, "words": len(payload["text"].split())}


def long_enough(payload: dict) -> bool:
    return payload["words"] > 4


def as_chat(payload: dict) -> dict:
    """A conversation cut from the document's words: user and assistant turns in turn."""
    words = payload["text"].split()
    turns = [" ".join(words[i:i + 5]) for i in range(0, len(words), 5)] or [""]
    return {"messages": [{"role": ("user", "assistant")[i % 2], "content": t}
                         for i, t in enumerate(turns)]}


#: A model-style Jinja chat template (tokenize_chat renders it as transformers does).
JINJA_CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
              "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}")


@dataclass(frozen=True)
class Case:
    """One small pipeline and what it exercises.

    Attributes:
        build: Builds the pipeline from the contract data.
        checks: The operators this case is for: the test module of each
            runs it (:func:`cases_for`).
        operators: Every built-in operator class among its compiled stages
            (a fused stage and its parts).
        builders: The ``Pipeline`` methods it calls to add stages.
        options: Keyword arguments for ``check_operator_contract``.
    """

    build: Callable[[ContractData], Pipeline]
    checks: frozenset[type[Operator]]
    operators: frozenset[type[Operator]]
    builders: frozenset[str]
    options: dict[str, Any] = field(default_factory=dict)


def _case(build: Callable[[ContractData], Pipeline], checks: tuple[type[Operator], ...], *,
          runs: tuple[type[Operator], ...] = (), builders: tuple[str, ...],
          **options: Any) -> Case:
    return Case(build, frozenset(checks), frozenset((*checks, *runs)), frozenset(builders),
                options)


_TEXT_OPS = (Fetch, DecodeText, FusedOperator)
_TOKEN_OPS = (*_TEXT_OPS, Tokenize)
_TEXT_BUILDERS = ("fetch", "decode_text")
_TOKEN_BUILDERS = (*_TEXT_BUILDERS, "tokenize")

CASES: dict[str, Case] = {
    "fetch_decode_text": _case(texts, (Fetch, DecodeText), runs=(FusedOperator,),
                               builders=_TEXT_BUILDERS),
    "fetch_parquet_tokens": _case(
        lambda d: Pipeline.from_parquet(str(d.root / "tokens" / "*.parquet"), **CONFIG).fetch(),
        (Fetch,), builders=("fetch",)),
    "tokenize": _case(tokens, (Tokenize,), runs=_TEXT_OPS, builders=_TOKEN_BUILDERS),
    "tokenize_chat": _case(
        lambda d: texts(d).map_transform(as_chat).tokenize_chat(d.tokenizer, max_length=40),
        (TokenizeChat,), runs=(*_TEXT_OPS, MapTransform),
        builders=(*_TEXT_BUILDERS, "map_transform", "tokenize_chat")),
    "tokenize_chat_jinja": _case(
        lambda d: texts(d).map_transform(as_chat).tokenize_chat(
            d.tokenizer, chat_template=JINJA_CHAT, max_length=40),
        (TokenizeChat,), runs=(*_TEXT_OPS, MapTransform),
        builders=(*_TEXT_BUILDERS, "map_transform", "tokenize_chat")),
    "map_transform_filter": _case(
        lambda d: texts(d).map_transform(word_count).filter(long_enough),
        (MapTransform, Filter, FusedOperator), runs=_TEXT_OPS,
        builders=(*_TEXT_BUILDERS, "map_transform", "filter")),
    "apply_filter_alone": _case(
        # an operator added with apply(), as a user adds theirs; alone, so not fused
        lambda d: Pipeline.from_items(documents(20, seed=330, mean_words=6, empty_every=4),
                                      **CONFIG).apply(Filter(bool)),
        (Filter,), builders=("apply",)),
    "pack_flat": _case(lambda d: tokens(d).pack_flat(24, num_bins=2), (PackFlat,),
                       runs=_TOKEN_OPS, builders=(*_TOKEN_BUILDERS, "pack_flat")),
    "pack_flat_best_fit_decreasing": _case(
        lambda d: tokens(d).pack_flat(24, algorithm="best_fit_decreasing", bfd_window=5),
        (PackFlat,), runs=_TOKEN_OPS, builders=(*_TOKEN_BUILDERS, "pack_flat")),
    "pack_sequences": _case(lambda d: tokens(d).pack_sequences(32, num_bins=2),
                            (PackSequences,), runs=_TOKEN_OPS,
                            builders=(*_TOKEN_BUILDERS, "pack_sequences")),
    "ensure_mixture": _case(
        lambda d: Pipeline.from_sources([web(d), code(d)], {0: 0.6, 1: 0.4}, **CONFIG)
        .fetch().decode_text().tokenize(d.tokenizer).ensure_mixture(max_buffer_size=4),
        (EnsureMixture,), runs=_TOKEN_OPS, builders=(*_TOKEN_BUILDERS, "ensure_mixture")),
    "shuffle_streaming": _case(lambda d: tokens(d).shuffle(4 * 3, seed=3), (Shuffle,),
                               runs=_TOKEN_OPS, builders=(*_TOKEN_BUILDERS, "shuffle")),
    "shuffle_block": _case(lambda d: tokens(d).shuffle(4 * 3, seed=3, algorithm="block"),
                           (Shuffle,), runs=_TOKEN_OPS, builders=(*_TOKEN_BUILDERS, "shuffle")),
    "batch": _case(lambda d: tokens(d).batch(3, drop_last=False), (Batch,),
                   runs=_TOKEN_OPS, builders=(*_TOKEN_BUILDERS, "batch")),
    "batch_drop_last": _case(lambda d: tokens(d).batch(2, drop_last=True), (Batch,),
                             runs=_TOKEN_OPS, builders=(*_TOKEN_BUILDERS, "batch")),
}

#: The ``Pipeline`` methods that return a new pipeline but add no stage.
NOT_STAGE_BUILDERS = frozenset({"with_source", "change_weights", "append_shards", "change_lanes"})

def registry() -> dict[type[Operator] | str, list[str]]:
    """The contract registry: each operator class and each ``"Pipeline.<method>"`` that
    adds a stage -> the names of the cases that check it."""
    table: dict[type[Operator] | str, list[str]] = {}
    for name, case in CASES.items():
        for op in case.checks:
            table.setdefault(op, []).append(name)
        for method in case.builders:
            table.setdefault(f"Pipeline.{method}", []).append(name)
    return table


def cases_for(*modules: str) -> list[str]:
    """The names of the cases that check the operators defined in ``modules``."""
    return [name for name, case in CASES.items()
            if any(op.__module__ in modules for op in case.checks)]


def settings_for(pipe: Pipeline) -> list[dict[str, Any]]:
    """The determinism settings of a case: the full matrix of the runners that start
    no process (threads and lanes, 1, 2 and 4 workers, default and small micro-batch
    sizes), and the process runner once, with two workers and micro-batches of one
    (a process start-up costs most of a second)."""
    small = small_microbatch_sizes(pipe, 1) or None
    sizes: list[dict[str, int] | None] = [None]
    if small:  # a pipeline whose every size defines the output has no knob to turn
        sizes += [small, small_microbatch_sizes(pipe, 3)]
    return [*matrix(("threads", "lanes"), (1, 2, 4), sizes),
            {"runner": "process", "num_workers": 2, "microbatch_sizes": small}]


def check_case(name: str, data: ContractData) -> list[Any]:
    """Run one case through the whole operator contract; return its reference output."""
    case = CASES[name]
    pipe = case.build(data)
    options = {"settings": settings_for(pipe), **case.options}
    return check_operator_contract(pipe, **options)
