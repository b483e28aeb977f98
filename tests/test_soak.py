"""Soak: a long run cut into many pieces, and memory across passes.

Small sizes (CI runs it), but the shape of a real job: several passes over a
mixture of JSONL components with bad lines skipped, tokenized, packed,
shuffled and batched; a checkpoint every few steps, taken at random, each
piece resumed in a fresh iterator on a random runner. At the end the pieces
must equal the uninterrupted run exactly and every sample must be accounted
for; and a long single run must not grow in memory from pass to pass.
"""

from __future__ import annotations

import gc
import json
import random
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import assert_same, closed_samples, collect

from zephon_torch.pipeline import Pipeline
from zephon_torch.sources import datasets as zd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def soak_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two components: four JSONL files with ~5% bad lines, and two plain ones."""
    root = tmp_path_factory.mktemp("soak")
    rng = np.random.default_rng(11)
    words = ["lane", "river", "data", "seven", "blue", "pack", "shard", "epoch", "token"]
    for component, files in (("web", 4), ("code", 2)):
        (root / component).mkdir()
        for f in range(files):
            lines = []
            for i in range(150):
                if rng.random() < 0.05:
                    lines.append('{"text": "cut sho')
                    continue
                n = int(rng.lognormal(2.5, 0.9)) + 1
                lines.append(json.dumps({"id": i, "text": " ".join(rng.choice(words, n))}))
            (root / component / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _pipe(root: Path, tokenizer: Any, passes: int) -> Pipeline:
    sources = [zd.jsonl(str(root / "web" / "*.jsonl"), component_id=0, on_error="skip"),
               zd.jsonl(str(root / "code" / "*.jsonl"), component_id=1, on_error="skip")]
    return (Pipeline.from_sources(sources, {0: 0.7, 1: 0.3}, num_lanes=4, chunk_size=32,
                                  seed=17, passes=passes)
            .fetch().decode_text().tokenize(tokenizer, max_length=200)
            .pack_flat(128, pad_token_id=0).shuffle(32, seed=3).batch(4))


@pytest.mark.timeout(600)
def test_many_checkpoints_at_random_continue_exactly_and_conserve(soak_corpus: Path,
                                                                  tokenizer: Any) -> None:
    pipe = _pipe(soak_corpus, tokenizer, passes=3)
    rng = random.Random(2024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skip summaries
        reference = collect(pipe, runner="inline")
        got: list[Any] = []
        state = None
        pieces = 0
        runners = ["threads", "threads", "inline", "threads"]
        while True:
            runner = "process" if pieces in (2, 9) else runners[pieces % len(runners)]
            it = pipe.iter(runner=runner, num_workers=2, verify=True)
            if state is not None:
                it.load_state_dict(state)
            steps = rng.randint(1, 25)
            piece = []
            for _ in range(steps):
                item = next(it, None)
                if item is None:
                    break
                piece.append(item)
            got.extend(piece)
            pieces += 1
            if len(piece) < steps:  # the stream ended inside this piece: verified
                it.close()
                break
            state = json.loads(json.dumps(it.state_dict()))
            it.close()
    assert pieces > 8, pieces
    assert_same(reference, got, label=f"{pieces} pieces")
    closed = closed_samples(got)
    assert len(closed) == len(set(closed))
    assert len(closed) == len(closed_samples(reference))


def _retained_memory(pipe: Pipeline) -> tuple[int, int]:
    """Python memory (tracemalloc) still held when a whole run has ended, and samples read.

    Measured before ``close()``, so the iterator, its stages, accumulators and
    progress accounting are all still alive: whatever they accumulate per
    sample or per chunk shows here.
    """
    gc.collect()
    tracemalloc.start()
    try:
        it = pipe.iter(runner="inline")
        for _ in it:
            pass
        read = it.stats()["read"]
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0]
        it.close()
    finally:
        tracemalloc.stop()
    return retained, read


@pytest.mark.timeout(600)
def test_memory_is_flat_across_passes(soak_corpus: Path, tokenizer: Any) -> None:
    # Not the peak: it grows slowly with any run (the longest document seen, and
    # the lanes' random-walk imbalance that the round-robin buffers). What the
    # machinery keeps must not: a leak of one small object per sample (>= 8 bytes)
    # would add > 250 kB between these two runs. Both are past the warm-up (a
    # few passes' shard layouts are cached).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        short, short_read = _retained_memory(_pipe(soak_corpus, tokenizer, passes=8))
        long, long_read = _retained_memory(_pipe(soak_corpus, tokenizer, passes=40))
    assert long_read > 4.9 * short_read
    extra = long_read - short_read  # ~32k samples more
    assert long - short < 3 * extra, (f"{short / 1e3:.0f} kB held after {short_read} samples, "
                                      f"{long / 1e3:.0f} kB after {long_read}")
