"""The format interface and the registry of source formats.

A source format is a kind of dataset that can be named from a path: JSONL
files, Parquet files, text files, or an in-memory list. Each one lives in a
module of this package that builds its :class:`~zephon_torch.sources.base.Dataset`
class and registers one :class:`SourceFormat`, which says everything the rest
of the package needs to know about it:

* ``factory``: the ``zt.sources.<name>`` function that makes a dataset;
* ``builder``: the ``Pipeline.from_<name>`` class method that reads it alone;
* ``command_line``: how ``zephon-torch inspect`` names it (``--format``),
  finds its files in a folder and recognises it from a path or glob.

The command line builds its ``--format`` choices, folder search and messages
from the registry (:func:`command_line_formats`), so a new format is one
module that calls :func:`register`, imported by ``formats/__init__.py`` for
a built-in one. For example, a format of CSV files, one row a sample,
would end its module with::

    register(SourceFormat(name="csv", factory=csv_rows, builder=None,
                          command_line=CommandLineFormat(name="csv", label="CSV",
                                                         suffixes=(".csv",),
                                                         endings=(".csv",))))

and ``zephon-torch inspect data/*.csv`` would read it. A format without a
builder is read with ``Pipeline.from_sources([csv_rows(paths)])``; one that
names a builder the ``Pipeline`` class does not write out
(``builder="from_csv"``) gets it derived from its factory: the factory's
parameters (less ``component_id``, ``name`` and ``passes``), then the
source options (``zephon_torch/pipeline_sources.py``, ``derived_builder``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zephon_torch.sources.base import Dataset

__all__ = [
    "CommandLineFormat",
    "SourceFormat",
    "command_line_formats",
    "format_named",
    "on_register",
    "register",
    "registered_formats",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class CommandLineFormat:
    """How ``zephon-torch inspect`` names a format and finds its files.

    Attributes:
        name: The ``--format`` value (``"text"`` for text files).
        label: The format's name in messages (``"JSONL"``).
        suffixes: File name endings a folder argument is searched for
            (lower case); the first one is shown as an example.
        marks: Pieces of a path or glob that name the format wherever they
            stand (``".parquet"`` in ``"x.parquet.tmp"``).
        endings: Endings of a path or glob that name the format.
        rank: Formats are asked in rising rank whether a path names them;
            the first that says yes is the path's format.
    """

    name: str
    label: str
    suffixes: tuple[str, ...]
    marks: tuple[str, ...] = ()
    endings: tuple[str, ...] = ()
    rank: int = 0

    def names(self, pattern: str) -> bool:
        """Whether a path or glob (lower case) names this format by its extension."""
        return any(mark in pattern for mark in self.marks) or pattern.endswith(self.endings)


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceFormat:
    """One source format: how to make its dataset, and how users name it.

    Attributes:
        name: The registry key and the dataset's ``kind`` (``"jsonl"``).
        factory: Makes the dataset from paths (or items) and the format's
            own keyword options, such as ``zt.sources.jsonl``.
        builder: The name of the ``Pipeline`` class method that reads this
            format alone (``"from_jsonl"``), or None. Where the class has
            no method of that name, one is derived from ``factory``.
        command_line: How the command line names it; None: it cannot be
            named there (in-memory items).
    """

    name: str
    factory: Callable[..., Dataset]
    builder: str | None = None
    command_line: CommandLineFormat | None = None

    def open(self, what: Any, **options: Any) -> Dataset:
        """The dataset of ``what`` (paths, or items), with the format's options."""
        return self.factory(what, **options)


_REGISTRY: dict[str, SourceFormat] = {}
_LISTENERS: list[Callable[[SourceFormat], None]] = []


def register(source_format: SourceFormat) -> SourceFormat:
    """Add a format to the registry (once per name); returns it.

    Raises:
        ValueError: Another format has this name, or the same command-line name.
    """
    name = source_format.name
    if name in _REGISTRY and _REGISTRY[name] != source_format:
        raise ValueError(f"a source format named {name!r} is already registered")
    cli = source_format.command_line
    if cli is not None and any(
            other.command_line is not None and other.command_line.name == cli.name
            and other.name != name for other in _REGISTRY.values()):
        raise ValueError(f"a source format is already named {cli.name!r} on the command line")
    _REGISTRY[name] = source_format
    for listener in _LISTENERS:
        listener(source_format)
    return source_format


def on_register(listener: Callable[[SourceFormat], None]) -> None:
    """Call ``listener`` with every format registered, now and from now on.

    This is how an upper floor learns of formats without the registry
    importing it: the builder derives ``Pipeline.from_<name>`` for a format
    that names a builder it does not have written out.
    """
    _LISTENERS.append(listener)
    for source_format in tuple(_REGISTRY.values()):
        listener(source_format)


def registered_formats() -> tuple[SourceFormat, ...]:
    """Every registered format, in the order they were registered."""
    return tuple(_REGISTRY.values())


def format_named(name: str) -> SourceFormat:
    """The registered format of this name.

    Raises:
        KeyError: No format has this name (the message lists those that do).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no source format is named {name!r}; registered: "
                       f"{sorted(_REGISTRY)}") from None


def command_line_formats() -> dict[str, SourceFormat]:
    """The formats the command line can name, by ``--format`` value, sorted by it."""
    named = {f.command_line.name: f for f in _REGISTRY.values() if f.command_line is not None}
    return dict(sorted(named.items()))
