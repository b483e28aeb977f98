"""``algorithm="best_fit_decreasing"`` in whole pipelines: windows and flush sentinels,
exact resume at every cut, runners and world sizes.

Small chunks, a short flush period and windows that do not divide the epoch
make windows end both by count and by sentinel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import (
    assert_conserved,
    assert_deterministic,
    assert_elastic,
    assert_restores_everywhere,
    collect,
)
from test_determinism import CONFIG, tokenized

import zephon_torch as zt
from zephon_torch.pipeline import Pipeline

K, CHUNK = CONFIG["flush_every_k_chunks"], CONFIG["chunk_size"]


def bfd_pipe(corpus: Path, tok: Any, window: int = 5) -> Pipeline:
    return (tokenized(corpus, tok)
            .pack_flat(64, algorithm="best_fit_decreasing", bfd_window=window).batch(3))


def test_best_fit_decreasing_restores_exactly_at_every_cut_point(
        corpus_dir: Path, tokenizer: Any) -> None:
    reference = assert_restores_everywhere(
        bfd_pipe(corpus_dir, tokenizer),
        resume_settings=[{"runner": "inline"}, {"runner": "threads", "num_workers": 2}],
        max_replayed_per_lane=K * CHUNK,
    )
    assert len(reference) > 20


def test_best_fit_decreasing_resumes_on_the_process_runner(
        corpus_dir: Path, tokenizer: Any) -> None:
    assert_restores_everywhere(bfd_pipe(corpus_dir, tokenizer), cut_points=[0, 5, 17],
                               runner="process", num_workers=2,
                               resume_settings=[{"runner": "process", "num_workers": 2},
                                                {"runner": "inline"}])


def test_best_fit_decreasing_is_deterministic_elastic_and_conserving(
        corpus_dir: Path, tokenizer: Any) -> None:
    pipe = bfd_pipe(corpus_dir, tokenizer, window=9)
    small = {"fetch": 3, "decode_text": 2, "tokenize": 5, "pack_flat": 1}
    assert_deterministic(pipe, [{"runner": "threads", "num_workers": 3, "microbatch_sizes": small},
                                {"runner": "process", "num_workers": 2}])
    assert_elastic(pipe, world_sizes=(2, 4))
    assert_conserved(pipe, runner="threads", num_workers=2)


def test_a_window_never_spans_a_flush_sentinel(corpus_dir: Path, tokenizer: Any) -> None:
    # A sentinel after every chunk and windows far larger than a chunk: every
    # window is cut by a sentinel, so a row holds documents of one chunk only.
    pipe = (Pipeline.from_sources([zt.sources.jsonl(str(corpus_dir / "web" / "*.jsonl*"))],
                                  num_lanes=2, chunk_size=8, flush_every_k_chunks=1, seed=0)
            .fetch().decode_text().tokenize(tokenizer)
            .pack_flat(256, algorithm="best_fit_decreasing", bfd_window=1000))
    rows = [r for r in collect(pipe, runner="inline") if not r.meta.tombstone]
    chunks = [{c.chunk_id for c in r.meta.contribution_cursors()} for r in rows]
    assert all(len(c) == 1 for c in chunks)
    assert any(len(r.meta.contributors) > 1 for r in rows)  # rows do hold several documents
