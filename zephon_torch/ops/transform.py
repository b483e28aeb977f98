"""User-function operators: ``map_transform`` and ``filter``.

Both run a user callable on each record's payload inside ``process_many``,
one micro-batch (64 records by default) at a time, and keep the record's meta
so identity and order survive:

==========================  =======================  ==============================
the callable returns        ``MapTransform``         ``Filter``
==========================  =======================  ==============================
the input payload itself    the *same* record        --
a new payload               ``SampleRecord(meta,     --
                            new)``
``None``                    tombstone ``"map_none"``  --
                            (or a ``None`` payload
                            with ``drop_none=False``)
truthy / falsy              --                       same record / tombstone
                                                     ``"filter"``
==========================  =======================  ==============================

Example::

    MapTransform(lambda p: {**p, "n": len(p["text"])})   # adds a field
    MapTransform(lambda p: p if p["lang"] == "en" else None)  # drops the rest
    Filter(lambda p: len(p["text"]) > 10)

Tombstones and flush sentinels pass through untouched, and exceptions raised
by the callable propagate unchanged (the runner re-raises them in the
consumer), so a bug in user code is never turned into silently dropped data.

Fingerprint. A checkpoint may only be resumed by the same pipeline, and for a
user function "the same" means the same code. :func:`callable_config` therefore
describes a callable by its qualified name and a hash of its compiled code
(bytecode, constants, referenced names, nested code objects, and simple
default or closure values), never by its source file or line, so moving a
function around does not invalidate checkpoints but editing it does. The
bytecode is version specific: a new Python version changes the hash.

Pickling. The operators hold nothing but the callable and a few flags, so they
travel to worker processes with ``pickle`` (module-level functions) or
``cloudpickle`` (lambdas and closures).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import is_
from types import CodeType
from typing import Any

import numpy as np

from zephon_torch.block import Block
from zephon_torch.ops.base import Element, Operator, OpTraits, live_records, tombstone
from zephon_torch.ops.placement import PLACEMENTS, set_placement
from zephon_torch.types import SampleRecord

__all__ = ["PLACEMENTS", "Filter", "MapTransform", "callable_config"]

# Values whose repr is the same in every process (no memory addresses, no
# hash-seed dependent ordering), so they may enter a fingerprint.
_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))


def _plain_repr(value: Any) -> str:
    """A process-independent description of a constant or captured value."""
    if isinstance(value, _PLAIN_TYPES):
        return repr(value)
    if isinstance(value, CodeType):
        return f"code:{_code_digest(value)}"
    if isinstance(value, (tuple, list)):
        inner = ",".join(_plain_repr(v) for v in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, frozenset):
        # The iteration order of a frozenset of strings depends on the hash
        # seed, so sort the member descriptions.
        return "frozenset(" + ",".join(sorted(_plain_repr(v) for v in value)) + ")"
    # Anything else (objects, functions) may print an address: name its type only.
    kind = type(value)
    return f"<{kind.__module__}.{kind.__qualname__}>"


def _code_digest(code: CodeType) -> str:
    h = hashlib.sha256()
    h.update(code.co_code)
    # co_names matters: ``len(p)`` and ``sum(p)`` compile to the same bytes.
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        h.update(b"\0")
        h.update(_plain_repr(const).encode())
    return h.hexdigest()


def callable_config(fn: Callable[..., Any]) -> dict[str, str]:
    """Describe a callable for a configuration fingerprint.

    Args:
        fn: A function, lambda, bound method, ``functools.partial`` or any
            callable object.

    Returns:
        ``{"name": "<module>.<qualname>", "code_sha256": "<hex>"}``. The hash
        covers the bytecode, constants, names and nested code objects, plus
        default arguments and closure values when those are plain builtins.
        A callable without ``__code__`` is described by its type (and by its
        ``__call__`` code when that is a Python function); a builtin function
        or a class by its own qualified name.
    """
    target: Any = fn
    extra: list[str] = []
    while isinstance(target, functools.partial):
        # partial's own type says nothing; its function and arguments do.
        extra.append(_plain_repr(target.args))
        extra.append(_plain_repr(sorted(target.keywords.items())))
        target = target.func
    code = getattr(target, "__code__", None)
    if isinstance(code, CodeType):
        name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"
        func = getattr(target, "__func__", target)
        extra.append(_plain_repr(getattr(func, "__defaults__", None)))
        extra.append(_plain_repr(sorted((getattr(func, "__kwdefaults__", None) or {}).items())))
        cells = getattr(func, "__closure__", None) or ()
        extra.append(_plain_repr(tuple(_cell_value(c) for c in cells)))
    elif isinstance(getattr(target, "__qualname__", None), str) and hasattr(target, "__module__"):
        # A builtin function or a class: its own name says what it does.
        name = f"{target.__module__}.{target.__qualname__}"
        code = None
    else:
        kind = type(target)
        name = f"{kind.__module__}.{kind.__qualname__}"
        call = next((vars(k)["__call__"] for k in kind.__mro__ if "__call__" in vars(k)), None)
        call_code = getattr(call, "__code__", None)
        code = call_code if isinstance(call_code, CodeType) else None
    h = hashlib.sha256()
    h.update(name.encode())
    if code is not None:
        h.update(_code_digest(code).encode())
    for part in extra:
        h.update(b"\0")
        h.update(part.encode())
    return {"name": name, "code_sha256": h.hexdigest()}


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name not yet bound)
        return None


class MapTransform(Operator):
    """Apply ``fn(payload) -> payload`` to every record, keeping its meta.

    Args:
        fn: The user function. Returning its input object unchanged reuses
            the input record as is; returning ``None`` drops the sample.
        drop_none: ``True``: a ``None`` result becomes a tombstone with reason
            ``"map_none"``. ``False``: ``None`` is kept as the payload.
        placement: ``"local"`` (run by the pipeline's runner), ``"remote"``
            or a :class:`~zephon_torch.ops.placement.Remote` (run on Ray, see
            ``docs/remote-stages.md``). Where the work runs does not change
            the output, so it is not part of :meth:`config`.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``placement`` is not ``"local"``, ``"remote"`` or a ``Remote``.
    """

    name = "map_transform"
    default_microbatch_size = 512

    def __init__(self, fn: Callable[[Any], Any], *, drop_none: bool = True,
                 placement: Any = "local") -> None:
        if not callable(fn):
            raise TypeError(f"map_transform needs a callable fn(payload) -> payload, got {fn!r}")
        set_placement(self, placement)
        self.fn = fn
        self.drop_none = bool(drop_none)

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Apply ``fn`` to each live record; sentinels and tombstones pass through."""
        fn = self.fn
        drop_none = self.drop_none
        out: list[Element] = list(elems)
        for i, rec in live_records(elems, self.name):
            payload = rec.payload
            new = fn(payload)
            if new is payload:
                # Same object back: no new record, which keeps an identity
                # map nearly free (the engine overhead benchmark relies on it).
                continue
            if new is None and drop_none:
                out[i] = tombstone(rec, "map_none")
            else:
                out[i] = SampleRecord(rec.meta, new)
        return out

    def process_block(self, block: Block) -> Block:
        """:meth:`process_many` on a block: ``fn`` on each data row's payload, no record built."""
        fn = self.fn
        payloads = block.payloads if block.payloads is not None else block.payload_list()
        # ``seen`` gets an entry for each None that fn returns (``seen.append`` returns
        # None, which stays in place): the sweep finds them as it goes, where testing
        # ``None in new`` would compare with ==, which an array payload refuses.
        seen: list[None] = []
        mark = seen.append
        if block.tomb is None:
            new = [r if (r := fn(p)) is not None else mark(r) for p in payloads]
        else:
            new = [p if dead else (r if (r := fn(p)) is not None else mark(r))
                   for p, dead in zip(payloads, block.tomb.tolist())]
        out = block.with_payloads(new)
        if self.drop_none and seen:
            none = np.fromiter(map(is_, new, repeat(None)), dtype=bool, count=len(new))
            if block.tomb is not None:
                none &= ~block.tomb
            if none.any():
                out = out.with_tombstones(none, "map_none")
        return out

    def traits(self) -> OpTraits:
        """Elementwise: consecutive elementwise stages may be fused."""
        return OpTraits(elementwise=True)

    def config(self) -> dict[str, Any]:
        """The function's name and code hash plus ``drop_none``."""
        return {**super().config(), "fn": callable_config(self.fn), "drop_none": self.drop_none}


class Filter(Operator):
    """Keep records whose payload passes ``predicate``; tombstone the rest.

    Args:
        predicate: ``predicate(payload) -> bool``. A falsy result turns the
            record into a tombstone with reason ``"filter"``; a passing record
            is forwarded as the very same object.

    Raises:
        TypeError: ``predicate`` is not callable.
    """

    name = "filter"
    default_microbatch_size = 512

    def __init__(self, predicate: Callable[[Any], Any]) -> None:
        if not callable(predicate):
            raise TypeError(f"filter needs a callable predicate(payload) -> bool, got "
                            f"{predicate!r}")
        self.predicate = predicate

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Tombstone failing records; sentinels and tombstones pass through."""
        predicate = self.predicate
        out: list[Element] = list(elems)
        for i, rec in live_records(elems, self.name):
            if not predicate(rec.payload):
                out[i] = tombstone(rec, "filter")
        return out

    def process_block(self, block: Block) -> Block:
        """:meth:`process_many` on a block: a mask of the rows that fail ``predicate``."""
        predicate = self.predicate
        payloads = block.payload_list()
        if block.tomb is None:
            keep = [bool(predicate(p)) for p in payloads]
        else:
            keep = [True if dead else bool(predicate(p))
                    for p, dead in zip(payloads, block.tomb.tolist())]
        failed = ~np.array(keep, dtype=bool)
        return block.with_tombstones(failed, "filter") if failed.any() else block

    def traits(self) -> OpTraits:
        """Elementwise: consecutive elementwise stages may be fused."""
        return OpTraits(elementwise=True)

    def config(self) -> dict[str, Any]:
        """The predicate's name and code hash."""
        return {**super().config(), "predicate": callable_config(self.predicate)}
