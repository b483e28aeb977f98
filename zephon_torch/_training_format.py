"""``to_training``'s output kinds: torch tensors, numpy arrays or lists, and their dtypes.

``dtype`` picks the kind and the integer dtype the work is done in
(``"auto"``: int64 torch tensors, or numpy where torch is missing; ``None``:
lists; a torch or numpy dtype: that one). :class:`_OutputFormat` turns a
finished numpy array into the output kind (zero-copy ``from_numpy`` for torch)
and finally pins and moves tensors to the requested device;
:class:`_Emitter` flattens or splits ragged rows first. Torch is imported
only when an output asks for it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from zephon_torch._training_native import INTEGER_TYPES


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
