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

The module also knows how a torch ``DataLoader`` worker takes its share of a
rank's lanes (:func:`worker_lanes`), which both ``Pipeline.__iter__`` and
``zephon_torch.torch.TorchIterableDataset`` use. Worker ``w`` of ``N`` takes
``rank_lanes[w::N]``; torch's loader asks its workers round-robin, so with
four lanes and two workers::

    worker 0: lanes 0, 2   -> 0 2 0 2 ...
    worker 1: lanes 1, 3   -> 1 3 1 3 ...
    loader:                -> 0 1 2 3 0 1 2 3 ...   (our own round-robin order)

as long as the lanes produce equally (a lane that ends early shifts the two
orders differently; neither duplicates nor drops anything).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["install", "is_registered", "worker_info", "worker_lanes"]

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


def worker_info() -> tuple[int, int] | None:
    """``(worker_id, num_workers)`` inside a torch DataLoader worker, else None.

    Looks only at modules already imported: a process that never imported
    torch is not a torch worker, and asking must not import torch.
    """
    data = sys.modules.get("torch.utils.data")
    get = getattr(data, "get_worker_info", None)
    if get is None:
        return None
    info = get()
    if info is None:
        return None
    return int(info.id), int(info.num_workers)


def worker_lanes(num_lanes: int, rank: int | None = None, world_size: int | None = None,
                 lanes: Sequence[int] | None = None) -> list[int] | None:
    """This torch worker's share of the rank's lanes; None outside a worker.

    Args:
        num_lanes: The pipeline's lane count.
        rank, world_size: The topology (default: detected, as ``Pipeline.iter``).
        lanes: An explicit subset of lanes for the rank.

    Returns:
        None when not in a torch DataLoader worker; otherwise the lanes
        ``rank_lanes[w::N]`` of worker ``w`` of ``N`` (empty when there are
        more workers than lanes; worker 0 warns about it then).
    """
    info = worker_info()
    if info is None:
        return None
    from zephon_torch.runners.iterator import owned_lanes, resolve_topology

    worker_id, num_workers = info
    rank, world_size = resolve_topology(rank, world_size)
    rank_lanes = owned_lanes(num_lanes, rank, world_size, lanes)
    if num_workers > len(rank_lanes) and worker_id == 0:  # one warning, not one per worker
        warnings.warn(
            f"the DataLoader has {num_workers} workers but this rank owns {len(rank_lanes)} "
            f"lane(s): {num_workers - len(rank_lanes)} worker(s) will yield nothing; use at "
            f"most {len(rank_lanes)} workers or build the pipeline with more lanes",
            RuntimeWarning, stacklevel=3,
        )
    return rank_lanes[worker_id::num_workers]
