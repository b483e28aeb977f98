"""``SampleBatch.to_training``: from records to the tensors a model eats.

A pipeline's batch of packed rows (a block's ``[B, S]`` columns) goes through
the compiled kernel of :mod:`zephon_torch._training_native` when it is built
and covers the case; the numpy code here is its twin and the contract, and
handles everything else (records, ragged rows, odd dtypes, every error). The
options are checked once per distinct set of options.

The work is a handful of whole-batch array passes; nothing loops over tokens.

1. Gather the token rows (a payload field, or the payload itself when it is
   a 1-D array) and stack them into ``T[B, S]`` in the output integer dtype.
   Rows of different lengths are zero-padded to ``S = max(len)`` and carried
   with their lengths ``L[B]``; only list output and ``flatten=True`` can
   express them, so other outputs reject them.
2. With labels: ``input = T[:, :-1]`` (a view) and ``labels = T[:, 1:]`` (a
   copy), then one boolean mask collects every ignored label: trailing pad
   labels (``j >= L - padding_length - 1``), loss-mask zeros
   (``mask[:, 1:] == 0``) and, with ``eos_mask_loss``, EOS inputs.
3. Positions, ``cu_seqlens`` (the zeros of the input-aligned positions plus
   each row's end) and the padding mask are computed by comparing index
   ranges with per-row thresholds.
4. The arrays become torch tensors (zero-copy ``from_numpy``), numpy arrays
   or lists, are flattened if asked, renamed, pruned, and finally moved to the
   requested device.

Worked example: a packed row ``[BOS, A, EOS, BOS, B, EOS]`` with positions
``[0, 1, 2, 0, 1, 2]`` and ``return_labels=True`` gives ``input_ids
[BOS, A, EOS, BOS, B]``, ``labels [A, EOS, BOS, B, EOS]``, positions
``[0, 1, 2, 0, 1]`` and ``cu_seqlens [0, 3, 5]``; ``eos_mask_loss`` ignores
the third label (``EOS -> BOS``).

The parts live apart: the options in :mod:`zephon_torch._training_options`,
the output kinds and dtypes in :mod:`zephon_torch._training_format`, the
per-record rows and their checks in :mod:`zephon_torch._training_rows`, the
label and ``cu_seqlens`` computations in :mod:`zephon_torch._training_arrays`,
a block's columns in :mod:`zephon_torch._training_columns` (the numpy twin of
the kernel) and ``format="hf"`` in :mod:`zephon_torch._training_hf`. This
module chooses the path once per call and assembles the general one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch import _training_native as _native
from zephon_torch._pieces import PIECE_IDS, piece_ids
from zephon_torch._training_arrays import _cast_data_field, _cu_seqlens, _make_labels
from zephon_torch._training_columns import _from_columns
from zephon_torch._training_format import _Emitter, _output_format, _OutputFormat
from zephon_torch._training_hf import _hf_batch, _hf_refusals
from zephon_torch._training_native import (
    NativePlan,
    columns_to_training,
    kernel_enabled,
    native_plan,
)
from zephon_torch._training_options import (
    _check_eos_options,
    _empty_output,
    _field_names,
    _rename_and_exclude,
    _validate_options,
)
from zephon_torch._training_rows import (
    _INPUT_PART,
    _WHOLE,
    _check_column_fits,
    _Gathered,
    _preview,
    _text_of,
)

__all__ = ["batch_to_training"]


#: Checked options and output format per distinct set of options (bounded).
_PLANS: dict[tuple[Any, ...],
             tuple[tuple[str, ...], tuple[str, ...], _OutputFormat, NativePlan | None]] = {}
_MAX_PLANS = 256


def batch_to_training(
    records: Sequence[Any],
    *,
    tokens_field: str,
    return_labels: bool,
    dtype: Any,
    extra_fields: Sequence[str],
    ignore_index: int,
    rename_fields: Mapping[str, str] | None,
    flatten: bool,
    exclude_fields: Sequence[str],
    return_num_valid_tokens: bool,
    return_loss_mask: bool,
    return_cu_seqlens: bool,
    return_padding_mask: bool,
    eos_mask_loss: bool,
    eos_token_id: int | None,
    position_mode: str,
    device: Any,
    pin_memory: bool,
    format: str | None = None,
    return_piece_ids: bool = False,
) -> dict[str, Any]:
    """Implementation of :meth:`zephon_torch.types.SampleBatch.to_training`."""
    if return_piece_ids is not False:
        return _with_piece_ids(
            records, return_piece_ids, tokens_field=tokens_field, return_labels=return_labels,
            dtype=dtype, extra_fields=extra_fields, ignore_index=ignore_index,
            rename_fields=rename_fields, flatten=flatten, exclude_fields=exclude_fields,
            return_num_valid_tokens=return_num_valid_tokens,
            return_loss_mask=return_loss_mask, return_cu_seqlens=return_cu_seqlens,
            return_padding_mask=return_padding_mask, eos_mask_loss=eos_mask_loss,
            eos_token_id=eos_token_id, position_mode=position_mode, device=device,
            pin_memory=pin_memory, format=format)
    if format is not None:
        if format != "hf":
            raise ValueError(
                f"unknown format {format!r}; use None (the options as given) or 'hf' (exactly "
                "what a transformers causal LM takes: input_ids, labels at the same "
                "positions, position_ids or attention_mask)"
            )
        _hf_refusals({
            "return_labels": return_labels, "dtype": dtype, "ignore_index": ignore_index,
            "return_num_valid_tokens": return_num_valid_tokens,
            "return_loss_mask": return_loss_mask, "return_cu_seqlens": return_cu_seqlens,
            "return_padding_mask": return_padding_mask, "position_mode": position_mode,
        })
        _check_eos_options(eos_mask_loss, eos_token_id)
        return _hf_batch(
            records, tokens_field=tokens_field,
            extra_fields=_field_names("extra_fields", extra_fields),
            rename_fields=rename_fields,
            exclude_fields=_field_names("exclude_fields", exclude_fields), flatten=flatten,
            eos_token_id=eos_token_id if eos_mask_loss else None,
            fmt=_output_format(dtype, device, pin_memory),
        )
    # The options are checked once per distinct set: the checks and the output format
    # cost as much as the native fill itself. Types are part of the key (True == 1).
    key = (return_labels, dtype, type(dtype), extra_fields, ignore_index, type(ignore_index),
           flatten, exclude_fields, return_num_valid_tokens, return_loss_mask,
           return_cu_seqlens, return_padding_mask, eos_mask_loss, eos_token_id,
           type(eos_token_id), position_mode, device, pin_memory)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable option (a list of names, say): checked every time
        plan = key = None
    if plan is None:
        extra, exclude = _validate_options(
            return_labels=return_labels, extra_fields=extra_fields,
            exclude_fields=exclude_fields, ignore_index=ignore_index,
            return_num_valid_tokens=return_num_valid_tokens,
            return_loss_mask=return_loss_mask, return_cu_seqlens=return_cu_seqlens,
            return_padding_mask=return_padding_mask, eos_mask_loss=eos_mask_loss,
            eos_token_id=eos_token_id, position_mode=position_mode,
        )
        fmt = _output_format(dtype, device, pin_memory)
        native = None
        if not extra and fmt.kind != "list":
            native = native_plan(
                fmt, return_labels=return_labels, ignore_index=ignore_index,
                return_num_valid_tokens=return_num_valid_tokens,
                return_loss_mask=return_loss_mask, return_cu_seqlens=return_cu_seqlens,
                return_padding_mask=return_padding_mask,
                eos_token_id=eos_token_id if eos_mask_loss else None,
                position_mode=position_mode, flatten=flatten)
        plan = (extra, exclude, fmt, native)
        # An eos_token_id without eos_mask_loss warns at every call, so it is not cached.
        if key is not None and len(_PLANS) < _MAX_PLANS and (
                eos_token_id is None or eos_mask_loss):
            _PLANS[key] = plan
    extra_fields, exclude_fields, fmt, native = plan
    columns = getattr(records, "columns", None)
    if columns is not None and not extra_fields and fmt.kind != "list":
        _check_column_fits(columns, records, tokens_field, fmt.work_dtype)
        enabled = _native._enabled
        if enabled is None:
            enabled = kernel_enabled()  # decided at the first call; warns if not built
        out = None
        if enabled and native is not None:
            out = columns_to_training(columns, records, tokens_field, native)
        if out is None and not flatten:
            out = _from_columns(
                columns, records, tokens_field=tokens_field, return_labels=return_labels,
                fmt=fmt, ignore_index=ignore_index,
                return_num_valid_tokens=return_num_valid_tokens,
                return_loss_mask=return_loss_mask, return_cu_seqlens=return_cu_seqlens,
                return_padding_mask=return_padding_mask,
                eos_token_id=eos_token_id if eos_mask_loss else None,
                position_mode=position_mode)
        if out is not None:
            if rename_fields or exclude_fields:
                out = _rename_and_exclude(out, rename_fields, exclude_fields,
                                          allow_missing=False)
            return out if fmt.device is None and not fmt.pin_memory else fmt.place(out)
    if not records:
        out = _empty_output(
            position_mode=position_mode, return_num_valid_tokens=return_num_valid_tokens,
            return_loss_mask=return_loss_mask, return_cu_seqlens=return_cu_seqlens,
            return_padding_mask=return_padding_mask, flatten=flatten,
        )
        return _rename_and_exclude(out, rename_fields, exclude_fields, allow_missing=True)

    batch = _Gathered(records, tokens_field)
    batch.check_fits(fmt.work_dtype)
    if not batch.uniform and not flatten and fmt.kind != "list":
        raise ValueError(
            f"token rows have different lengths ({_preview(batch.lengths)}) and cannot be "
            f"stacked into one {fmt.kind} array; pack them to one length first (pack_flat), "
            "pass flatten=True to concatenate them, or dtype=None for per-row lists"
        )

    # Texts are checked to be strings only where they are returned: a batch whose
    # texts are excluded (under their final name) need not have any.
    texts_name = rename_fields.get("texts", "texts") if rename_fields else "texts"
    out: dict[str, Any] = {
        "ids": [r.meta.sample_id for r in records],
        "texts": ([] if texts_name in exclude_fields
                  else [_text_of(r, p, texts_name) for r, p in zip(records, batch.payloads)]),
    }
    work = fmt.work_dtype
    # Input-aligned rows drop the last token when labels are made; labels drop the first.
    part = _INPUT_PART if return_labels else _WHOLE
    lengths = batch.lengths
    in_lengths = np.maximum(lengths - 1, 0) if return_labels else lengths
    if return_labels:
        inputs, label_tokens = batch.shifted_tokens(work)
    else:
        inputs, label_tokens = batch.stack(batch.tokens, _WHOLE, work), None
    width = inputs.shape[1]
    # Validity of each input-aligned slot; None when every row fills the width.
    valid = None if batch.uniform else np.arange(width) < in_lengths[:, None]
    emit = _Emitter(fmt, flatten=flatten, lengths=in_lengths, valid=valid)
    out["input_ids"] = emit.seq(inputs)

    padding = batch.padding_lengths() if return_labels or return_padding_mask else None
    loss_rows = batch.field_rows("loss_mask", required=False, scalar=True)
    position_rows = None
    if position_mode == "preserve" or return_cu_seqlens:
        position_rows = batch.field_rows("positions", required=return_cu_seqlens, scalar=True,
                                         integer=True)

    labels = None
    if return_labels:
        labels = _make_labels(
            batch, label_tokens, padding, loss_rows, inputs,
            eos_token_id if eos_mask_loss else None, ignore_index,
        )
        out["labels"] = emit.seq(labels)

    positions = None
    if position_rows is not None:
        positions = batch.stack(position_rows, part, work)
    if position_mode == "sequence":
        out["positions"] = emit.seq(np.tile(np.arange(width, dtype=work), (len(records), 1)))
    elif positions is not None:
        out["positions"] = emit.seq(positions)

    if loss_rows is not None and not return_labels:
        out["loss_mask"] = emit.seq(_cast_data_field(batch.stack(loss_rows, part), work))
    for name in extra_fields:
        if name in out:  # "positions"/"loss_mask" listed although surfaced already
            continue
        values = batch.stack(batch.field_rows(name, required=True), part)
        out[name] = emit.seq(_cast_data_field(values, work))

    if labels is not None and (return_num_valid_tokens or return_loss_mask):
        counted = labels != ignore_index
        if valid is not None:
            counted &= valid
        if return_num_valid_tokens:
            out["num_valid_tokens"] = int(np.count_nonzero(counted))
        if return_loss_mask:
            out["loss_mask"] = emit.seq(counted.astype(np.float32), dtype="float32")

    if return_cu_seqlens:
        assert positions is not None  # required=True above raised otherwise
        cu, max_len = _cu_seqlens(positions, in_lengths, valid, flatten, batch)
        out["cu_seqlens"] = emit.fixed(cu, "int32")
        out["max_seqlen"] = max_len if flatten else emit.fixed(max_len, "int32")

    if return_padding_mask:
        assert padding is not None
        pad_start = lengths - np.array(padding)
        out["padding_mask"] = emit.seq(np.arange(width) >= pad_start[:, None], dtype="bool")

    out = _rename_and_exclude(out, rename_fields, exclude_fields, allow_missing=False)
    return fmt.place(out)


def _with_piece_ids(records: Sequence[Any], flag: Any, *, format: str | None,
                    rename_fields: Mapping[str, str] | None, **options: Any) -> dict[str, Any]:
    """The output of the other options, plus ``piece_ids`` (see :mod:`zephon_torch._pieces`)."""
    if flag is not True:
        raise ValueError(f"return_piece_ids must be True or False, got {flag!r}")
    if format is not None:
        raise ValueError(
            f"format={format!r} does not take return_piece_ids=True: the model's forward "
            "takes no such argument; leave format=None to get piece_ids next to the tensors"
        )
    if PIECE_IDS in _field_names("extra_fields", options["extra_fields"]):
        raise ValueError(
            f"extra field {PIECE_IDS!r} would overwrite the generated output field "
            f"{PIECE_IDS!r} (generated because return_piece_ids=True); rename the payload "
            "field, or leave it out of extra_fields"
        )
    pieces = piece_ids(records, options["tokens_field"]) if len(records) else []
    inner = (None if rename_fields is None else
             {k: v for k, v in rename_fields.items() if k != PIECE_IDS})
    out = batch_to_training(records, rename_fields=inner, **options)
    name = rename_fields.get(PIECE_IDS, PIECE_IDS) if rename_fields else PIECE_IDS
    if name in out:
        raise ValueError(
            f"rename_fields produces the output name {name!r} twice (from {PIECE_IDS!r}); "
            "final names must be unique"
        )
    if name not in _field_names("exclude_fields", options["exclude_fields"]):
        out[name] = pieces
    return out
