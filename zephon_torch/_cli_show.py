"""What ``demo`` and ``inspect`` share: the canonical pipeline, and one batch shown.

Part of the ``zephon-torch`` command (``cli.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from zephon_torch.pipeline import Pipeline
from zephon_torch.types import SampleBatch


def _canonical(source: Pipeline, tokenizer: Any, *, seq_len: int, batch_size: int,
               pad_id: int, field: str = "text", shuffle_buffer: int = 256,
               seed: int = 0) -> Pipeline:
    """``source -> fetch -> decode_text -> tokenize(EOS) -> pack_flat -> shuffle -> batch``."""
    return (
        source.fetch()
        .decode_text(field)
        .tokenize(tokenizer, field=field, special_tokens="eos")
        .pack_flat(seq_len + 1, pad_token_id=pad_id)
        .shuffle(shuffle_buffer, seed=seed + 1)
        .batch(batch_size, drop_last=True)
    )


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _runs(values: Sequence[int], starts: Sequence[int], limit: int = 3) -> str:
    """``positions`` of a row, segment by segment: ``0 1 2 ... 36 | 0 1 ... 60 | ...``."""
    parts = []
    bounds = [*starts, len(values)]
    for a, b in itertools.islice(itertools.pairwise(bounds), limit):
        seg = list(values[a:b])
        shown = seg if len(seg) <= 6 else [*seg[:3], "...", *seg[-2:]]
        parts.append(" ".join(str(v) for v in shown))
    more = " | ..." if len(bounds) - 1 > limit else ""
    return " | ".join(parts) + more


def _tensors(out: dict[str, Any], keys: Sequence[str]) -> str:
    """Shapes and dtypes, each dtype after the run of tensors that have it:
    ``input_ids [8, 256], labels [8, 256] (torch.int64), cu_seqlens [8, 12] (torch.int32)``."""
    groups: list[tuple[Any, list[str]]] = []
    for key in keys:
        dtype = out[key].dtype
        if not groups or groups[-1][0] != dtype:
            groups.append((dtype, []))
        groups[-1][1].append(f"{key} {list(out[key].shape)}")
    return ", ".join(f"{', '.join(shapes)} ({dtype})" for dtype, shapes in groups)


def _show_batch(batch: SampleBatch, tokenizer: Any, *, docs: int = 3, width: int = 72) -> None:
    """Shapes of the training tensors, then one row: its documents, positions, cu_seqlens.

    The row shown is the first holding several documents (row 0 when none
    does), since that is where ``positions`` and ``cu_seqlens`` say something.
    """
    out = batch.to_training(return_labels=True, return_cu_seqlens=True,
                            return_num_valid_tokens=True)
    print(f"  tensors: {_tensors(out, ('input_ids', 'labels', 'positions', 'cu_seqlens'))}; "
          f"{out['num_valid_tokens']:,} labels not ignored")
    length = out["input_ids"].shape[1]
    # Row i's segment starts: its cu_seqlens without the padding repeats of the length.
    starts = [sorted({c for c in row if c < length}) for row in out["cu_seqlens"].tolist()]
    row = next((i for i, s in enumerate(starts) if len(s) >= 3), 0)
    ids = out["input_ids"][row].tolist()
    padding = batch[row].meta.padding_length or 0
    # The trailing padding is a segment of its own once it spans 2+ input positions.
    documents = len(starts[row]) - (1 if padding > 1 else 0)
    print(f"  row {row} holds {documents} document(s)"
          + (f" and {padding} padding token{'s' if padding > 1 else ''}" if padding else "")
          + f"; its cu_seqlens {[*starts[row], length]}")
    print(f"  positions (restart at each document): "
          f"{_runs(out['positions'][row].tolist(), starts[row])}")
    bounds = [*starts[row], length]
    for k in range(min(docs, documents)):
        a, b = bounds[k], bounds[k + 1]
        text = tokenizer.decode(ids[a:b], skip_special_tokens=True)
        print(f"    doc {k} ({b - a} tokens): {_clip(text, width)!r}")
