"""Generated corpora for pipeline tests: heavy-tailed documents, nothing downloaded."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

_WORDS = (
    "the quick brown fox jumps over lazy dog data pipeline token model train shard lane "
    "chunk offset packing shuffle batch hello world lorem ipsum dolor sit amet river "
    "mountain seven eleven blue green yellow orange"
).split()


def documents(count: int, seed: int, *, mean_words: float = 40.0, empty_every: int = 0,
              prefix: str = "") -> list[str]:
    """``count`` texts whose word counts are lognormal (a few very long ones)."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(mean_words) - sigma**2 / 2
    lengths = np.maximum(1, rng.lognormal(mu, sigma, size=count).astype(int))
    docs = []
    for i, n in enumerate(lengths):
        if empty_every and i % empty_every == empty_every - 1:
            docs.append("")
            continue
        words = rng.choice(len(_WORDS), size=int(n))
        docs.append(prefix + " ".join(_WORDS[w] for w in words))
    return docs


def write_jsonl(path: Path, texts: list[str], *, compress: bool = False) -> Path:
    """One JSON object per line: ``{"id": i, "text": ...}``."""
    lines = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts))
    if compress:
        path.write_bytes(gzip.compress(lines.encode()))
    else:
        path.write_text(lines)
    return path


def write_token_parquet(path: Path, count: int, seed: int, *, rows_per_group: int = 50) -> Path:
    """Pre-tokenized documents in a ``list<int32>`` column ``input_ids``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(3.5, 1.0, size=count).astype(int))
    docs = [rng.integers(4, 500, size=int(n), dtype=np.int32) for n in lengths]
    table = pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32()))})
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


def assert_scanned_as(data: bytes, block: int, expected: list[tuple[int, int, bytes]]) -> Any:
    """Feed ``data`` to a line scanner and a line iterator ``block`` bytes at a time and
    check both against ``expected`` ``(offset, line number, line)``; the scanner."""
    from zephon_torch.sources.lines import LineScanner, iter_lines

    blocks = [data[i:i + block] for i in range(0, len(data), block)]
    scanner = LineScanner()
    for b in blocks:
        scanner.feed(b)
    index = scanner.finish()
    assert [tuple(row) for row in index.tolist()] == [(o, n) for o, n, _ in expected]
    assert list(iter_lines(blocks)) == [line for _, _, line in expected]
    return scanner
