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
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch import _training_native as _native
from zephon_torch._pieces import PIECE_IDS, piece_ids
from zephon_torch._training_native import (
    INTEGER_TYPES,
    NativePlan,
    columns_to_training,
    kernel_enabled,
    native_plan,
)
from zephon_torch.token_ids import first_outside, id_range_error
from zephon_torch.vocab import PACKING_METADATA_TAG, find_token_field

__all__ = ["batch_to_training"]


_INT32_MAX = 2**31 - 1
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


# --------------------------------------------------------------------------- options


def _field_names(option: str, value: Any) -> tuple[str, ...]:
    """``extra_fields``/``exclude_fields`` as a tuple; a string or a non-sequence is refused."""
    if isinstance(value, str):
        raise TypeError(
            f"{option} must be a sequence of field names, not the string "
            f"{value!r}; write {option}=({value!r},)"
        )
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(
            f"{option} must be a sequence of field names, not {value!r} "
            f"({type(value).__name__}); write {option}=() for none, or e.g. "
            f"{option}=('attention_mask',)"
        ) from None


def _validate_options(
    *, return_labels: bool, extra_fields: Sequence[str], exclude_fields: Sequence[str],
    ignore_index: Any, return_num_valid_tokens: bool, return_loss_mask: bool,
    return_cu_seqlens: bool, return_padding_mask: bool, eos_mask_loss: bool,
    eos_token_id: Any, position_mode: str,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Check the options; return ``extra_fields`` and ``exclude_fields`` as tuples."""
    exclude = _field_names("exclude_fields", exclude_fields)
    extra = _field_names("extra_fields", extra_fields)
    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(
            ignore_index, (int, np.integer)):
        # A float would be truncated into integer labels (-100.5 becomes -100), and
        # True would quietly ignore every label of token id 1.
        raise TypeError(
            f"ignore_index must be an int (the label value the loss ignores, -100 by "
            f"default), got {ignore_index!r} ({type(ignore_index).__name__}); labels hold "
            "integer token ids, so pass an int such as ignore_index=-100"
        )
    if position_mode not in ("preserve", "sequence"):
        raise ValueError(
            f"unknown position_mode {position_mode!r}; use 'preserve' or 'sequence'"
        )
    _check_eos_options(False, eos_token_id, warn=False)  # a bad id is named first
    if eos_mask_loss and not return_labels:
        raise ValueError("eos_mask_loss=True masks labels: it needs return_labels=True")
    _check_eos_options(eos_mask_loss, eos_token_id, stacklevel=5)
    if return_num_valid_tokens and not return_labels:
        raise ValueError("return_num_valid_tokens=True counts labels: it needs return_labels=True")
    if return_loss_mask and not return_labels:
        raise ValueError("return_loss_mask=True is label-aligned: it needs return_labels=True")
    if return_labels and "loss_mask" in extra:
        raise ValueError(
            "'loss_mask' cannot be listed in extra_fields with return_labels=True: extra "
            "fields are input-aligned ([:, :-1]), the wrong alignment for a label mask; the "
            "payload loss_mask is applied to the labels automatically, and "
            "return_loss_mask=True returns the label-aligned mask"
        )
    generated = _generated_fields(
        return_labels=return_labels, return_num_valid_tokens=return_num_valid_tokens,
        return_cu_seqlens=return_cu_seqlens, return_padding_mask=return_padding_mask,
        position_mode=position_mode,
    )
    for name in extra:
        why = generated.get(name)
        if why is not None:
            raise ValueError(
                f"extra field {name!r} would overwrite the generated output field {name!r} "
                f"({why}); rename the payload field, or leave it out of extra_fields"
            )
    return extra, exclude


def _check_eos_options(eos_mask_loss: bool, eos_token_id: Any, *, warn: bool = True,
                       stacklevel: int = 4) -> None:
    """``eos_token_id`` is a nonnegative int, needed by ``eos_mask_loss`` and useless
    (a warning) without it."""
    if eos_token_id is not None and (
        isinstance(eos_token_id, (bool, np.bool_))
        or not isinstance(eos_token_id, (int, np.integer))
        or eos_token_id < 0
    ):
        raise ValueError(f"eos_token_id must be a nonnegative integer, got {eos_token_id!r}")
    if eos_mask_loss:
        if eos_token_id is None:
            raise ValueError(
                "eos_mask_loss=True needs a known EOS id: pass eos_token_id= (the id your "
                "tokenize stage appends)"
            )
    elif eos_token_id is not None and warn:
        warnings.warn(
            f"eos_token_id={eos_token_id} was given with eos_mask_loss=False, so it has no "
            "effect; pass eos_mask_loss=True to mask predictions made from EOS",
            UserWarning, stacklevel=stacklevel,
        )


def _generated_fields(
    *, return_labels: bool, return_num_valid_tokens: bool, return_cu_seqlens: bool,
    return_padding_mask: bool, position_mode: str,
) -> dict[str, str]:
    """The output names this call generates itself, each with the reason.

    An extra field may carry any other name: ``labels`` without
    ``return_labels`` is just a payload field. ``positions`` (in "preserve"
    mode) and a raw ``loss_mask`` (without labels) are payload fields that are
    surfaced anyway, so listing them is harmless; a label-aligned ``loss_mask``
    needs ``return_labels``, where listing it is refused earlier. Under
    ``position_mode="sequence"`` a listed ``positions`` is accepted too (as
    the reference does): the generated per-row numbering is the one output,
    never duplicated or overwritten by the payload field.
    """
    generated = {name: "always generated" for name in ("ids", "texts", "input_ids")}
    if return_labels:
        generated["labels"] = "generated because return_labels=True"
    if return_num_valid_tokens:
        generated["num_valid_tokens"] = "generated because return_num_valid_tokens=True"
    if return_cu_seqlens:
        for name in ("cu_seqlens", "max_seqlen"):
            generated[name] = "generated because return_cu_seqlens=True"
    if return_padding_mask:
        generated["padding_mask"] = "generated because return_padding_mask=True"
    return generated


def _empty_output(
    *, position_mode: str, return_num_valid_tokens: bool, return_loss_mask: bool,
    return_cu_seqlens: bool, return_padding_mask: bool, flatten: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {"ids": [], "texts": []}
    if position_mode == "sequence":
        out["positions"] = []
    if return_num_valid_tokens:
        out["num_valid_tokens"] = 0
    if return_loss_mask:
        out["loss_mask"] = []
    if return_cu_seqlens:
        out["cu_seqlens"], out["max_seqlen"] = ([0], 0) if flatten else ([], [])
    if return_padding_mask:
        out["padding_mask"] = []
    return out


def _rename_and_exclude(
    out: dict[str, Any], rename_fields: Mapping[str, str] | None,
    exclude_fields: tuple[str, ...], *, allow_missing: bool,
) -> dict[str, Any]:
    if rename_fields:
        missing = [key for key in rename_fields if key not in out]
        if missing and not allow_missing:
            raise ValueError(
                f"rename_fields names {missing[0]!r}, which is not in the output "
                f"(output fields: {sorted(out)})"
            )
        renamed: dict[str, Any] = {}
        for key, value in out.items():
            new_key = rename_fields.get(key, key)
            if new_key in renamed:
                raise ValueError(
                    f"rename_fields produces the output name {new_key!r} twice (from "
                    f"{key!r}); final names must be unique"
                )
            renamed[new_key] = value
        out = renamed
    for name in exclude_fields:
        out.pop(name, None)
    return out


# --------------------------------------------------------------------------- output format


def _torch() -> Any:
    """Return the torch module if it can be imported, else None."""
    mod = sys.modules.get("torch")
    if mod is not None:
        return mod
    try:
        import torch
    except ImportError:
        return None
    return torch


def _is_torch_dtype(value: Any) -> bool:
    kind = type(value)
    return kind.__module__ == "torch" and kind.__name__ == "dtype"


_FORMATS: dict[Any, _OutputFormat] = {}


def _output_format(dtype: Any, device: Any, pin_memory: bool) -> _OutputFormat:
    """The (cached, for the common no-device case) output format for ``dtype``."""
    if device is not None or pin_memory:
        return _OutputFormat(dtype, device=device, pin_memory=pin_memory)
    try:
        return _FORMATS[dtype]
    except KeyError:
        fmt = _FORMATS[dtype] = _OutputFormat(dtype, device=None, pin_memory=False)
        return fmt
    except TypeError:  # an unhashable dtype spec: no caching
        return _OutputFormat(dtype, device=None, pin_memory=False)


class _OutputFormat:
    """Where the arrays end up: torch tensors, numpy arrays or Python lists."""

    def __init__(self, dtype: Any, *, device: Any, pin_memory: bool) -> None:
        self.torch = None
        self.torch_dtype = None
        exact = True  # the output dtype is work_dtype itself
        if dtype is None:
            self.kind, self.work_dtype = "list", np.dtype(np.int64)
        elif isinstance(dtype, str) and dtype == "auto":
            self.torch = _torch()
            if self.torch is not None:
                self.kind, self.torch_dtype = "torch", self.torch.long
                self.work_dtype = np.dtype(np.int64)
            else:
                self.kind, self.work_dtype = "numpy", np.dtype(np.int64)
        elif _is_torch_dtype(dtype):
            self.torch = _torch()
            self.kind, self.torch_dtype = "torch", dtype
            try:
                self.work_dtype = self.torch.empty(0, dtype=dtype).numpy().dtype
            except (TypeError, RuntimeError):  # no numpy twin (e.g. bfloat16)
                self.work_dtype = np.dtype(np.int64)
                exact = False
        else:
            try:
                self.work_dtype = np.dtype(dtype)
            except TypeError as exc:
                raise ValueError(
                    f"dtype {dtype!r} is not understood; use 'auto', None (lists), a torch "
                    "dtype or a numpy dtype"
                ) from exc
            self.kind = "numpy"
        if (device is not None or pin_memory) and self.kind != "torch":
            raise ValueError(
                f"device={device!r}/pin_memory={pin_memory} place torch tensors, but "
                f"dtype={dtype!r} gives {self.kind} output; use dtype='auto' or a torch dtype"
            )
        self.device = device
        self.pin_memory = pin_memory
        #: The integer dtype the native kernel writes for this format, or None where it
        #: does not cover it (lists, other dtypes, a torch dtype numpy lacks).
        self.native_dtype = (self.work_dtype if self.kind != "list" and exact
                             and self.work_dtype in INTEGER_TYPES else None)

    def convert(self, array: np.ndarray, dtype: str | None) -> Any:
        """Turn a finished numpy array into the output kind."""
        if self.kind == "list":
            return array.tolist()
        if self.kind == "numpy":
            return array
        tensor = self.torch.from_numpy(np.ascontiguousarray(array))
        # Integer fields take the requested torch dtype even when numpy has no
        # twin for it; masks, boundaries and float fields keep their own.
        if dtype is None and array.dtype.kind in "iu" and tensor.dtype != self.torch_dtype:
            tensor = tensor.to(self.torch_dtype)
        return tensor

    def place(self, out: dict[str, Any]) -> dict[str, Any]:
        """Pin and move every tensor to the requested device."""
        if self.device is None and not self.pin_memory:
            return out
        torch = self.torch
        for key, value in out.items():
            if isinstance(value, torch.Tensor):
                if self.pin_memory:
                    value = value.pin_memory()
                if self.device is not None:
                    value = value.to(self.device, non_blocking=value.is_pinned())
                out[key] = value
        return out


class _Emitter:
    """Flattens (or splits into ragged rows) and converts finished arrays."""

    def __init__(self, fmt: _OutputFormat, *, flatten: bool, lengths: np.ndarray,
                 valid: np.ndarray | None) -> None:
        self.fmt = fmt
        self.flatten = flatten
        self.lengths = lengths
        self.valid = valid

    def seq(self, array: np.ndarray, dtype: str | None = None) -> Any:
        """Emit an input-aligned ``[B, S]`` field."""
        if self.flatten:
            if self.valid is None:
                array = array.reshape(-1, *array.shape[2:])
            else:
                array = array[self.valid]
        elif self.valid is not None:  # ragged rows: only lists get here
            return [row[:n].tolist() for row, n in zip(array, self.lengths.tolist())]
        return self.fmt.convert(array, dtype)

    def fixed(self, array: np.ndarray, dtype: str) -> Any:
        """Emit an array whose shape is already final (cu_seqlens, maxima)."""
        return self.fmt.convert(array, dtype)


# --------------------------------------------------------------------------- gathering


def _preview(values: Any, limit: int = 8) -> str:
    items = list(values[:limit]) if hasattr(values, "__getitem__") else list(values)[:limit]
    text = ", ".join(str(int(v)) for v in items)
    return text + (", ..." if len(values) > limit else "")


def _as_array(value: Any) -> np.ndarray:
    if type(value) is np.ndarray:
        return value
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _is_token_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, list, tuple)) or (
        hasattr(value, "detach") and hasattr(value, "cpu")
    )


_WHOLE = slice(None)
_INPUT_PART = slice(None, -1)
_LABEL_PART = slice(1, None)


def _text_of(record: Any, payload: Any, output_name: str) -> str:
    """A payload's ``"text"``, ``""`` where it has none (no field, None, an array payload)."""
    if not isinstance(payload, dict):
        return ""
    text = payload.get("text")
    if isinstance(text, str):  # str itself, or a subclass such as numpy.str_
        return text
    if text is None:
        return ""
    # Not a text: returning it would break the promise of a list of strings, and ""
    # would claim the record has none.
    shown = repr(text)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ValueError(
        f"record {record.meta.sample_id}: its 'text' field holds a {type(text).__name__} "
        f"({shown}), not a str; to_training returns each payload's text in "
        f"{output_name!r} ('' where it has none). Store the text as a str (decode bytes "
        f"first), or leave it out of the output with exclude_fields=({output_name!r},)"
    )


def _check_token_row(record: Any, row: np.ndarray, source: str) -> np.ndarray:
    """A token row that is not 1-D integers: refused, unless it is an empty row."""
    if row.ndim != 1:
        raise ValueError(
            f"record {record.meta.sample_id}: {source} has shape {row.shape}; token rows "
            "must be 1-D sequences of ids"
        )
    if row.size:
        # Floats would be truncated and bools read as the ids 0 and 1.
        raise ValueError(
            f"record {record.meta.sample_id}: {source} holds {row.dtype} values "
            f"({_values(row)}); token ids must be integers"
        )
    return row.astype(np.int64)  # an empty list arrives as float64


def _values(row: np.ndarray, limit: int = 4) -> str:
    """The first values of a row, for messages."""
    shown = ", ".join(repr(v) for v in row[:limit].tolist())
    return f"[{shown}{', ...' if row.size > limit else ''}]"


class _Gathered:
    """Payloads of a nonempty batch: validated per-record rows, stacked on demand.

    Rows stay per record until :meth:`stack` builds the ``[B, S]`` array of the
    part that is needed (whole rows, input part or label part) in one pass,
    already in the output dtype. This is the per-record part of the work, so
    it is written as plain, tight loops.
    """

    def __init__(self, records: Sequence[Any], tokens_field: str) -> None:
        self.records = records
        self.payloads = payloads = [r.payload for r in records]
        field_name = tokens_field
        if tokens_field == "auto" and isinstance(payloads[0], dict):
            field_name = _detect_token_field(payloads[0])
        #: Where the tokens come from, for messages: a field, or the payloads themselves.
        self.token_source = (f"token field {field_name!r}" if isinstance(payloads[0], dict)
                             else "token array")
        rows = self._fast_rows(field_name)
        if rows is None:
            rows = self._checked_token_rows(field_name)
        self.tokens = rows
        self.shapes = shapes = [r.shape for r in rows]
        self.length_list = lengths = [shape[0] for shape in shapes]
        self.lengths = np.array(lengths)
        self.uniform = min(lengths) == max(lengths)

    def _fast_rows(self, name: str) -> list[np.ndarray] | None:
        """The common case in one sweep: dict payloads holding 1-D integer arrays."""
        payloads = self.payloads
        if not all(type(p) is dict for p in payloads):
            return None
        try:
            rows = [p[name] for p in payloads]
        except KeyError:
            return None
        for row in rows:
            if type(row) is not np.ndarray or row.ndim != 1 or row.dtype.kind not in "iu":
                return None
        return rows

    def _checked_token_rows(self, field_name: str) -> list[np.ndarray]:
        """Every other case, with the checks that name the offending record."""
        records, payloads = self.records, self.payloads
        dicts = isinstance(payloads[0], dict)
        rows = []
        for record, payload in zip(records, payloads):
            if isinstance(payload, dict) != dicts and (
                    isinstance(payload, dict) or _is_token_array(payload)):
                _refuse_mixed_payloads(records[0], record)
            if isinstance(payload, dict):
                row = payload.get(field_name)
                if row is None:
                    raise ValueError(
                        f"record {record.meta.sample_id} has no token field {field_name!r} "
                        f"(its fields: {sorted(payload)}); set tokens_field= to the field "
                        "holding the token ids"
                    )
            elif _is_token_array(payload):
                row = payload
            else:
                raise TypeError(
                    f"record {record.meta.sample_id} has a payload of type "
                    f"{type(payload).__name__}; to_training needs dict payloads or 1-D arrays "
                    "of token ids (tokenize first)"
                )
            if type(row) is not np.ndarray:
                row = _as_array(row)
            if row.ndim != 1 or row.dtype.kind not in "iu":
                row = _check_token_row(record, row, self.token_source)
            rows.append(row)
        return rows

    def check_fits(self, work: np.dtype) -> None:
        """Refuse a token id the output dtype cannot hold (only where it is narrower)."""
        for record, row in zip(self.records, self.tokens):
            bounds = _narrowing(row.dtype, work)
            if bounds is not None:
                where = first_outside(row, *bounds)
                if where is not None:
                    raise _fit_error(record.meta.sample_id, int(row[where]), where, bounds,
                                     work)

    def stack(self, rows: list[np.ndarray], part: slice,
              dtype: np.dtype | None = None) -> np.ndarray:
        """Stack ``row[part]`` of every row; ragged rows are zero-padded on the right."""
        parts = rows if part is _WHOLE else [row[part] for row in rows]
        if self.uniform:
            # One C-level concatenate (with the dtype cast fused in) beats np.stack,
            # whose Python-level checks cost more than the copy at these sizes.
            shape = (len(parts), *parts[0].shape)
            if dtype is None:
                return np.concatenate(parts).reshape(shape)
            return np.concatenate(parts, dtype=dtype, casting="unsafe").reshape(shape)
        out = np.zeros((len(parts), max(len(p) for p in parts), *parts[0].shape[1:]),
                       dtype=dtype or np.result_type(*parts))
        for i, values in enumerate(parts):
            out[i, : len(values)] = values
        return out

    def shifted_tokens(self, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """Fresh ``(tokens[:, :-1], tokens[:, 1:])`` arrays for inputs and labels."""
        if not self.uniform:
            return (self.stack(self.tokens, _INPUT_PART, dtype),
                    self.stack(self.tokens, _LABEL_PART, dtype))
        # Widening once and copying twice beats two widening gathers.
        tokens = self.stack(self.tokens, _WHOLE, dtype)
        return tokens[:, :-1].copy(), tokens[:, 1:].copy()

    def padding_lengths(self) -> list[int]:
        """Per-row trailing padding from ``meta.padding_length`` (0 when absent)."""
        pads = []
        for record, length in zip(self.records, self.length_list):
            tags = record.meta.tags
            info = tags.get(PACKING_METADATA_TAG) if tags else None
            pad = None if info is None else info.get("padding_length")
            if pad is None:  # no packing metadata: no padding
                pad = 0
            elif type(pad) is not int:
                pad = _integer_padding(record, pad)
            if not 0 <= pad <= length:
                raise ValueError(
                    f"record {record.meta.sample_id}: padding_length {pad} falls outside its "
                    f"token row of length {length}"
                )
            pads.append(pad)
        return pads

    def field_rows(self, name: str, *, required: bool, scalar: bool = False,
                   integer: bool = False) -> list[np.ndarray] | None:
        """The rows of a per-token field, checked aligned with the tokens.

        Returns None when no payload has the field and it is not required; a
        field present in some payloads but not all is an error. A ``scalar``
        field (positions, a loss mask) holds exactly one value per token; other
        fields may carry trailing dimensions (``[S, D]``). An ``integer`` field
        (positions) must hold integers: stacking into the integer output dtype
        would truncate floats (and ``cu_seqlens`` would follow the truncated
        zeros) and read bools as 0 and 1.
        """
        if all(type(p) is dict for p in self.payloads):
            rows = [p.get(name) for p in self.payloads]
            if [row.shape if type(row) is np.ndarray else None for row in rows] == self.shapes:
                if integer:  # aligned arrays: only their dtypes are left to check
                    self._check_integer(name, rows)
                return rows
        rows = [p.get(name) if isinstance(p, dict) else None for p in self.payloads]
        missing = [i for i, row in enumerate(rows) if row is None]
        if missing:
            if not required and len(missing) == len(rows):
                return None
            holder = self.records[missing[0]]
            how = "every payload needs it" if required else "it is in some payloads but not all"
            raise ValueError(
                f"record {holder.meta.sample_id} has no field {name!r}; {how}"
            )
        for i, (row, tokens) in enumerate(zip(rows, self.tokens)):
            if type(row) is not np.ndarray:
                rows[i] = row = _as_array(row)
            if (row.shape if scalar else row.shape[:1]) != tokens.shape:
                expected = f"({len(tokens)},)" if scalar else f"({len(tokens)}, ...)"
                what = "one value per token" if scalar else "its first dimension one per token"
                raise ValueError(
                    f"record {self.records[i].meta.sample_id}: field {name!r} has shape "
                    f"{row.shape}, misaligned with the {self.token_source} of shape "
                    f"{tokens.shape}; it must have shape {expected}, {what}"
                )
        if integer:
            self._check_integer(name, rows)
        return rows

    def _check_integer(self, name: str, rows: list[np.ndarray]) -> None:
        """Refuse rows of ``name`` that hold anything but integers (one check per row)."""
        for i, row in enumerate(rows):
            if row.dtype.kind not in "iu" and row.size:  # an empty list arrives as float64
                raise ValueError(
                    f"record {self.records[i].meta.sample_id}: field {name!r} holds "
                    f"{row.dtype} values ({_values(row)}); {name} must be integers (each "
                    "token's index in its document, as pack_flat(emit_positions=True) "
                    "writes them), never truncated here: fix what produced them, or cast "
                    "them with .astype(np.int64) if they are whole numbers"
                )


def _narrowing(source: np.dtype, work: np.dtype) -> tuple[int, int] | None:
    """The range to check when integer ids of ``source`` become ``work`` (None: all fit)."""
    if source.kind not in "iu" or work.kind not in "iu" or np.can_cast(source, work, "safe"):
        return None
    info = np.iinfo(work)
    return int(info.min), int(info.max)


def _fit_error(sample_id: Any, value: int, position: int, bounds: tuple[int, int],
               work: np.dtype) -> ValueError:
    return id_range_error(
        f"to_training: record {sample_id}", value, position, bounds[0], bounds[1],
        f"the output dtype {work} cannot hold it, and a token id is never wrapped: use "
        "dtype='auto' (int64), or a dtype that holds your vocabulary")


def _check_column_fits(columns: Mapping[str, Any], rows: Any, tokens_field: str,
                       work: np.dtype) -> None:
    """The token column of a block's batch, checked like :meth:`_Gathered.check_fits`
    (one vectorised min/max, and only where the output dtype is narrower)."""
    name = tokens_field
    if name == "auto":
        name = next((f for f in ("input_ids", "tokens", "token_ids", "ids") if f in columns),
                    None)
    tokens = columns.get(name) if name is not None else None
    if type(tokens) is not np.ndarray or tokens.ndim != 2:
        return  # the general path gathers (and checks) the rows
    bounds = _narrowing(tokens.dtype, work)
    if bounds is None:
        return
    flat = tokens.reshape(-1)
    where = first_outside(flat, *bounds)
    if where is not None:
        row, col = divmod(where, tokens.shape[1])
        raise _fit_error(rows.sample_ids[row], int(flat[where]), col, bounds, work)


def _integer_padding(record: Any, pad: Any) -> int:
    """A ``padding_length`` that is not a plain int: a numpy integer, or an error."""
    if isinstance(pad, np.integer) or (isinstance(pad, int) and not isinstance(pad, bool)):
        return int(pad)
    raise ValueError(
        f"record {record.meta.sample_id}: padding_length {pad!r} "
        f"({type(pad).__name__}) in its packing metadata "
        f"(meta.tags[{PACKING_METADATA_TAG!r}]) is not an integer; it counts the row's "
        "trailing pad tokens (pack_flat writes an int), and is never rounded here: fix "
        "what wrote it"
    )


def _refuse_mixed_payloads(first: Any, other: Any) -> None:
    def kind(payload: Any) -> str:
        return "dict" if isinstance(payload, dict) else f"{type(payload).__name__} (an array)"

    raise TypeError(
        f"payloads are neither all dicts nor all arrays: record {first.meta.sample_id} holds "
        f"a {kind(first.payload)} and record {other.meta.sample_id} a {kind(other.payload)}; "
        "to_training reads one kind per batch, so give every record a dict payload (the "
        "token ids under one field, e.g. 'input_ids') or every record a 1-D array of token ids"
    )


def _detect_token_field(payload: dict) -> str:
    return find_token_field(payload, "auto")  # type: ignore[return-value]


# --------------------------------------------------------------------------- computations


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


# --------------------------------------------------------------------------- format="hf"

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
