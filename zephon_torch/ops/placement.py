"""Where a stage's ``process_many`` runs: ``placement="local"`` or ``"remote"``.

``"local"`` (the default) means the pipeline's runner (inline, threads,
process). ``"remote"`` sends the stage's micro-batches to a pool of Ray
actors (``zephon_torch/runners/ray.py``), whatever the runner of the other
stages; :class:`Remote` says with what resources::

    pipe.tokenize(tok, placement="remote")                         # defaults
    pipe.tokenize(tok, placement=Remote(num_actors=16, num_cpus=2))
    pipe.apply(MyFilterModel(), placement=Remote(num_gpus=1, max_in_flight=8))

Placement is a performance choice, like the runner: it never changes the
output, so it is not part of an operator's ``config()`` (a checkpoint taken
with a remote stage resumes with a local one, and the reverse). Nothing here
imports Ray.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PLACEMENTS", "Remote", "placement_options", "set_placement", "with_placement"]

#: The placements every stage accepts.
PLACEMENTS: tuple[str, ...] = ("local", "remote")


@dataclass(frozen=True, kw_only=True)
class Remote:
    """Resources and limits of a stage placed on Ray (``placement=Remote(...)``).

    ``placement="remote"`` is ``placement=Remote()``.

    Attributes:
        num_actors: Actors holding the operator (each runs one micro-batch at
            a time). ``None``: the CPUs (or GPUs) free when the stage starts,
            shared equally between the pipeline's remote stages, at least 1.
        num_cpus: CPUs reserved by each actor.
        num_gpus: GPUs reserved by each actor.
        resources: Other Ray resources reserved by each actor
            (``{"accelerator_type:A100": 0.01}``, custom node labels).
        max_in_flight: Micro-batches of this stage that may be in Ray at once
            (queued on an actor or running); the rest wait on the driver,
            outside the object store. ``None``: twice the actors.
        max_retries: Times a micro-batch is sent again after its actor died
            (a lost worker or node); the actor is restarted each time. An
            exception raised by the operator is never retried.
    """

    num_actors: int | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    max_in_flight: int | None = None
    max_retries: int = 3

    def __post_init__(self) -> None:
        if self.num_actors is not None:
            _positive_int("num_actors", self.num_actors)
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"Remote({name}=...) must be a number >= 0, got {value!r}")
        if not isinstance(self.resources, Mapping) or any(
                not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float))
                or v < 0 for k, v in self.resources.items()):
            raise ValueError(f"Remote(resources=...) must map resource names to numbers >= 0, "
                             f"got {self.resources!r}")
        if self.max_in_flight is not None:
            _positive_int("max_in_flight", self.max_in_flight)
        if (isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int)
                or self.max_retries < 0):
            raise ValueError(f"Remote(max_retries=...) must be an integer >= 0, "
                             f"got {self.max_retries!r}")
        object.__setattr__(self, "resources", dict(self.resources))


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Remote({name}=...) must be a positive integer, got {value!r}")


def _parse(placement: Any) -> tuple[str, Remote | None]:
    if isinstance(placement, Remote):
        return "remote", placement
    if placement == "remote":
        return "remote", Remote()
    if placement == "local":
        return "local", None
    raise ValueError(
        f"placement must be one of {PLACEMENTS} or a zephon_torch.Remote(...), got "
        f"{placement!r}"
    )


def set_placement(op: Any, placement: Any) -> None:
    """Validate ``placement`` and store it on ``op`` (``placement``, ``remote_options``).

    ``op.placement`` is ``"local"`` or ``"remote"``; ``op.remote_options`` the
    :class:`Remote` options of a remote stage, else ``None``.

    Raises:
        ValueError: ``placement`` is none of the accepted values.
    """
    op.placement, op.remote_options = _parse(placement)


def with_placement(op: Any, placement: Any) -> Any:
    """A shallow copy of ``op`` placed as ``placement`` (the original is untouched)."""
    placed = copy.copy(op)
    set_placement(placed, placement)
    return placed


def placement_options(op: Any) -> Remote | None:
    """The :class:`Remote` options of a remote stage's operator, else ``None``."""
    if getattr(op, "placement", "local") != "remote":
        return None
    options = getattr(op, "remote_options", None)
    return options if isinstance(options, Remote) else Remote()
