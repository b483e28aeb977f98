"""The demo behind the README's first command: ``python -m zephon_torch.demo``.

It packs a small built-in corpus into fixed-length rows the way ``pack_flat``
does (byte-level token ids, an EOS after every document, positions restarting
at each document, trailing padding recorded in the meta) and prints what
``SampleBatch.to_training`` hands a model.
"""

from __future__ import annotations

import argparse

import numpy as np

from zephon_torch.types import (
    PACKING_METADATA_TAG,
    ContributorRef,
    SampleBatch,
    SampleMeta,
    SampleRecord,
)

DEFAULT_CORPUS = (
    "Data flows in lanes.",
    "Every stateful decision lives in a per-lane accumulator.",
    "Flush sentinels make replay exact.",
    "Same bytes, any number of workers.",
    "Resume exactly after a crash.",
)
PAD, EOS, BYTE_OFFSET = 0, 1, 2


def _encode(text: str) -> np.ndarray:
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
    return np.append(ids, np.int32(EOS))


def pack_demo_rows(texts: tuple[str, ...], row_length: int) -> SampleBatch:
    """Greedily pack encoded documents into rows of ``row_length`` tokens."""
    records: list[SampleRecord] = []
    tokens: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    refs: list[ContributorRef] = []
    used = 0

    def close_row() -> None:
        nonlocal used, tokens, positions, refs
        pad = row_length - used
        tokens.append(np.full(pad, PAD, dtype=np.int32))
        positions.append(np.arange(pad, dtype=np.int32))
        first = refs[0].cursor
        meta = SampleMeta(first.sample_id, 0, first.chunk_id, first.chunk_offset,
                          {0: len(refs)}, None, (0,),
                          {PACKING_METADATA_TAG: {"padding_length": pad}})
        payload = {"input_ids": np.concatenate(tokens), "positions": np.concatenate(positions)}
        records.append(SampleRecord(meta.with_contributors(refs), payload))
        tokens, positions, refs, used = [], [], [], 0

    for offset, text in enumerate(texts):
        ids = _encode(text)[:row_length]
        if used + len(ids) > row_length:
            close_row()
        base = SampleMeta((0, 0, offset), 0, 0, offset, {0: 1})
        tokens.append(ids)
        positions.append(np.arange(len(ids), dtype=np.int32))
        refs.append(ContributorRef(base.cursor, True))
        used += len(ids)
    if refs:
        close_row()
    return SampleBatch(records)


def main(argv: list[str] | None = None) -> None:
    """Print the packed rows and their ``to_training`` tensors."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row-length", type=int, default=97,
                        help="tokens per packed row (model length + 1)")
    args = parser.parse_args(argv)
    batch = pack_demo_rows(DEFAULT_CORPUS, args.row_length)
    print(f"{len(DEFAULT_CORPUS)} documents packed into {len(batch)} rows of "
          f"{args.row_length} tokens")
    for record in batch:
        print(f"  row {record.meta.sample_id}: {len(record.meta.contributors)} documents, "
              f"padding {record.meta.padding_length}")
    out = batch.to_training(return_labels=True, return_cu_seqlens=True,
                            return_loss_mask=True, return_num_valid_tokens=True,
                            eos_mask_loss=True, eos_token_id=EOS)
    for key, value in out.items():
        if hasattr(value, "shape"):
            first = value[0].tolist() if value.dim() else value.item()
            preview = f"{first[:16]} ..." if isinstance(first, list) and len(first) > 16 else first
            print(f"{key:>16}: {tuple(value.shape)} {value.dtype}, row 0: {preview}")
        else:
            print(f"{key:>16}: {value!r}")

if __name__ == "__main__":
    main()
