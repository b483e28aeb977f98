"""Session fixtures: generated corpora and a tokenizer trained at fixture time."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from corpus import documents, write_jsonl, write_token_parquet
from fixtures_tokenizer import train_test_tokenizer


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two components of JSONL (web: 3 files, one gzipped; code: 2 files) and a Parquet set."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "web").mkdir()
    (root / "code").mkdir()
    (root / "tokens").mkdir()
    for i in range(3):
        texts = documents(60, seed=i, empty_every=25)
        write_jsonl(root / "web" / f"part-{i}.jsonl", texts)
    write_jsonl(root / "web" / "part-3.jsonl.gz", documents(30, seed=9), compress=True)
    for i in range(2):
        write_jsonl(root / "code" / f"part-{i}.jsonl",
                    documents(50, seed=100 + i, mean_words=20, prefix="def "))
    for i in range(2):
        write_token_parquet(root / "tokens" / f"part-{i}.parquet", 120, seed=200 + i)
    return root


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A byte-level BPE trained on generated text (ids 0..3 are the special tokens)."""
    tok, _ = train_test_tokenizer(tmp_path_factory.mktemp("tok"))
    return tok
