"""What both packers are told and how they read a document's tokens.

The parameters of ``pack_flat`` and ``pack_sequences`` are checked here, once,
by the operators and by their accumulators (the same messages either way),
and a document's tokens are found in its payload the same way by every path:
the ``tokens_field`` named, or with ``"auto"`` the first of ``input_ids``,
``tokens``, ``token_ids`` and ``ids`` present (a bare 1-D array is its own
tokens). See :mod:`zephon_torch.ops.packing` for what the parameters mean.

Example: ``check_common(8, 2, "best_fit", "auto", 1, "split", None)`` passes;
``bfd_window=64`` with ``algorithm="first_fit"`` is refused, naming the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon_torch.types import SampleRecord
from zephon_torch.vocab import LOSS_MASK_FIELD, find_token_field

__all__ = [
    "ALGORITHMS",
    "DEFAULT_BFD_WINDOW",
    "MASK_FIELD",
    "OVERSIZED_MODES",
    "PLAN_KEY",
    "check_choice",
    "check_common",
    "check_int",
    "checked_length",
    "tokens_of",
]

#: Placement algorithms understood by both packers.
ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_decreasing")
#: Documents per ``best_fit_decreasing`` window unless ``bfd_window`` says otherwise.
DEFAULT_BFD_WINDOW = 4096
#: What to do with a document longer than ``max_length``.
OVERSIZED_MODES = ("split", "drop", "truncate")
#: Payload key of a bin plan: the list of ``(payload, start, stop)`` pieces.
PLAN_KEY = "_pack_plan"

#: A per-token payload field cut together with the tokens when a document is split.
MASK_FIELD = LOSS_MASK_FIELD

# --------------------------------------------------------------------------- validation


def check_int(name: str, value: Any, low: int, high: int | None, fix: str) -> None:
    """Refuse ``value`` unless it is an integer in ``low..high`` (``high=None``: no bound).

    Raises:
        ValueError: Naming the parameter, the bound, the value and ``fix``.
    """
    bad_type = isinstance(value, bool) or not isinstance(value, (int, np.integer))
    if bad_type or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}; {fix}")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    """Refuse ``value`` unless it is one of ``choices`` (the message lists them)."""
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"unknown {name} {value!r}; use one of {options}")


def check_common(max_length: Any, num_bins: Any, algorithm: Any, tokens_field: Any,
                 min_sequence_length: Any, oversized: Any, bfd_window: Any) -> None:
    """Check the parameters both packers (and their accumulators) take.

    Raises:
        ValueError: A parameter out of range, an unknown mode, or a
            ``bfd_window`` given to another algorithm than best-fit-decreasing.
    """
    check_int("max_length", max_length, 1, None,
              "pass the row length in tokens (the model's sequence length + 1 for pack_flat)")
    check_int("num_bins", num_bins, 1, None, "pass how many bins may be open per lane (e.g. 8)")
    check_choice("algorithm", algorithm, ALGORITHMS)
    if not isinstance(tokens_field, str) or not tokens_field:
        raise ValueError(
            f"tokens_field must be a field name or 'auto', got {tokens_field!r}"
        )
    check_int("min_sequence_length", min_sequence_length, 1, max_length,
              "it must lie between 1 and max_length (1 emits a bin only when it is full)")
    check_choice("oversized", oversized, OVERSIZED_MODES)
    if bfd_window is not None:
        if algorithm != "best_fit_decreasing":
            raise ValueError(
                f"bfd_window={bfd_window!r} applies only to algorithm='best_fit_decreasing', "
                f"not {algorithm!r}; remove it or choose that algorithm"
            )
        check_int("bfd_window", bfd_window, 1, None,
                  "pass how many documents each best-fit-decreasing window holds (e.g. 4096)")


# --------------------------------------------------------------------------- token access


def tokens_of(payload: Any, tokens_field: str) -> Any:
    """The tokens of a payload: its token field, or the payload itself when it is bare."""
    field = find_token_field(payload, tokens_field)
    return payload if field is None else payload[field]


def checked_length(record: SampleRecord, tokens_field: str) -> int:
    """Token count of a document, after checking that its tokens form a 1-D id array."""
    payload = record.payload
    try:
        tokens = tokens_of(payload, tokens_field)
    except ValueError as exc:
        raise ValueError(f"record {record.meta.sample_id}: {exc}") from None
    if isinstance(tokens, np.ndarray):
        ok = tokens.ndim == 1 and tokens.dtype.kind in "iu"
    elif hasattr(tokens, "detach") and hasattr(tokens, "dim"):  # a torch tensor
        ok = tokens.dim() == 1 and not tokens.is_floating_point()
    else:
        ok = isinstance(tokens, (list, tuple))
    if not ok:
        raise ValueError(
            f"record {record.meta.sample_id}: the tokens must be a 1-D sequence of integer "
            f"ids, got {type(tokens).__name__} {getattr(tokens, 'shape', '')}; tokenize first"
        )
    length = len(tokens)
    mask = payload.get(MASK_FIELD) if isinstance(payload, dict) else None
    if mask is not None and len(mask) != length:
        raise ValueError(
            f"record {record.meta.sample_id}: {MASK_FIELD!r} has {len(mask)} entries for "
            f"{length} tokens; it must be aligned with the tokens"
        )
    return length
