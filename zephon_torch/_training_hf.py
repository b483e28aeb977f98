"""``to_training(format="hf")``: exactly what a transformers causal LM's ``forward`` takes.

``input_ids``, ``labels`` at the same positions (the model shifts them
itself; ``-100`` on padding, loss-mask zeros, each document's first token and
optionally after EOS), and ``position_ids`` for rows with payload positions
or an ``attention_mask`` for the others. The options this format decides
itself are refused with the reason (:data:`_HF_FIXED`). A block's packed
rows are read from its columns; records go through :class:`_Gathered`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch._training_arrays import _cast_data_field
from zephon_torch._training_format import _is_torch_dtype, _OutputFormat
from zephon_torch._training_options import _rename_and_exclude
from zephon_torch._training_rows import _WHOLE, _check_column_fits, _Gathered, _preview

#: The ``to_training`` options ``format="hf"`` decides itself, with their defaults and why
#: another value is refused.
_HF_FIXED: dict[str, tuple[Any, str]] = {
    "return_labels": (False, "labels are always returned with format='hf', at the same "
                             "positions as input_ids (a transformers model shifts them itself); "
                             "return_labels=True gives next-token labels for a loss of your own, "
                             "without format='hf'"),
    "dtype": ("auto", "a transformers model takes int64 tensors (its loss needs int64 labels)"),
    "ignore_index": (-100, "a transformers model's loss ignores -100"),
    "return_num_valid_tokens": (False, "the output holds only what the model takes; count "
                                       "(batch['labels'][:, 1:] != -100).sum() if you need it"),
    "return_loss_mask": (False, "the labels carry the mask (-100 where no loss is wanted)"),
    "return_cu_seqlens": (False, "transformers finds the documents from position_ids; pass "
                                 "flatten=True for flash attention"),
    "return_padding_mask": (False, "the output holds only what the model takes"),
    "position_mode": ("preserve", "position_ids are the payload positions (restarting in "
                                  "each document), or absent"),
}


def _hf_refusals(options: Mapping[str, Any]) -> None:
    """Refuse options that ``format="hf"`` sets itself."""
    for name, (default, why) in _HF_FIXED.items():
        value = options[name]
        same = value == default if name != "dtype" else _is_default_hf_dtype(value)
        if not same:
            raise ValueError(f"format='hf' does not take {name}={value!r}: {why}")


def _is_default_hf_dtype(dtype: Any) -> bool:
    if isinstance(dtype, str):
        return dtype == "auto"
    return _is_torch_dtype(dtype) and str(dtype) == "torch.int64"


def _hf_batch(
    records: Sequence[Any], *, tokens_field: str, extra_fields: tuple[str, ...],
    rename_fields: Mapping[str, str] | None, exclude_fields: tuple[str, ...], flatten: bool,
    eos_token_id: int | None, fmt: _OutputFormat,
) -> dict[str, Any]:
    """``to_training(format="hf")``: what a transformers causal LM's ``forward`` takes.

    ``input_ids`` are the whole rows. ``labels`` are the same tokens, with
    ``-100`` on trailing padding, where a payload ``loss_mask`` is 0, on the
    first token of every document (``positions == 0``: under per-document
    attention it would be predicted from the previous document, as
    transformers' ``DataCollatorWithFlattening`` also masks it) and, with an
    ``eos_token_id`` (``eos_mask_loss``), after each EOS. Rows with payload
    positions get ``position_ids`` and no ``attention_mask`` (transformers
    derives the per-document mask from the positions only when no
    ``attention_mask`` is given); other rows get an ``attention_mask`` (0 on
    padding). ``flatten=True`` gives one ``[1, B * S]`` row, with
    ``position_ids`` restarting in every row (or document).
    """
    if fmt.kind != "torch":
        raise ValueError(
            "format='hf' returns torch tensors, and torch cannot be imported; install torch"
        )
    if not records:
        empty = np.zeros((0, 0), dtype=np.int64)
        out = {"input_ids": empty, "labels": empty, "attention_mask": empty}
        out = {k: fmt.convert(v, None) for k, v in out.items()}
        return fmt.place(_rename_and_exclude(out, rename_fields, exclude_fields,
                                             allow_missing=True))
    gathered = _hf_from_columns(records, tokens_field, bool(extra_fields))
    if gathered is None:
        gathered = _hf_gather(records, tokens_field)
    tokens, lengths, pad, loss_rows, positions, batch = gathered
    rows, width = tokens.shape
    real = np.arange(width) < (lengths - pad)[:, None]  # neither trailing pad nor fill
    ignored = ~real
    if loss_rows is not None:
        ignored |= loss_rows == 0
    if positions is not None:
        ignored |= positions == 0
    if eos_token_id is not None and width > 1:
        ignored[:, 1:] |= tokens[:, :-1] == eos_token_id
    labels = tokens.copy()
    labels[ignored] = -100
    out: dict[str, Any] = {"input_ids": tokens, "labels": labels}
    if flatten:
        if positions is None:
            positions = np.tile(np.arange(width, dtype=np.int64), (rows, 1))
        out["position_ids"] = positions
    elif positions is not None:
        out["position_ids"] = positions
    else:
        out["attention_mask"] = real.astype(np.int64)
    for name in extra_fields:
        if name in out or name in ("positions", "loss_mask"):
            raise ValueError(
                f"extra field {name!r} is made by format='hf' itself (input_ids, labels, "
                "position_ids, attention_mask from the payload's tokens, positions and "
                "loss_mask); leave it out of extra_fields"
            )
        assert batch is not None  # extra fields always take the general path
        values = batch.stack(batch.field_rows(name, required=True), _WHOLE)
        out[name] = _cast_data_field(values, np.dtype(np.int64))
    if flatten:
        out = {k: v.reshape(1, rows * width, *v.shape[2:]) for k, v in out.items()}
    out = {k: fmt.convert(np.ascontiguousarray(v), None) for k, v in out.items()}
    out = _rename_and_exclude(out, rename_fields, exclude_fields, allow_missing=False)
    return fmt.place(out)


_HfRows = tuple[np.ndarray, np.ndarray, np.ndarray, "np.ndarray | None", "np.ndarray | None",
                "_Gathered | None"]


def _hf_from_columns(records: Any, tokens_field: str, needs_rows: bool) -> _HfRows | None:
    """Tokens, lengths, padding, loss mask and positions straight from a block's columns
    (the packed case), or None for the general path."""
    columns = getattr(records, "columns", None)
    pads = getattr(records, "padding_lengths", None)
    if columns is None or pads is None or needs_rows:
        return None
    name = tokens_field
    if name == "auto":
        name = next((f for f in ("input_ids", "tokens", "token_ids", "ids") if f in columns),
                    None)
    tokens = columns.get(name) if name is not None else None
    if type(tokens) is not np.ndarray or tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        return None
    found = []
    for field, kinds in (("loss_mask", "iubf"), ("positions", "iu")):
        values = columns.get(field)
        if values is not None and (type(values) is not np.ndarray
                                   or values.shape != tokens.shape
                                   or values.dtype.kind not in kinds):
            return None
        found.append(values)
    pad = np.asarray(pads, dtype=np.int64)
    count, width = tokens.shape
    if len(pad) != count or (count and (pad.min() < 0 or pad.max() > width)):
        return None  # the general path names the record
    loss, positions = found
    _check_column_fits(columns, records, tokens_field, np.dtype(np.int64))
    return (tokens.astype(np.int64), np.full(count, width, dtype=np.int64), pad, loss,
            None if positions is None else positions.astype(np.int64), None)


def _hf_gather(records: Sequence[Any], tokens_field: str) -> _HfRows:
    """The general path: every row validated (and named in errors) by :class:`_Gathered`."""
    batch = _Gathered(records, tokens_field)
    batch.check_fits(np.dtype(np.int64))
    tokens = batch.stack(batch.tokens, _WHOLE, np.dtype(np.int64))
    pad = np.array(batch.padding_lengths(), dtype=np.int64)
    loss_rows = batch.field_rows("loss_mask", required=False, scalar=True)
    position_rows = batch.field_rows("positions", required=False, scalar=True, integer=True)
    if position_rows is not None and not batch.uniform:
        raise ValueError(
            f"token rows have different lengths ({_preview(batch.lengths)}) and carry "
            "positions; format='hf' pads rows of different lengths with an attention_mask, "
            "which transformers does not combine with per-document position_ids: pack the "
            "rows to one length first (pack_flat)"
        )
    loss = None if loss_rows is None else batch.stack(loss_rows, _WHOLE)
    positions = (None if position_rows is None
                 else batch.stack(position_rows, _WHOLE, np.dtype(np.int64)))
    return tokens, batch.lengths.astype(np.int64), pad, loss, positions, batch
