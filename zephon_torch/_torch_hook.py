"""Make a ``Pipeline`` a torch ``IterableDataset`` without importing torch.

torch's ``DataLoader`` decides between map-style and iterable-style datasets
with ``isinstance(dataset, IterableDataset)``. ``IterableDataset`` is built
with ``ABCMeta``, so ``IterableDataset.register(Pipeline)`` makes every
pipeline pass that check as a *virtual* subclass. The catch is that
registering needs the class, and the core must never import torch (worker
processes that only run operators should not pay for it). So
:func:`install`, called once by ``zephon_torch/__init__.py``, does one of two
things:

* torch's dataset module (``torch.utils.data.dataset``, where
  ``IterableDataset`` is defined) is already imported: register now;
* otherwise: put a small finder at the front of ``sys.meta_path``. It stays
  silent for every other module; when ``torch.utils.data.dataset`` is about to
  be imported, it asks the other finders for the real spec and wraps that
  spec's ``loader.exec_module`` so that, right after the module has run, the
  registration happens and the finder removes itself.

Whatever goes wrong in the hook (an unusual loader, a torch without
``register``) leaves torch's import untouched: the hook then does nothing,
and only ``isinstance`` is affected, never the import.

Which lanes a torch ``DataLoader`` worker takes is decided in ``topology.py``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["install", "is_registered"]

_TARGET = "torch.utils.data.dataset"
_registered = False


def is_registered() -> bool:
    """Whether ``Pipeline`` is registered as a virtual ``IterableDataset``."""
    return _registered


def install() -> None:
    """Register ``Pipeline`` now if torch's data module is loaded, else on its import."""
    if _registered:
        return
    module = sys.modules.get(_TARGET)
    if module is not None and hasattr(module, "IterableDataset"):
        _register(module)
        return
    if not any(isinstance(finder, _DatasetFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DatasetFinder())


def _register(module: ModuleType) -> None:
    """Register ``Pipeline`` with the module's ``IterableDataset``; never raise."""
    global _registered
    try:
        from zephon_torch.pipeline import Pipeline

        register = getattr(getattr(module, "IterableDataset", None), "register", None)
        if callable(register):  # an ABCMeta class; a future torch might differ
            register(Pipeline)
            _registered = True
    except Exception as exc:  # a hook must never break the user's import of torch
        warnings.warn(f"zephon_torch could not register Pipeline as a torch IterableDataset "
                      f"({exc!r}); use pipe.to_torch_dataset() instead", RuntimeWarning,
                      stacklevel=2)


def _remove_finders() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _DatasetFinder)]


class _DatasetFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real spec of torch's dataset module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        _remove_finders()  # one job only; also keeps the lookup below from reaching us
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            loader = None if spec is None else spec.loader
            original = getattr(loader, "exec_module", None)
            if original is None:
                return None  # let the import machinery proceed as if we were not here

            def exec_module(module: ModuleType, _run: Any = original) -> None:
                _run(module)  # torch's own code first; its errors are its own
                _register(module)

            loader.exec_module = exec_module  # type: ignore[union-attr]
            return spec
        except Exception:
            return None

