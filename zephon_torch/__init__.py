"""zephon_torch: a deterministic, checkpointable data pipeline for LLM training.

The core (data model, operators, sources, runners) imports numpy, tokenizers
and the standard library only; torch, torchdata, Lightning and Ray are imported
by the integration modules that need them, when they are used.
"""

import logging as _logging
from typing import Any as _Any

from zephon_torch import _torch_hook, sources
from zephon_torch._training import batch_to_training as _batch_to_training
from zephon_torch.ops.placement import Remote
from zephon_torch.pipeline import Pipeline, install_torch_dataset
from zephon_torch.types import (
    ContributorRef,
    SampleBatch,
    SampleCursor,
    SampleMeta,
    SampleRecord,
    install_training_converter,
)

__all__ = [
    "ContributorRef",
    "DataLoader",
    "Pipeline",
    "Remote",
    "SampleBatch",
    "SampleCursor",
    "SampleMeta",
    "SampleRecord",
    "__version__",
    "sources",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # zephon_torch.DataLoader lives in the torch integration: imported on first use,
    # so that `import zephon_torch` alone never imports torch.
    if name == "DataLoader":
        from zephon_torch.torch.loader import DataLoader

        globals()[name] = DataLoader  # later lookups (and pdoc) find it in the namespace
        return DataLoader
    raise AttributeError(f"module 'zephon_torch' has no attribute {name!r}")

def _torch_dataset(pipeline: Pipeline, **iter_kwargs: _Any) -> _Any:
    # The torch integration (and torch with it) is imported at the first call, so that
    # `import zephon_torch` alone never imports torch; it imports the core, never the
    # reverse, so the core reaches it only through what this root installs.
    from zephon_torch.torch.dataset import TorchIterableDataset

    return TorchIterableDataset(pipeline, **iter_kwargs)


# Lower modules declare what they need from the layers above them; the package root,
# which imports every layer, plugs those in: to_training's conversion (above the data
# model) and the torch wrapper (above the builder).
install_training_converter(_batch_to_training)
install_torch_dataset(_torch_dataset)

# A library's logger stays quiet until the application configures logging.
_logging.getLogger("zephon_torch").addHandler(_logging.NullHandler())

# A pipeline passes isinstance(pipe, torch.utils.data.IterableDataset) once torch is
# imported, without this package importing torch (see _torch_hook.py).
_torch_hook.install()
