"""The native path of ``to_training``: a block's packed rows in one C pass.

A batch that a pipeline hands out is a view over a block whose token,
position and loss-mask columns are ``[B, S]`` arrays. For it, every output is
allocated once, empty, and filled by one call of the C kernel
(``zephon_torch/_native/training.c``), row by row: the tokens widened into
``input_ids`` and ``labels``, the ignored labels set (padding, loss mask,
EOS), the positions copied or numbered, the float loss mask and the padding
mask written, and the segment starts found for ``cu_seqlens``. A second,
small call lays the starts out as ``cu_seqlens``. Torch tensors wrap the
filled arrays (``torch.from_numpy``: no copy), or are allocated pinned when
``pin_memory=True`` and filled through their numpy view.

Example, one row ``[5, 6, 7, 8, 0]`` with positions ``[0, 1, 0, 1, 2]``, one
pad token, ``return_labels=True, return_cu_seqlens=True,
return_loss_mask=True``::

    input_ids  [5, 6, 7, 8]           tokens[:, :-1]
    labels     [6, 7, 8, -100]        tokens[:, 1:], the pad's label ignored
    positions  [0, 1, 0, 1]
    loss_mask  [1., 1., 1., 0.]
    cu_seqlens [[0, 2, 4]], max_seqlen [2]

The numpy code of :mod:`zephon_torch._training_columns` is the twin and
the general path of :mod:`zephon_torch._training` the contract: this path
covers the common case only (2-D int32/int64 columns, int32/int64 output,
no extra fields) and returns None for anything else, including every input
the twin refuses, so that errors are the twin's.
``ZEPHON_NATIVE=0`` (read once, at the first call) makes ``to_training``
use the twin throughout; without the compiled kernel the twin is used
anyway, with a one-time :class:`~zephon_torch.ops._binpack.NativeKernelWarning`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from zephon_torch.ops._binpack import native_requested, warn_kernel_missing
from zephon_torch.vocab import AUTO_TOKEN_FIELDS

try:
    from zephon_torch._native import training as _kernel
    _KERNEL_ERROR = ""
except ImportError as exc:  # no compiler at install time, or built for another Python
    _kernel = None
    _KERNEL_ERROR = str(exc)

__all__ = [
    "INTEGER_TYPES",
    "NativePlan",
    "columns_to_training",
    "kernel_available",
    "kernel_enabled",
    "native_plan",
]

#: The integer column and output types the kernel reads and writes.
INTEGER_TYPES = frozenset({np.dtype(np.int32), np.dtype(np.int64)})
_INT32_MAX = 2**31 - 1
_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), _INT32_MAX)

_enabled: bool | None = None


def kernel_available() -> bool:
    """Whether the compiled kernel was built and imports."""
    return _kernel is not None


def kernel_enabled() -> bool:
    """Whether ``to_training`` uses the compiled kernel: built, and not disabled by
    ``ZEPHON_NATIVE`` (read at the first call; a missing kernel warns once).

    Raises:
        ValueError: ``ZEPHON_NATIVE`` holds something other than 0/1 (or
            false/true, no/yes, off/on).
    """
    global _enabled
    if _enabled is None:
        enabled = native_requested()
        if enabled and _kernel is None:
            warn_kernel_missing(
                "to_training kernel", _KERNEL_ERROR,
                "to_training builds its tensors with the numpy twin: the same outputs, "
                "some 2-5x slower", stacklevel=4,
            )
            enabled = False
        _enabled = enabled
    return _enabled


class NativePlan:
    """What the kernel does for one set of validated options (built once per set).

    Build it with :func:`native_plan`; :func:`columns_to_training` applies it
    to a batch.
    """

    __slots__ = ("count_valid", "cu_seqlens", "dtype", "eos", "flags", "flatten",
                 "ignore_index", "labels", "loss_mask", "padding_mask", "pin", "positions",
                 "torch")

    def __init__(self, fmt: Any, *, return_labels: bool, ignore_index: int,
                 return_num_valid_tokens: bool, return_loss_mask: bool,
                 return_cu_seqlens: bool, return_padding_mask: bool, eos_token_id: int | None,
                 position_mode: str, flatten: bool) -> None:
        assert _kernel is not None
        self.dtype = fmt.native_dtype
        #: the torch module for tensor output, None for numpy arrays
        self.torch = fmt.torch if fmt.kind == "torch" else None
        self.pin = bool(fmt.pin_memory)
        self.labels = bool(return_labels)
        self.ignore_index = int(ignore_index) if return_labels else 0
        self.eos = 0 if eos_token_id is None else int(eos_token_id)
        sequence = position_mode == "sequence"
        #: "sequence" (numbered), "preserve" (copied when the batch has positions)
        self.positions = "sequence" if sequence else "preserve"
        self.count_valid = bool(return_num_valid_tokens)
        self.loss_mask = bool(return_loss_mask)
        self.cu_seqlens = bool(return_cu_seqlens)
        self.padding_mask = bool(return_padding_mask)
        self.flatten = bool(flatten)
        self.flags = ((_kernel.SHIFT if return_labels else 0)
                      | (_kernel.SEQUENCE_POSITIONS if sequence else 0)
                      | (_kernel.EOS if eos_token_id is not None else 0)
                      | (_kernel.COUNT_VALID if return_num_valid_tokens else 0)
                      | (_kernel.CU_SEQLENS if return_cu_seqlens else 0)
                      | (_kernel.FLATTEN if flatten else 0))


def native_plan(fmt: Any, *, return_labels: bool, ignore_index: int,
                return_num_valid_tokens: bool, return_loss_mask: bool, return_cu_seqlens: bool,
                return_padding_mask: bool, eos_token_id: int | None, position_mode: str,
                flatten: bool) -> NativePlan | None:
    """The kernel's plan for validated options (``eos_token_id`` None unless
    ``eos_mask_loss``), or None where it does not cover them: no kernel, an
    output dtype other than int32/int64, an ``ignore_index`` the labels cannot
    hold (the twin names it) or an EOS id beyond int64."""
    dtype = fmt.native_dtype
    if _kernel is None or dtype is None:
        return None
    low, high = _INT64 if dtype.itemsize == 8 else _INT32
    if return_labels and not low <= ignore_index <= high:
        return None
    if eos_token_id is not None and eos_token_id > _INT64[1]:
        return None
    return NativePlan(
        fmt, return_labels=return_labels, ignore_index=ignore_index,
        return_num_valid_tokens=return_num_valid_tokens, return_loss_mask=return_loss_mask,
        return_cu_seqlens=return_cu_seqlens, return_padding_mask=return_padding_mask,
        eos_token_id=eos_token_id, position_mode=position_mode, flatten=flatten)


def columns_to_training(columns: Mapping[str, Any], rows: Any, tokens_field: str,
                        plan: NativePlan) -> dict[str, Any] | None:
    """``to_training``'s output for a block's columns, before renaming and placing.

    ``columns`` are the block's fields and ``rows`` gives the sample ids
    (``rows.sample_ids``) and padding lengths (``rows.padding_lengths``, None
    when one is not an int). Returns None wherever the twin must decide (an
    uncovered layout or dtype, or input the twin refuses).
    """
    if tokens_field == "auto":
        tokens = columns.get("input_ids")
        if tokens is None:
            name = next((f for f in AUTO_TOKEN_FIELDS if f in columns), None)
            tokens = columns.get(name) if name is not None else None
    else:
        tokens = columns.get(tokens_field)
    if type(tokens) is not np.ndarray or tokens.ndim != 2 or tokens.dtype not in INTEGER_TYPES:
        return None
    count, width = shape = tokens.shape
    labels = plan.labels
    w = width - 1 if labels else width
    if count == 0 or w < 0 or w > _INT32_MAX:
        return None
    positions = columns.get("positions")
    if positions is not None and (type(positions) is not np.ndarray or positions.shape != shape
                                  or positions.dtype not in INTEGER_TYPES):
        return None
    flatten = plan.flatten
    if plan.cu_seqlens and (positions is None or (flatten and count * w > _INT32_MAX)):
        return None  # the twin raises the clear error
    loss = columns.get("loss_mask")
    if loss is not None:
        if (not labels or type(loss) is not np.ndarray or loss.shape != shape
                or loss.dtype.kind not in "iubf"):
            return None
        loss = np.ascontiguousarray(loss if loss.dtype.itemsize == 1 else loss != 0)
    pads = rows.padding_lengths
    if pads is None:
        return None
    texts = columns.get("text")
    if texts is not None and not all(t is None or isinstance(t, str) for t in texts):
        return None  # the twin names the record

    dtype = plan.dtype
    if plan.pin:
        alloc, wrap = _pinned(plan.torch)
    else:
        alloc, wrap = np.empty, (_same if plan.torch is None else plan.torch.from_numpy)
    out_shape = (count * w,) if flatten else (count, w)
    inputs = alloc(out_shape, dtype)
    label_out = alloc(out_shape, dtype) if labels else None
    pos_out = (alloc(out_shape, dtype)
               if positions is not None or plan.positions == "sequence" else None)
    loss_out = alloc(out_shape, np.float32) if plan.loss_mask else None
    pad_out = alloc(out_shape, np.bool_) if plan.padding_mask else None
    cu_seqlens = plan.cu_seqlens
    maxlen = alloc((count,), np.int32) if cu_seqlens and not flatten else None
    done = _kernel.fill(
        tokens if tokens.flags.c_contiguous else np.ascontiguousarray(tokens),
        None if positions is None else np.ascontiguousarray(positions), loss,
        pads if labels or plan.padding_mask else None, plan.flags, plan.ignore_index, plan.eos,
        inputs, label_out, pos_out, loss_out, pad_out, maxlen)
    if done is None:
        return None  # the twin raises the error naming the record

    out: dict[str, Any] = {
        "ids": rows.sample_ids,
        "texts": [""] * count if texts is None else ["" if t is None else t for t in texts],
        "input_ids": wrap(inputs),
    }
    if label_out is not None:
        out["labels"] = wrap(label_out)
    if pos_out is not None:
        out["positions"] = wrap(pos_out)
    if plan.count_valid:
        out["num_valid_tokens"] = done[0]
    if loss_out is not None:
        out["loss_mask"] = wrap(loss_out)
    if cu_seqlens:
        _, bounds, kmax, longest = done
        cu = np.frombuffer(bounds, dtype=np.int32)  # writable: a bytearray
        if flatten:
            out["cu_seqlens"] = wrap(cu)
            out["max_seqlen"] = longest
        else:
            out["cu_seqlens"] = wrap(cu.reshape(count, kmax + 1))
            out["max_seqlen"] = wrap(maxlen)
    if pad_out is not None:
        out["padding_mask"] = wrap(pad_out)
    return out


def _same(array: np.ndarray) -> np.ndarray:
    return array


def _pinned(torch: Any) -> tuple[Any, Any]:
    """An allocator of pinned tensors seen as numpy arrays, and the function that gives an
    array's tensor back (or wraps an array allocated otherwise).

    The tensor itself is returned, not a new one over its memory: the pinned allocator
    keeps a block from reuse until the copies that read it finish only for tensors that
    it allocated (``non_blocking`` device copies record their stream on it).
    """
    tensors: dict[int, Any] = {}

    def alloc(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        try:
            # int32, int64, float32 and bool carry the same names in torch and numpy.
            tensor = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name),
                                 pin_memory=True)
        except RuntimeError:  # no accelerator: plain memory; place() then fails as for any
            return np.empty(shape, dtype=dtype)
        array = tensor.numpy()
        tensors[id(array)] = tensor  # the arrays live as long as the call: ids are unique
        return array

    def wrap(array: np.ndarray) -> Any:
        tensor = tensors.get(id(array))
        return torch.from_numpy(array) if tensor is None else tensor

    return alloc, wrap
