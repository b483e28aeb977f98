"""The source options: how every ``Pipeline.from_*`` reads and deals its samples.

:class:`SourceOptions` is the one place the seven options are defined,
defaulted, checked and documented. Each builder takes them as
``**options: Unpack[SourceKwargs]`` (:class:`SourceKwargs`, so that a type
checker knows them), and ``zephon_torch.pipeline_sources.source_builder``
spells them out in the builder's run-time signature with these defaults (so
``help()`` and an IDE show them) and fills in its docstring entries for them
from here::

    @source_builder
    def from_jsonl(cls, paths, *, on_error="raise", **options):
        '''...
        Args:
            paths: ...
            on_error: ...
        '''
        return _from_format(cls, "jsonl", paths, options, on_error=on_error)

``document_source_options`` fills in ``num_lanes`` ... ``exhausted`` under
``Args:`` in the order of the signature, using the text of the attributes
below, unless the builder documents one itself (``from_items`` says its own
word on ``shuffle``, whose default differs).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypedDict, TypeVar

__all__ = ["SOURCE_OPTION_NAMES", "SourceKwargs", "SourceOptions", "document_source_options"]

_POSITIVE_HINTS = {
    "num_lanes": "it is the unit of parallelism: use at least the world size you start on "
                 "(8 is the default; a resume can grow it, Pipeline.change_lanes)",
    "chunk_size": "it is the number of samples a lane reads at a time (512 is the default)",
    "passes": "use a count of trips over the data, or None to repeat forever",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(name: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; "
                         f"{_POSITIVE_HINTS[name]}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceOptions:
    """How the samples of the sources are read and dealt to lanes.

    Every ``Pipeline.from_*`` takes these as keyword arguments, with these
    defaults (``from_items`` keeps its items' order: ``shuffle=False``).

    Attributes:
        num_lanes: Lanes the samples are dealt to. A lane is the unit of
            parallelism and of checkpoints: use at least the world size you
            start on; a resume on more ranks grows them from its step on
            (``Pipeline.change_lanes``).
        chunk_size: Samples a lane reads at a time (the unit of the work
            schedule).
        seed: Seed of the read order: the order of the shards, read
            blocks and samples of each pass. ``shuffle()`` has a seed of
            its own.
        flush_every_k_chunks: Chunks per lane between two flush sentinels,
            which bound what reordering stages (packing, shuffle, mixture)
            hold at a checkpoint. ``None``: 8 when a stage reorders
            records, else 0 (no sentinels).
        passes: Trips over the data; ``None`` repeats forever. A dataset's
            own ``passes`` overrides it.
        shuffle: Read each pass in a seeded order (shards, read blocks and
            the samples within them), reshuffled every pass; ``False``
            keeps file order.
        exhausted: ``"repeat"``: a dataset that runs out starts another
            pass, reshuffled, until every dataset has finished its passes;
            ``"stop"``: the stream ends when the first one runs out.

    Raises:
        ValueError: An option out of range; the message names the value and
            what to pass instead.

    Example:
        >>> SourceOptions(num_lanes=2).chunk_size
        512
        >>> SourceOptions(num_lanes=0)
        Traceback (most recent call last):
        ...
        ValueError: num_lanes must be a positive integer, got 0; it is the unit of ...
    """

    num_lanes: int = 8
    chunk_size: int = 512
    seed: int = 0
    flush_every_k_chunks: int | None = None
    passes: int | None = 1
    shuffle: bool = True
    exhausted: str = "repeat"

    def __post_init__(self) -> None:
        _check_positive("num_lanes", self.num_lanes)
        _check_positive("chunk_size", self.chunk_size)
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        flush = self.flush_every_k_chunks
        if flush is not None and (not isinstance(flush, int) or flush < 0):
            raise ValueError(f"flush_every_k_chunks must be None (automatic), 0 (no sentinels) "
                             f"or a positive integer, got {flush!r}")
        if self.passes is not None:
            _check_positive("passes", self.passes)
        if self.exhausted not in ("repeat", "stop"):
            raise ValueError(f"exhausted must be 'repeat' or 'stop', got {self.exhausted!r}")

    @staticmethod
    def collect(arguments: Mapping[str, Any]) -> SourceOptions:
        """The options among a builder's arguments (its ``locals()``), checked."""
        return SourceOptions(**{name: arguments[name] for name in SOURCE_OPTION_NAMES})

    def as_dict(self) -> dict[str, Any]:
        """The source options (only those) as keyword arguments, by name."""
        return {name: getattr(self, name) for name in SOURCE_OPTION_NAMES}


#: The names of the source options, in their order (``SourceConfig`` adds its own fields).
SOURCE_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SourceOptions))


class SourceKwargs(TypedDict, total=False):
    """The source options as keyword arguments, for static type checkers.

    The builders take them as ``**options: Unpack[SourceKwargs]``; at run
    time their signatures list them one by one, with :class:`SourceOptions`'
    defaults (a test holds the two to the same names and types).
    """

    num_lanes: int
    chunk_size: int
    seed: int
    flush_every_k_chunks: int | None
    passes: int | None
    shuffle: bool
    exhausted: str

_ENTRY = re.compile(r"^    (\w+):")


def _entries(block: str) -> dict[str, str]:
    """The entries of a Google-style ``Args:``/``Attributes:`` block, by name."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in block.splitlines():
        match = _ENTRY.match(line)
        if match:
            current = found.setdefault(match.group(1), [])
        if current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in found.items()}


def _section(doc: str, title: str) -> tuple[int, int]:
    """Where the block under ``title:`` starts and ends (its first blank line)."""
    head = doc.index(f"\n{title}:\n") + len(title) + 3
    end = doc.find("\n\n", head)
    return head, len(doc) if end < 0 else end


def _option_docs() -> dict[str, str]:
    doc = inspect.cleandoc(SourceOptions.__doc__ or "")
    start, end = _section(doc, "Attributes")
    return _entries(doc[start:end])


F = TypeVar("F", bound=Callable[..., Any])


def document_source_options(fn: F) -> F:
    """Fill in a builder's ``Args:`` entries for the source options.

    The entries follow the order of ``fn``'s parameters; those ``fn``
    documents itself are kept as they are.

    Raises:
        ValueError: At import, a parameter of ``fn`` that is neither
            documented nor a source option, or an entry for no parameter.
    """
    doc = inspect.cleandoc(fn.__doc__ or "")
    start, end = _section(doc, "Args")
    own = _entries(doc[start:end])
    shared = _option_docs()
    names = [p for p in inspect.signature(fn).parameters if p not in ("cls", "self")]
    missing = [n for n in names if n not in own and n not in shared]
    unknown = [n for n in own if n not in names]
    if missing or unknown:
        raise ValueError(f"{fn.__qualname__}: parameters {missing} are not documented, "
                         f"entries {unknown} name no parameter")
    block = "\n".join(own.get(n) or shared[n] for n in names)
    fn.__doc__ = doc[:start] + block + doc[end:]
    return fn
