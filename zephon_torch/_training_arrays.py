"""``to_training``'s array computations: ignored labels and segment boundaries.

Both are whole-batch array passes. Labels: label ``j`` is token ``j + 1``,
so a row of length ``L`` with ``p`` trailing pads ignores its labels from
``L - p - 1`` on, plus those where the payload's ``loss_mask`` is 0 and,
with ``eos_mask_loss``, those predicted from an EOS. ``cu_seqlens``: the
zeros of the input-aligned positions start segments; positions
``[[0, 1, 2, 0, 1]]`` give ``cu_seqlens [[0, 3, 5]]`` and ``max_seqlen
[3]`` row-wise, or ``[0, 3, 5]`` and ``3`` with ``flatten=True``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon_torch._training_rows import _LABEL_PART, _Gathered

_INT32_MAX = 2**31 - 1


def _cast_data_field(values: np.ndarray, work_dtype: np.dtype) -> np.ndarray:
    """Integer and bool data fields take the output dtype; floats keep their own."""
    if values.dtype.kind in "iub":
        return values.astype(work_dtype, copy=False)
    return values


def _make_labels(
    batch: _Gathered, labels: np.ndarray, padding: list[int] | None,
    loss_rows: list[np.ndarray] | None, inputs: np.ndarray, eos_id: int | None,
    ignore_index: int,
) -> np.ndarray:
    """Set ``ignore_index`` in ``labels`` (a fresh array, changed in place)."""
    if labels.dtype.kind in "iu" and (
        not -(2**31) <= ignore_index < 2**31 or labels.dtype.itemsize < 4
    ):
        info = np.iinfo(labels.dtype)
        if not info.min <= ignore_index <= info.max:
            raise ValueError(
                f"ignore_index {ignore_index} does not fit the label dtype {labels.dtype}"
            )
    if padding is not None:
        # Label j is token j + 1: the labels from L - padding - 1 on are pads.
        for i, (pad, length) in enumerate(zip(padding, batch.length_list)):
            if pad:
                labels[i, max(length - pad - 1, 0):] = ignore_index
    ignored = None
    if loss_rows is not None:
        ignored = batch.stack(loss_rows, _LABEL_PART) == 0
    if eos_id is not None:
        after_eos = inputs == eos_id
        ignored = after_eos if ignored is None else ignored | after_eos
    if ignored is not None:
        np.putmask(labels, ignored, ignore_index)
    return labels


def _cu_seqlens(
    positions: np.ndarray, lengths: np.ndarray, valid: np.ndarray | None, flatten: bool,
    batch: _Gathered,
) -> tuple[np.ndarray, Any]:
    """Segment boundaries from the zeros of input-aligned positions.

    Every nonempty row starts a segment, so the starts of all rows laid end to
    end, followed by the total length, are the flattened boundaries, and
    their differences are the segment lengths. Row-wise output regroups the
    starts per row, ends each row with its length and pads with it.
    """
    rows, width = positions.shape
    starts = positions == 0
    if valid is not None:
        starts &= valid
    if width and not starts[:, 0].all():
        bad = (lengths > 0) & ~starts[:, 0]
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"cannot derive cu_seqlens: record {batch.records[i].meta.sample_id} has input "
                f"positions starting at {int(positions[i, 0])}, not 0; every nonempty row "
                "must start a segment"
            )
    length_list = lengths.tolist()
    total = sum(length_list)
    if (total if flatten else max(length_list)) > _INT32_MAX:
        raise ValueError(f"cu_seqlens cannot be represented as int32 (length {total})")
    flat = np.flatnonzero(starts)  # much faster than a 2-D nonzero
    row_idx, col_idx = np.divmod(flat, max(width, 1))
    bounds = np.empty(len(flat) + 1, dtype=np.int32)
    # Uniform rows are already laid end to end in the flat index.
    bounds[:-1] = flat if valid is None else col_idx + (np.cumsum(lengths) - lengths)[row_idx]
    bounds[-1] = total
    seg_lengths = bounds[1:] - bounds[:-1]
    if flatten:
        return bounds, int(seg_lengths.max(initial=0))
    return _per_row(rows, row_idx, col_idx, seg_lengths, lengths)


def _uniform_cu_seqlens(positions: np.ndarray, lengths: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """``cu_seqlens`` and per-row maxima of rows of one width (see :func:`_cu_seqlens`)."""
    rows, width = positions.shape
    flat = np.flatnonzero(positions == 0)
    row_idx, col_idx = np.divmod(flat, max(width, 1))
    bounds_all = np.empty(len(flat) + 1, dtype=np.int32)
    bounds_all[:-1] = flat
    bounds_all[-1] = rows * width
    return _per_row(rows, row_idx, col_idx, bounds_all[1:] - bounds_all[:-1], lengths)


def _per_row(rows: int, row_idx: np.ndarray, col_idx: np.ndarray, seg_lengths: np.ndarray,
             lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise boundaries (each row's segment starts, then its length, padded with it)
    and each row's longest segment, from the starts' rows and columns."""
    counts = np.bincount(row_idx, minlength=rows)
    cu = np.empty((rows, int(counts.max(initial=0)) + 1), dtype=np.int32)
    cu[:] = lengths[:, None]
    first = counts.cumsum()
    first -= counts
    cu[row_idx, np.arange(len(row_idx)) - first[row_idx]] = col_idx
    max_len = np.zeros(rows, dtype=np.int32)
    if len(row_idx):
        has = counts > 0
        max_len[has] = np.maximum.reduceat(seg_lengths, first[has])
    return cu, max_len
