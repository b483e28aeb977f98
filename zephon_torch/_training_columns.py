"""``to_training`` of a block's batch read from its columns: the numpy fast path.

A pipeline's batch of packed rows is a block whose token and position
columns are ``[B, S]`` arrays and whose padding lengths are one array;
:func:`_from_columns` builds the tensors from those whole arrays, with no
per-record work. It is the numpy twin of the compiled kernel in
:mod:`zephon_torch._training_native` (used where that kernel is not built,
is disabled, or does not cover the options) and covers the same cases only:
anything else (a payload loss mask, a column that is not a 2-D integer
array, a bad padding length) returns None, and the general path of
:mod:`zephon_torch._training`, which gives the same output and names the
offending record in its errors, takes over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch._training_arrays import _INT32_MAX, _uniform_cu_seqlens
from zephon_torch._training_format import _OutputFormat


def _from_columns(
    columns: Mapping[str, Any], rows: Sequence[Any], *, tokens_field: str, return_labels: bool,
    fmt: _OutputFormat, ignore_index: int, return_num_valid_tokens: bool,
    return_loss_mask: bool, return_cu_seqlens: bool, return_padding_mask: bool,
    eos_token_id: int | None, position_mode: str,
) -> dict[str, Any] | None:
    """The common batch, straight from its columns: packed rows as ``[B, S]`` arrays.

    ``columns`` holds the batch's payload columns (a block's fields) and
    ``rows`` gives each row's sample id and packing metadata. Anything this
    does not cover (a loss mask, uneven rows, a missing padding length, a
    column that is not a 2-D integer array) returns None, and the general
    path, which gives the same output, takes over.
    """
    name = tokens_field
    if name == "auto":
        name = next((f for f in ("input_ids", "tokens", "token_ids", "ids") if f in columns),
                    None)
    tokens = columns.get(name) if name is not None else None
    if (type(tokens) is not np.ndarray or tokens.ndim != 2 or tokens.dtype.kind not in "iu"
            or "loss_mask" in columns or (return_labels and tokens.shape[1] < 1)):
        return None
    count, width = tokens.shape
    positions = columns.get("positions")
    if positions is not None and (type(positions) is not np.ndarray
                                  or positions.shape != tokens.shape
                                  or positions.dtype.kind not in "iu"):
        return None
    pads = getattr(rows, "padding_lengths", None)
    if pads is None:
        return None
    pad = np.asarray(pads, dtype=np.int64)
    if ((return_labels or return_padding_mask) and len(pad)
            and (pad.min() < 0 or pad.max() > width)):
        return None  # the general path names the record
    work = fmt.work_dtype
    texts = columns.get("text")
    if texts is not None and not all(t is None or isinstance(t, str) for t in texts):
        return None  # the general path names the record
    out: dict[str, Any] = {
        "ids": rows.sample_ids,
        "texts": [""] * count if texts is None else ["" if t is None else t for t in texts],
    }
    convert = fmt.convert
    if return_labels:
        inputs = tokens[:, :-1].astype(work)
        labels = tokens[:, 1:].astype(work)
        in_width = width - 1
        if labels.dtype.kind in "iu":
            info = np.iinfo(labels.dtype)
            if not info.min <= ignore_index <= info.max:
                return None
        # Label j is token j + 1: a row's labels from width - pad - 1 on are pads (a
        # few slice writes, cheaper than a mask over the whole batch).
        for i, start in enumerate((width - pad - 1).tolist()):
            if start < in_width:
                labels[i, max(start, 0):] = ignore_index
        if eos_token_id is not None:
            np.putmask(labels, inputs == eos_token_id, ignore_index)
        out["input_ids"] = convert(inputs, None)
        out["labels"] = convert(labels, None)
    else:
        inputs = tokens.astype(work)
        in_width = width
        out["input_ids"] = convert(inputs, None)
        labels = None
    in_positions = None
    if positions is not None:
        in_positions = positions[:, :in_width]
    elif return_cu_seqlens:
        return None  # the general path raises the clear error
    if position_mode == "sequence":
        out["positions"] = convert(np.tile(np.arange(in_width, dtype=work), (count, 1)), None)
    elif in_positions is not None:
        out["positions"] = convert(in_positions.astype(work), None)
    if labels is not None and (return_num_valid_tokens or return_loss_mask):
        counted = labels != ignore_index
        if return_num_valid_tokens:
            out["num_valid_tokens"] = int(np.count_nonzero(counted))
        if return_loss_mask:
            out["loss_mask"] = convert(counted.astype(np.float32), "float32")
    if return_cu_seqlens:
        assert in_positions is not None
        lengths = np.full(count, in_width, dtype=np.int64)
        if in_width and not (in_positions[:, 0] == 0).all():
            return None  # the general path raises naming the record
        if in_width > _INT32_MAX:
            return None
        cu, max_len = _uniform_cu_seqlens(in_positions, lengths)
        out["cu_seqlens"] = convert(cu, "int32")
        out["max_seqlen"] = convert(max_len, "int32")
    if return_padding_mask:
        out["padding_mask"] = convert(np.arange(in_width) >= (width - pad)[:, None], "bool")
    return out
