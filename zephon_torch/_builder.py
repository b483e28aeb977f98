"""What the ``Pipeline`` methods written outside its class share.

The builder's class, :class:`~zephon_torch.pipeline.Pipeline`, binds in its
body the source entry points (``zephon_torch/pipeline_sources.py``) and the
operator builders (``zephon_torch/pipeline_operators.py``). Each is written
as a function over ``cls`` or ``self`` and marked here as a ``Pipeline``
method, so that Python's own messages name it as one
(``Pipeline.pack_flat() takes 2 positional arguments ...``). Their defaults
come from :func:`defaults_of`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import MISSING, fields
from types import SimpleNamespace
from typing import Any, TypeVar

__all__ = ["defaults_of", "pipeline_class_method", "pipeline_method"]

F = TypeVar("F", bound=Callable[..., Any])


def defaults_of(of: Callable[..., Any]) -> SimpleNamespace:
    """The parameter defaults of ``of`` (a class: of its ``__init__``), by name.

    The builders take their defaults from here: an operator's ``__init__``
    (or a source's constructor, or ``SourceConfig``) is the one place a
    default is written, so a builder cannot drift from it.
    """
    if isinstance(of, type) and hasattr(of, "__dataclass_fields__"):
        return SimpleNamespace(**{f.name: f.default for f in fields(of)
                                  if f.default is not MISSING})
    params = inspect.signature(of).parameters.values()
    return SimpleNamespace(**{p.name: p.default for p in params if p.default is not p.empty})


def pipeline_method(fn: F) -> F:
    """``fn``, a method of ``Pipeline`` written outside the class, named as one.

    Its qualified name becomes ``Pipeline.<name>``, as for the methods
    written in the class.
    """
    fn.__qualname__ = f"Pipeline.{fn.__name__}"
    return fn


def pipeline_class_method(fn: Callable[..., Any]) -> classmethod[Any, Any, Any]:
    """``fn`` (its first parameter ``cls``) as a class method of ``Pipeline``, named as one."""
    return classmethod(pipeline_method(fn))
