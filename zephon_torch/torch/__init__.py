"""PyTorch integration: the dataset wrapper, the torchdata node and the loader.

Importing this package imports torch (it is an integration module); the
torchdata node and the loader are imported only when asked for, so each
costs only what it uses.
"""

from __future__ import annotations

import importlib
from typing import Any

from zephon_torch.torch.dataset import TorchIterableDataset, merged_state

__all__ = ["DataLoader", "PipelineNode", "TorchIterableDataset", "merged_state"]

# Public name -> module that defines it, imported on first access.
_LAZY = {
    "DataLoader": "zephon_torch.torch.loader",
    "PipelineNode": "zephon_torch.torch.node",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
