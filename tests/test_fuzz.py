"""Fuzzing with hypothesis: random pipelines over random corpora.

Each example draws a corpus (one to three components of random texts, some
empty), a source layout (lanes, chunk size,
seed, passes, shuffle) and a random chain of operators with random
parameters, then checks the three promises that hold for every pipeline:

* the output is the same on every runner and worker count;
* a checkpoint at a random cut point resumes exactly (head + rest == run);
* every sample read is delivered or tombstoned exactly once (``verify=True``).

Sizes are small so the module runs in well under a minute; the process
runner is exercised by a few examples of its own (it starts processes).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
import pytest
from harness import assert_same, collect
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_torch.pipeline import Pipeline
from zephon_torch.sources import datasets as zd

_WORDS = ["lane", "river", "data", "seven", "blue", "pack", "shard", "x"]


def to_ids(payload: dict[str, Any]) -> dict[str, Any]:
    """A stand-in tokenizer: one id per word (stateless and cheap)."""
    words = payload["text"].split()
    return {**payload, "input_ids": np.array([1 + _WORDS.index(w) for w in words],
                                             dtype=np.int32)}


def short_enough(payload: dict[str, Any]) -> bool:
    return len(payload["text"]) % 5 != 0


def shout(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "text": payload["text"].upper().lower()}


@st.composite
def corpora(draw: st.DrawFn) -> list[list[Any]]:
    """One to three components of documents: texts of random words (some empty)."""
    components = []
    for _ in range(draw(st.integers(1, 3))):
        docs = draw(st.lists(st.lists(st.sampled_from(_WORDS), max_size=12), min_size=1,
                             max_size=80))
        components.append([" ".join(words) for words in docs])
    return components


@st.composite
def pipelines(draw: st.DrawFn, tokenizer: Any) -> Pipeline:
    components = draw(corpora())
    sources = [zd.items(docs, component_id=c, name=f"c{c}")
               for c, docs in enumerate(components)]
    weights = None
    if len(sources) > 1 and draw(st.booleans()):
        weights = [draw(st.floats(0.1, 4.0)) for _ in sources]
    num_lanes = draw(st.integers(1, 5))
    pipe = Pipeline.from_sources(
        sources, weights, num_lanes=num_lanes, chunk_size=draw(st.integers(1, 9)),
        seed=draw(st.integers(0, 2**31)), passes=draw(st.integers(1, 2)),
        shuffle=draw(st.booleans()),
        flush_every_k_chunks=draw(st.sampled_from([None, 1, 3])),
    )
    if draw(st.booleans()):
        pipe = pipe.map_transform(shout)
    if draw(st.booleans()):
        pipe = pipe.filter(short_enough)
    tokenized = draw(st.sampled_from(["none", "map", "tokenizer"]))
    if tokenized == "map":
        pipe = pipe.map_transform(to_ids)
    elif tokenized == "tokenizer":
        pipe = pipe.tokenize(tokenizer, max_length=draw(st.sampled_from([None, 6, 17])),
                             special_tokens=draw(st.sampled_from(["bos_eos", "eos", "none"])))
    if tokenized != "none":
        pack = draw(st.sampled_from(["none", "flat", "sequences"]))
        length = draw(st.integers(4, 24))
        algorithm = draw(st.sampled_from(["first_fit", "best_fit"]))
        if pack == "flat":
            pipe = pipe.pack_flat(length, pad_token_id=0, algorithm=algorithm,
                                  num_bins=draw(st.integers(1, 4)))
        elif pack == "sequences":
            pipe = pipe.pack_sequences(length, algorithm=algorithm,
                                       num_bins=draw(st.integers(1, 4)))
    if len(sources) > 1 and draw(st.booleans()):
        pipe = pipe.ensure_mixture(max_buffer_size=draw(st.integers(4, 50)))
    if draw(st.booleans()):
        # 2 to 20 rows a lane: the buffer is shared by the lanes (1 row a lane is refused).
        pipe = pipe.shuffle(draw(st.integers(num_lanes + 1, 20 * num_lanes)),
                            seed=draw(st.integers(0, 9)),
                            algorithm=draw(st.sampled_from(["streaming", "block",
                                                            "block_warmup"])))
    if draw(st.booleans()):
        pipe = pipe.batch(draw(st.integers(1, 4)), drop_last=draw(st.booleans()))
    return pipe


def _run_verified(pipe: Pipeline, **kwargs: Any) -> list[Any]:
    it = pipe.iter(verify=True, **kwargs)
    try:
        return list(it)  # verify=True: a ConservationError if anything is lost or doubled
    finally:
        it.close()


def _resume(pipe: Pipeline, cut: int, head_kwargs: dict[str, Any],
            rest_kwargs: dict[str, Any]) -> list[Any]:
    it = pipe.iter(**head_kwargs)
    try:
        head = [next(it) for _ in range(cut)]
        state = json.loads(json.dumps(it.state_dict()))
    finally:
        it.close()
    resumed = pipe.iter(verify=True, **rest_kwargs)
    try:
        resumed.load_state_dict(state)
        return head + list(resumed)
    finally:
        resumed.close()


_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


@pytest.mark.timeout(300)
@settings(max_examples=150, **_SETTINGS)
@given(data=st.data())
def test_random_pipelines_are_deterministic_conserved_and_resume_exactly(
        data: st.DataObject, tokenizer: Any) -> None:
    pipe = data.draw(pipelines(tokenizer), label="pipeline")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        reference = _run_verified(pipe, runner="inline")
        workers = data.draw(st.integers(1, 3), label="workers")
        sizes = data.draw(st.sampled_from([None, 1, 3]), label="microbatch size")
        overrides = None
        if sizes is not None:
            overrides = {name: sizes for name, op in zip(pipe.stage_names(), pipe.ops)
                         if op.name not in ("batch", "shuffle", "ensure_mixture")}
        threads = _run_verified(pipe, runner="threads", num_workers=workers,
                                microbatch_sizes=overrides)
        assert_same(reference, threads, label=f"threads x{workers}, sizes {sizes}")
        cut = data.draw(st.integers(0, len(reference)), label="cut")
        runner = data.draw(st.sampled_from(["inline", "threads"]), label="resume runner")
        resumed = _resume(pipe, cut, {"runner": "inline"},
                          {"runner": runner, "num_workers": workers})
        assert_same(reference, resumed, label=f"cut at {cut}, resumed on {runner}")


@pytest.mark.timeout(300)
@settings(max_examples=4, **_SETTINGS)
@given(data=st.data())
def test_random_pipelines_on_the_process_runner(data: st.DataObject, tokenizer: Any) -> None:
    pipe = data.draw(pipelines(tokenizer), label="pipeline")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        reference = collect(pipe, runner="inline")
        got = _run_verified(pipe, runner="process", num_workers=2)
        assert_same(reference, got, label="process x2")
        cut = data.draw(st.integers(0, len(reference)), label="cut")
        resumed = _resume(pipe, cut, {"runner": "process", "num_workers": 2},
                          {"runner": "inline"})
        assert_same(reference, resumed, label=f"cut at {cut} on the process runner")
