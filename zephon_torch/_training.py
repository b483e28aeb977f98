"""``SampleBatch.to_training``: from records to the tensors a model eats.

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

__all__ = ["AUTO_TOKEN_FIELDS", "batch_to_training"]

#: Field names ``tokens_field="auto"`` looks for, in this order.
AUTO_TOKEN_FIELDS = ("input_ids", "tokens", "token_ids", "ids")

# Output names this function generates itself; extra fields may not shadow them.
_GENERATED = frozenset({
    "ids", "texts", "input_ids", "labels", "positions", "num_valid_tokens",
    "loss_mask", "cu_seqlens", "max_seqlen", "padding_mask",
})
_INT32_MAX = 2**31 - 1


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
) -> dict[str, Any]:
    """Implementation of :meth:`zephon_torch.types.SampleBatch.to_training`."""
    extra_fields = _validate_options(
        return_labels=return_labels, extra_fields=extra_fields,
        exclude_fields=exclude_fields, return_num_valid_tokens=return_num_valid_tokens,
        return_loss_mask=return_loss_mask, eos_mask_loss=eos_mask_loss,
        eos_token_id=eos_token_id, position_mode=position_mode,
    )
    fmt = _OutputFormat(dtype, device=device, pin_memory=pin_memory)
    if not records:
        out = _empty_output(
            position_mode=position_mode, return_num_valid_tokens=return_num_valid_tokens,
            return_loss_mask=return_loss_mask, return_cu_seqlens=return_cu_seqlens,
            return_padding_mask=return_padding_mask, flatten=flatten,
        )
        return _rename_and_exclude(out, rename_fields, exclude_fields, allow_missing=True)

    batch = _Gathered(records, tokens_field, fmt.work_dtype)
    if not batch.uniform and not flatten and fmt.kind != "list":
        raise ValueError(
            f"token rows have different lengths ({_preview(batch.lengths)}) and cannot be "
            f"stacked into one {fmt.kind} array; pack them to one length first (pack_flat), "
            "pass flatten=True to concatenate them, or dtype=None for per-row lists"
        )

    ids = [r.meta.sample_id for r in records]
    texts = [p.get("text", "") if isinstance(p, dict) else "" for p in batch.payloads]
    out: dict[str, Any] = {"ids": ids, "texts": texts}

    tokens = batch.tokens
    lengths = batch.lengths
    if return_labels:
        inputs = tokens[:, :-1]
        in_lengths = np.maximum(lengths - 1, 0)
    else:
        inputs = tokens
        in_lengths = lengths
    width = inputs.shape[1]
    # Validity of each input-aligned slot; None when every row fills the width.
    valid = None if batch.uniform else np.arange(width) < in_lengths[:, None]
    emit = _Emitter(fmt, flatten=flatten, lengths=in_lengths, valid=valid)

    padding = None
    if return_labels or return_padding_mask:
        padding = batch.padding_lengths()

    loss_mask_raw = batch.optional_field("loss_mask")
    positions_raw = None
    if position_mode == "preserve" or return_cu_seqlens:
        positions_raw = batch.optional_field("positions", required=return_cu_seqlens)

    out["input_ids"] = emit.seq(inputs)

    labels = None
    if return_labels:
        labels = _make_labels(
            tokens, lengths, padding, loss_mask_raw, inputs,
            eos_token_id if eos_mask_loss else None, ignore_index,
        )
        out["labels"] = emit.seq(labels)

    if position_mode == "sequence":
        out["positions"] = emit.seq(_sequence_positions(len(records), width, fmt.work_dtype))
    elif positions_raw is not None:
        positions = positions_raw[:, :-1] if return_labels else positions_raw
        out["positions"] = emit.seq(positions.astype(fmt.work_dtype, copy=False))

    if loss_mask_raw is not None and not return_labels:
        out["loss_mask"] = emit.seq(_cast_data_field(loss_mask_raw, fmt.work_dtype))
    for name in extra_fields:
        if name in out:  # "positions"/"loss_mask" listed although surfaced already
            continue
        values = batch.required_field(name)
        if return_labels:
            values = values[:, :-1]
        out[name] = emit.seq(_cast_data_field(values, fmt.work_dtype))

    if labels is not None and (return_num_valid_tokens or return_loss_mask):
        counted = labels != ignore_index
        if valid is not None:
            counted &= valid
        if return_num_valid_tokens:
            out["num_valid_tokens"] = int(np.count_nonzero(counted))
        if return_loss_mask:
            out["loss_mask"] = emit.seq(counted.astype(np.float32), dtype="float32")

    if return_cu_seqlens:
        assert positions_raw is not None  # required=True above raised otherwise
        positions = positions_raw[:, :-1] if return_labels else positions_raw
        cu, max_len = _cu_seqlens(positions, in_lengths, valid, flatten, batch)
        out["cu_seqlens"] = emit.fixed(cu, "int32")
        out["max_seqlen"] = max_len if flatten else emit.fixed(max_len, "int32")

    if return_padding_mask:
        assert padding is not None
        pad_start = lengths - padding
        out["padding_mask"] = emit.seq(np.arange(width) >= pad_start[:, None], dtype="bool")

    out = _rename_and_exclude(out, rename_fields, exclude_fields, allow_missing=False)
    return fmt.place(out)


# --------------------------------------------------------------------------- options


def _validate_options(
    *, return_labels: bool, extra_fields: Sequence[str], exclude_fields: Sequence[str],
    return_num_valid_tokens: bool, return_loss_mask: bool, eos_mask_loss: bool,
    eos_token_id: Any, position_mode: str,
) -> tuple[str, ...]:
    if isinstance(exclude_fields, str):
        raise TypeError(
            f"exclude_fields must be a sequence of field names, not the string "
            f"{exclude_fields!r}; write exclude_fields=({exclude_fields!r},)"
        )
    if isinstance(extra_fields, str):
        raise TypeError(
            f"extra_fields must be a sequence of field names, not the string "
            f"{extra_fields!r}; write extra_fields=({extra_fields!r},)"
        )
    extra = tuple(extra_fields)
    if position_mode not in ("preserve", "sequence"):
        raise ValueError(
            f"unknown position_mode {position_mode!r}; use 'preserve' or 'sequence'"
        )
    if eos_token_id is not None and (
        isinstance(eos_token_id, (bool, np.bool_))
        or not isinstance(eos_token_id, (int, np.integer))
        or eos_token_id < 0
    ):
        raise ValueError(f"eos_token_id must be a nonnegative integer, got {eos_token_id!r}")
    if eos_mask_loss:
        if not return_labels:
            raise ValueError("eos_mask_loss=True masks labels: it needs return_labels=True")
        if eos_token_id is None:
            raise ValueError(
                "eos_mask_loss=True needs a known EOS id: pass eos_token_id= (the id your "
                "tokenize stage appends)"
            )
    elif eos_token_id is not None:
        warnings.warn(
            f"eos_token_id={eos_token_id} was given with eos_mask_loss=False, so it has no "
            "effect; pass eos_mask_loss=True to mask predictions made from EOS",
            UserWarning, stacklevel=4,
        )
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
    for name in extra:
        shadows = name in _GENERATED and name not in ("positions", "loss_mask")
        if shadows or (name == "positions" and position_mode == "sequence"):
            raise ValueError(
                f"extra field {name!r} would overwrite the generated output field {name!r}; "
                "rename the payload field"
            )
    return extra


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
    exclude_fields: Sequence[str], *, allow_missing: bool,
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


class _OutputFormat:
    """Where the arrays end up: torch tensors, numpy arrays or Python lists."""

    def __init__(self, dtype: Any, *, device: Any, pin_memory: bool) -> None:
        self.torch = None
        self.torch_dtype = None
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
            array = array.reshape(-1) if self.valid is None else array[self.valid]
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
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _is_token_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, list, tuple)) or (
        hasattr(value, "detach") and hasattr(value, "cpu")
    )


class _Gathered:
    """Payloads of a nonempty batch, with the token rows stacked."""

    def __init__(self, records: Sequence[Any], tokens_field: str, work_dtype: np.dtype) -> None:
        self.records = records
        self.payloads = [r.payload for r in records]
        self.work_dtype = work_dtype
        field_name = self._token_field(tokens_field)
        rows = []
        for record, payload in zip(records, self.payloads):
            if isinstance(payload, dict):
                if field_name not in payload:
                    raise ValueError(
                        f"record {record.meta.sample_id} has no token field {field_name!r} "
                        f"(its fields: {sorted(payload)}); set tokens_field= to the field "
                        "holding the token ids"
                    )
                row = _as_array(payload[field_name])
            else:
                row = _as_array(payload)
            if row.ndim != 1:
                raise ValueError(
                    f"record {record.meta.sample_id}: token row has shape {row.shape}; token "
                    "rows must be 1-D sequences of ids"
                )
            if row.dtype.kind not in "iub":
                if row.size:
                    raise ValueError(
                        f"record {record.meta.sample_id}: token row holds {row.dtype} values; "
                        "token ids must be integers"
                    )
                row = row.astype(np.int64)
            rows.append(row)
        self.lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        self.uniform = bool((self.lengths == self.lengths[0]).all())
        self.tokens = self._stack(rows, work_dtype)

    def _token_field(self, tokens_field: str) -> str | None:
        first_dict = None
        for record, payload in zip(self.records, self.payloads):
            if isinstance(payload, dict):
                if first_dict is None:
                    first_dict = payload
            elif not _is_token_array(payload):
                raise TypeError(
                    f"record {record.meta.sample_id} has a payload of type "
                    f"{type(payload).__name__}; to_training needs dict payloads or 1-D arrays "
                    "of token ids (tokenize first)"
                )
        if tokens_field != "auto" or first_dict is None:
            return tokens_field
        for name in AUTO_TOKEN_FIELDS:
            if name in first_dict:
                return name
        raise ValueError(
            f"cannot detect the token field: the payload fields are {sorted(first_dict)}, "
            f"none of {list(AUTO_TOKEN_FIELDS)}; pass tokens_field= explicitly"
        )

    def _stack(self, rows: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
        if self.uniform:
            return np.stack(rows, dtype=dtype, casting="unsafe")
        out = np.zeros((len(rows), int(self.lengths.max())), dtype=dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out

    def padding_lengths(self) -> np.ndarray:
        """Per-row trailing padding from ``meta.padding_length`` (0 when absent)."""
        pads = np.zeros(len(self.records), dtype=np.int64)
        for i, record in enumerate(self.records):
            pad = record.meta.padding_length
            if pad is None:
                continue
            if not 0 <= pad <= self.lengths[i]:
                raise ValueError(
                    f"record {record.meta.sample_id}: padding_length {pad} falls outside its "
                    f"token row of length {int(self.lengths[i])}"
                )
            pads[i] = pad
        return pads

    def optional_field(self, name: str, *, required: bool = False) -> np.ndarray | None:
        """Stack ``name`` if every payload has it; None if none has it."""
        present = [isinstance(p, dict) and name in p for p in self.payloads]
        if not any(present) and not required:
            return None
        if not all(present):
            holder = self.records[present.index(False)]
            how = "some payloads but not all" if any(present) else "no payload"
            raise ValueError(
                f"{name!r} is present in {how}: record {holder.meta.sample_id} lacks it"
                + (f"; {name} matching the tokens are required in every payload"
                   if required else "")
            )
        return self.required_field(name)

    def required_field(self, name: str) -> np.ndarray:
        """Stack a per-token field that every payload must have, aligned with the tokens."""
        rows = []
        for i, (record, payload) in enumerate(zip(self.records, self.payloads)):
            if not isinstance(payload, dict) or name not in payload:
                raise ValueError(
                    f"record {record.meta.sample_id} has no field {name!r}; every payload "
                    f"needs it (requested through extra_fields or the options)"
                )
            row = _as_array(payload[name])
            if row.shape[:1] != (self.lengths[i],):
                raise ValueError(
                    f"record {record.meta.sample_id}: field {name!r} has shape {row.shape}, "
                    f"misaligned with its {int(self.lengths[i])} tokens"
                )
            rows.append(row)
        if self.uniform:
            return np.stack(rows)
        out = np.zeros((len(rows), int(self.lengths.max()), *rows[0].shape[1:]),
                       dtype=np.result_type(*rows))
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out


# --------------------------------------------------------------------------- computations


def _cast_data_field(values: np.ndarray, work_dtype: np.dtype) -> np.ndarray:
    """Integer and bool data fields take the output dtype; floats keep their own."""
    if values.dtype.kind in "iub":
        return values.astype(work_dtype, copy=False)
    return values


def _make_labels(
    tokens: np.ndarray, lengths: np.ndarray, padding: np.ndarray | None,
    loss_mask: np.ndarray | None, inputs: np.ndarray, eos_id: int | None, ignore_index: int,
) -> np.ndarray:
    labels = tokens[:, 1:].copy()
    ignored = None
    if padding is not None and padding.any():
        # Label j is token j+1: it is a pad when j + 1 >= L - padding.
        first_pad_label = lengths - padding - 1
        ignored = np.arange(labels.shape[1]) >= first_pad_label[:, None]
    if loss_mask is not None:
        unsupervised = loss_mask[:, 1:] == 0
        ignored = unsupervised if ignored is None else ignored | unsupervised
    if eos_id is not None:
        after_eos = inputs == eos_id
        ignored = after_eos if ignored is None else ignored | after_eos
    if ignored is not None:
        info = np.iinfo(labels.dtype)
        if not info.min <= ignore_index <= info.max:
            raise ValueError(
                f"ignore_index {ignore_index} does not fit the label dtype {labels.dtype}"
            )
        np.putmask(labels, ignored, ignore_index)
    return labels


def _sequence_positions(rows: int, width: int, dtype: np.dtype) -> np.ndarray:
    return np.tile(np.arange(width, dtype=dtype), (rows, 1))


def _cu_seqlens(
    positions: np.ndarray, lengths: np.ndarray, valid: np.ndarray | None, flatten: bool,
    batch: _Gathered,
) -> tuple[np.ndarray, Any]:
    """Segment boundaries from the zeros of input-aligned positions.

    Row-wise: ``[B, K]`` with each row's starts then its end, padded with the
    row's length. Flattened: the starts of all rows shifted by the row offsets,
    then the total length.
    """
    rows = positions.shape[0]
    nonempty = lengths > 0
    if positions.shape[1]:
        bad = nonempty & (positions[:, 0] != 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"cannot derive cu_seqlens: record {batch.records[i].meta.sample_id} has input "
                f"positions starting at {int(positions[i, 0])}, not 0; every nonempty row "
                "must start a segment"
            )
    total = int(lengths.sum())
    if (total if flatten else int(lengths.max(initial=0))) > _INT32_MAX:
        raise ValueError(f"cu_seqlens cannot be represented as int32 (length {total})")
    starts = positions == 0
    if valid is not None:
        starts &= valid
    row_idx, col_idx = np.nonzero(starts)
    if flatten:
        offsets = np.cumsum(lengths) - lengths
        cu = np.empty(len(col_idx) + 1, dtype=np.int32)
        cu[:-1] = col_idx + offsets[row_idx]
        cu[-1] = total
        max_len = int(np.diff(cu).max(initial=0))
        return cu, max_len
    counts = np.bincount(row_idx, minlength=rows)
    width = int(counts.max(initial=0)) + 1
    cu = np.repeat(lengths.astype(np.int32)[:, None], width, axis=1)
    first = np.cumsum(counts) - counts
    cu[row_idx, np.arange(len(row_idx)) - first[row_idx]] = col_idx
    max_len = np.diff(cu, axis=1).max(axis=1, initial=0).astype(np.int32)
    return cu, max_len
