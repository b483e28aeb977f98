"""``to_training``'s options: checked once, and the output's names settled.

:func:`_validate_options` refuses contradictory or mistyped options with a
message naming the fix (``eos_mask_loss`` without labels, a float
``ignore_index``, an extra field that would overwrite a generated one) and
returns ``extra_fields``/``exclude_fields`` as tuples; the caller keeps the
result per distinct set of options. :func:`_rename_and_exclude` is the last
step of every output: ``rename_fields={"positions": "position_ids"}`` turns
``{"input_ids": ..., "positions": ...}`` into ``{"input_ids": ...,
"position_ids": ...}``, refusing two outputs with one final name.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


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
