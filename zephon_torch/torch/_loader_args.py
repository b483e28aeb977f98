"""The arguments of a :class:`~zephon_torch.torch.loader.DataLoader` and their checks.

Torch's ``DataLoader`` arguments that have no meaning here are refused with
a message that says where that choice lives (:data:`_TORCH_ONLY`); the
loader's own are checked once, when it is built, by the functions below
(the runner it resolves to, ``to_training``'s options, pinning, the timeout).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from zephon_torch.pipeline import Pipeline
from zephon_torch.runners.assembly import remote_stages
from zephon_torch.runners.options import ITER_KWARGS, check_runner
from zephon_torch.types import SampleBatch

__all__: list[str] = []

# The loader's own arguments cover these; the rest of Pipeline.iter's pass through.
_ITER_KWARGS = tuple(k for k in ITER_KWARGS
                     if k not in ("runner", "num_workers", "rank", "world_size", "epoch"))
_UNEVEN = ("stop", "continue")
# Arguments of torch's DataLoader that have no meaning here, and what to do instead.
_TORCH_ONLY = {
    "batch_size": "batching lives in the pipeline: end it with .batch(microbatch_size)",
    "collate_fn": "batches are collated by SampleBatch.to_training(); pass its options as "
                  "to_training={...}",
    "batch_sampler": "batching lives in the pipeline: end it with .batch(microbatch_size)",
    "sampler": "ranks and lanes decide who reads what; order comes from the pipeline's "
               "seeds and .shuffle()",
    "shuffle": "shuffle in the pipeline with .shuffle(buffer_size, seed=...)",
    "drop_last": "use .batch(microbatch_size, drop_last=...) in the pipeline",
    "worker_init_fn": "per-worker set-up belongs in an operator's setup(ctx)",
    "multiprocessing_context": "lane workers are forked where torch forks its own (Linux), "
                               "else spawned; set ZEPHON_LANES_START_METHOD=spawn to choose",
    "generator": "randomness is a pure function of the pipeline's seeds and the data",
    "persistent_workers": "the workers live for one iteration (one epoch)",
    "pin_memory_device": "pass device= (tensors are pinned, then copied there)",
    "in_order": "pass deterministic=False for completion order",
}


def _check_kwargs(iter_kwargs: Mapping[str, Any]) -> None:
    for name in iter_kwargs:
        if name in _TORCH_ONLY:
            raise TypeError(
                f"zephon_torch.DataLoader takes no {name!r}: {_TORCH_ONLY[name]}"
            )
        if name not in _ITER_KWARGS:
            raise TypeError(
                f"zephon_torch.DataLoader got an unexpected keyword argument {name!r}; it takes "
                f"the DataLoader options and Pipeline.iter's {list(_ITER_KWARGS)}"
            )


def _check_timeout(timeout: Any) -> float:
    """Torch's ``timeout``: seconds to wait for a batch, ``0`` for no limit."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout < 0:
        raise ValueError(
            f"timeout must be a finite number of seconds >= 0 (0: wait without limit), "
            f"got {timeout!r}"
        )
    return float(timeout)


def _resolve_runner(runner: str | None, num_workers: int, task_timeout: Any,
                    pipeline: Pipeline) -> str:
    """The runner: as given, else lane workers, else the inline runner for 0 workers.

    The stage-parallel process runner replaces lane workers where they cannot
    do the job: with ``task_timeout`` (only its pool can stop a hung
    micro-batch and send it again) and for stages placed on Ray (lane workers
    run every stage themselves).
    """
    if runner is None:
        if not num_workers:
            return "inline"
        if task_timeout is not None or remote_stages(pipeline.compile()):
            return "process"
        return "lanes"
    return check_runner(runner)


def _check_to_training(to_training: Any, pipeline: Pipeline) -> dict[str, Any] | None:
    """The keyword arguments of ``to_training`` (None: yield batches as they are)."""
    if to_training is False:
        return None
    if to_training is None or to_training is True:
        kwargs: dict[str, Any] = {}
    elif isinstance(to_training, Mapping):
        kwargs = dict(to_training)
    else:
        raise TypeError(
            f"to_training must be None (defaults), a dict of SampleBatch.to_training keyword "
            f"arguments, or False (yield SampleBatch), got {type(to_training).__name__}"
        )
    placed = sorted({"device", "pin_memory"} & set(kwargs))
    if placed:
        raise TypeError(
            f"pass {', '.join(placed)} to the DataLoader itself, not in to_training: the "
            "loader pins and copies on its prefetch thread, overlapped with the training step"
        )
    accepted = set(inspect.signature(SampleBatch.to_training).parameters) - {"self"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"to_training got unknown option(s) {unknown}; SampleBatch.to_training takes "
            f"{sorted(accepted - {'device', 'pin_memory'})}"
        )
    if not any(op.traits().produces_batches for op in pipeline.ops):
        raise ValueError(
            "this pipeline yields SampleRecord, not SampleBatch: end it with "
            ".batch(microbatch_size), or pass to_training=False to get the records"
        )
    return kwargs


def _resolve_pin(pin_memory: bool | None, device: torch.device | None) -> bool:
    is_cuda = device is not None and device.type == "cuda"
    if is_cuda and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but CUDA is not available")
    if pin_memory is None:
        return is_cuda
    if pin_memory and not torch.cuda.is_available():
        warnings.warn("pin_memory=True but CUDA is not available: tensors are not pinned",
                      UserWarning, stacklevel=3)
        return False
    return bool(pin_memory)
