"""Token ids kept exact: the range checks made wherever an id array is narrowed.

A token id is never wrapped. ``pack_flat`` writes int32 rows, and
``to_training`` writes its output dtype (int64 under ``dtype="auto"``, or
what the caller asks for); before values are cast to a narrower type they
are checked against its range with one vectorised minimum/maximum, and a
value that does not fit is an error naming it and the record that holds it.

The packers also refuse negative ids: no vocabulary has one, ``-100`` is the
labels' ignore index, and a negative id in a packed row would become a label
the loss silently skips. ``to_training`` is a converter of what it is given
(as the reference implementation is): it passes negative ids through
untouched, and only refuses values its output dtype cannot hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["INT32_MAX", "first_outside", "id_range_error", "values_outside"]

#: The largest id an int32 row holds.
INT32_MAX = 2**31 - 1


def first_outside(values: np.ndarray, low: int | None, high: int | None) -> int | None:
    """Index of the first of 1-D integer ``values`` outside ``low..high`` (None: none is).

    ``None`` leaves that side open. A dtype whose range lies inside the bounds
    costs nothing; otherwise one pass each for the minimum and the maximum,
    and a search only when something is out of range.
    """
    if not values.size or values.dtype.kind not in "iu":
        return None
    info = np.iinfo(values.dtype)
    check_low = low is not None and info.min < low
    check_high = high is not None and info.max > high
    if check_low and values.min() < low:  # type: ignore[operator]
        bad = values < low
        if check_high:
            bad |= values > high
        return int(np.argmax(bad))
    if check_high and values.max() > high:  # type: ignore[operator]
        return int(np.argmax(values > high))
    return None


def values_outside(tokens: Any, low: int | None, high: int | None) -> tuple[int, int] | None:
    """``(index, value)`` of the first id of one row outside ``low..high`` (None: none is).

    ``tokens`` is a numpy array, a torch tensor, or a list or tuple of ints
    (Python ints may exceed any numpy type: they are compared as they are).
    """
    if isinstance(tokens, np.ndarray):
        where = first_outside(tokens.reshape(-1), low, high)
        return None if where is None else (where, int(tokens.reshape(-1)[where]))
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor
        array = tokens.detach().cpu().numpy()
        where = first_outside(array.reshape(-1), low, high)
        return None if where is None else (where, int(array.reshape(-1)[where]))
    try:
        array = np.asarray(tokens)
    except (ValueError, TypeError, OverflowError):
        array = None
    if array is not None and array.ndim == 1 and array.dtype.kind in "iu":
        where = first_outside(array, low, high)  # ids within int64: one vectorised pass
        return None if where is None else (where, int(array[where]))
    for i, value in enumerate(tokens):  # Python ints beyond int64, or a row to refuse later
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and (
                (low is not None and value < low) or (high is not None and value > high)):
            return i, int(value)
    return None


def id_range_error(what: str, value: int, position: int, low: int | None, high: int | None,
                   why: str, where: str = "") -> ValueError:
    """The error for an id outside ``low..high``: the value, where it is, and what to do."""
    if low is None:
        bounds = f"above {high}"
    elif high is None:
        bounds = f"below {low}"
    else:
        bounds = f"outside {low}..{high}"
    return ValueError(
        f"{what}{where}: token id {value} at position {position} is {bounds}; {why}; "
        "fix the data (or the tokenizer that wrote it)"
    )
