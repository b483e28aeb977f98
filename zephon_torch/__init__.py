"""zephon_torch: a deterministic, checkpointable data pipeline for LLM training.

The core (data model, operators, sources, runners) imports numpy, tokenizers
and the standard library only; torch, torchdata, Lightning and Ray are imported
by the integration modules that need them, when they are used.
"""

import logging as _logging

from zephon_torch import _torch_hook, sources
from zephon_torch.ops.placement import Remote
from zephon_torch.pipeline import Pipeline
from zephon_torch.types import (
    ContributorRef,
    SampleBatch,
    SampleCursor,
    SampleMeta,
    SampleRecord,
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

# A library's logger stays quiet until the application configures logging.
_logging.getLogger("zephon_torch").addHandler(_logging.NullHandler())

# A pipeline passes isinstance(pipe, torch.utils.data.IterableDataset) once torch is
# imported, without this package importing torch (see _torch_hook.py).
_torch_hook.install()
