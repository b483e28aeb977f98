"""The source entry points of the builder: ``Pipeline.from_*`` and :class:`SourceConfig`.

A pipeline starts from a :class:`SourceConfig`: the datasets, their weights
and the source options (:class:`~zephon_torch.sources.SourceOptions`). The
class methods that build one, ``from_sources`` for a mixture and one
``from_<format>`` for each registered format that names a builder
(``sources/formats/registry.py``), are written here and bound into
:class:`~zephon_torch.pipeline.Pipeline`'s body, so they read
``Pipeline.from_jsonl(...)`` in ``help()``, in error messages and in the API
reference, as the rest of the class does (``zephon_torch/_builder.py``).

Each builder takes the source options (``num_lanes`` ... ``exhausted``) as
``**options: Unpack[SourceKwargs]``, so a type checker knows them and no
builder writes them out again; :func:`source_builder` spells them out in its
run-time signature, with :class:`~zephon_torch.sources.SourceOptions`'
defaults, so that an IDE and ``help()`` show them, and fills in their
docstring entries. A format's own options, and their defaults, are those of
its factory (``zt.sources.<format>``).

A format registered with a builder name the class does not write out gets
that builder derived from its factory (:func:`derived_builder`): the same
parameters in the same order as a written one, so a new format is one
module; a test holds the written builders to what would be derived.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from zephon_torch._builder import defaults_of, pipeline_class_method
from zephon_torch.ops.io import OnError
from zephon_torch.sources import datasets as _datasets
from zephon_torch.sources.base import Dataset
from zephon_torch.sources.formats.registry import SourceFormat, format_named
from zephon_torch.sources.lane_plan import LaneChange, check_lane_changes
from zephon_torch.sources.mixing import check_weights
from zephon_torch.sources.options import (
    SOURCE_OPTION_NAMES,
    SourceKwargs,
    SourceOptions,
    document_source_options,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from zephon_torch.pipeline import Pipeline

__all__ = ["SourceConfig", "attach_builder", "derived_builder", "resolve_weights"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig(SourceOptions):
    """How the sources are read and dealt to lanes: what ``Pipeline.from_*`` build.

    The source options ``num_lanes`` ... ``exhausted``, their defaults and
    their checks are those of :class:`~zephon_torch.sources.SourceOptions`,
    which describes each.

    Attributes:
        datasets: The datasets, each with its mixture component id.
        weights: Each dataset's share (``None``: proportional to sizes).
        lane_changes: Where a resume grew the lanes
            (``sources/lane_plan.py``, ``Pipeline.change_lanes``); empty
            unless one did.
    """

    datasets: tuple[Dataset, ...]
    weights: tuple[float, ...] | None = None
    lane_changes: tuple[LaneChange, ...] = ()

    def __post_init__(self) -> None:
        SourceOptions.__post_init__(self)  # (a slots dataclass has no zero-argument super())
        if not self.datasets:
            raise ValueError("a pipeline needs at least one dataset")
        if self.weights is not None:
            if len(self.weights) != len(self.datasets):
                raise ValueError(
                    f"weights has {len(self.weights)} entries for {len(self.datasets)} "
                    "datasets; give one weight per source (or a mapping component -> weight)"
                )
            check_weights(self.datasets, self.weights)
        check_lane_changes(self.num_lanes, self.lane_changes)


_ITEMS = defaults_of(_datasets.items)
_JSONL = defaults_of(_datasets.jsonl)
_PARQUET = defaults_of(_datasets.parquet)
_TEXT_FILES = defaults_of(_datasets.text_files)


def _from_datasets(cls: type[Pipeline], datasets: tuple[Dataset, ...],
                   weights: tuple[float, ...] | None, options: SourceOptions) -> Pipeline:
    """The pipeline of these datasets and weights, read with ``options``."""
    return cls(SourceConfig(datasets=datasets, weights=weights, **options.as_dict()))

def _from_format(cls: type[Pipeline], name: str, what: Any, options: Mapping[str, Any],
                 **format_options: Any) -> Pipeline:
    """One dataset of the registered format ``name``, made from ``what`` and
    ``format_options``, read with the source ``options`` given to its builder."""
    source_format = format_named(name)
    builder = source_format.builder or f"from_{name}"
    _check_option_names(builder, options)  # as Python would, before anything is read
    dataset = source_format.open(what, **format_options)
    return _from_datasets(cls, (dataset,), None, _source_options(builder, options))


def _check_option_names(builder: str, options: Mapping[str, Any]) -> None:
    """Refuse a keyword no builder parameter has, in Python's own words."""
    for key in options:
        if key not in SOURCE_OPTION_NAMES:
            raise TypeError(f"Pipeline.{builder}() got an unexpected keyword argument {key!r}")


def _source_options(builder: str, options: Mapping[str, Any]) -> SourceOptions:
    """The :class:`SourceOptions` of the options given to ``builder``, with its defaults."""
    _check_option_names(builder, options)
    return SourceOptions(**{**_DEFAULTS.get(builder, {}), **options})


#: Source-option defaults of a builder that differ from SourceOptions' own.
_DEFAULTS: dict[str, dict[str, Any]] = {}


def _source_parameters(defaults: Mapping[str, Any]) -> list[inspect.Parameter]:
    """The source options as keyword-only parameters: names, annotations and defaults
    of :class:`SourceOptions` (``defaults`` overrides some)."""
    hints = {f.name: f.type for f in fields(SourceOptions)}
    base = SourceOptions()
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[name],
                              default=defaults.get(name, getattr(base, name)))
            for name in SOURCE_OPTION_NAMES]


def source_builder(**defaults: Any) -> Callable[[Callable[..., Pipeline]],
                                                classmethod[Any, Any, Any]]:
    """Make ``fn`` (``cls``, its own parameters, ``**options``) a ``Pipeline`` builder.

    Its run-time signature spells out the source options after its own
    parameters, with :class:`SourceOptions`' defaults or those given here
    (``from_items``: ``shuffle=False``), so that ``help()``, an IDE and the
    API reference show them; its docstring gets their entries
    (:func:`~zephon_torch.sources.options.document_source_options`).
    """
    def make(fn: Callable[..., Pipeline]) -> classmethod[Any, Any, Any]:
        if defaults:
            _DEFAULTS[fn.__name__] = dict(defaults)
        signature = inspect.signature(fn)
        own = [p for p in signature.parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        fn.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*own, *_source_parameters(defaults)])
        return pipeline_class_method(document_source_options(fn))
    return make


@source_builder()
def from_sources(
    cls: type[Pipeline],
    sources: Sequence[Dataset],
    weights: Mapping[int, float] | Sequence[float] | None = None,
    **options: Unpack[SourceKwargs],
) -> Pipeline:
    """Several datasets (mixture components) in one stream.

    The source options (``num_lanes`` to ``exhausted``, also taken by
    every other ``from_*``) are described in
    :class:`~zephon_torch.sources.SourceOptions`.

    Args:
        sources: Datasets made with ``zt.sources.items``, ``jsonl``,
            ``parquet`` or ``text_files``, each with its ``component_id``.
        weights: Share of each component: a mapping component id ->
            weight, or one weight per source (they need not add up to 1),
            each a finite number >= 0. ``None``: shares proportional to
            the datasets' sizes. Weight 0 leaves a dataset out (never
            read); a tiny positive weight keeps it in, and with
            ``exhausted="repeat"`` the stream lasts until it is read in
            full (a warning when another dataset would be read more than
            10 times its passes; see ``zephon_torch.sources.mixing``). A
            positive weight on a dataset with no samples is an error.

    Returns:
        A pipeline with no operators yet.

    Raises:
        ValueError: An option out of range, no dataset, or weights that
            do not match the sources or are not finite numbers >= 0. When
            the run starts (``iter()``, ``num_batches()``): a positive
            weight on a dataset with no samples, or a ``"repeat"``
            mixture of more than 2**53 samples.
    """
    datasets = tuple(sources)
    resolved = resolve_weights(datasets, weights)
    return _from_datasets(cls, datasets, resolved, _source_options("from_sources", options))


def resolve_weights(datasets: Sequence[Dataset],
                    weights: Mapping[int, float] | Sequence[float] | None
                    ) -> tuple[float, ...] | None:
    """One weight per dataset from ``from_sources``' ``weights``: a mapping component ->
    weight (shared by a component's datasets in proportion to their sizes), a
    sequence (one per dataset), or None.

    Raises:
        ValueError: A mapping that names a component no dataset has.
    """
    if isinstance(weights, Mapping):
        components = {d.component_id for d in datasets}
        unknown = sorted(set(weights) - components)
        if unknown:
            raise ValueError(
                f"weights name components {unknown} that no source has "
                f"(components: {sorted(components)})"
            )
        # A component's weight is shared by its datasets in proportion to size; a
        # component with no sample keeps its weight, which the schedule refuses
        # naming the datasets (its share could never be served).
        per_component: dict[int, list[int]] = {}
        for d in datasets:
            size, count = per_component.get(d.component_id, [0, 0])
            per_component[d.component_id] = [size + len(d), count + 1]
        resolved = tuple(
            float(weights.get(d.component_id, 0.0)) * (
                len(d) / per_component[d.component_id][0]
                if per_component[d.component_id][0] else 1 / per_component[d.component_id][1])
            for d in datasets
        )
    elif weights is not None:
        resolved = tuple(float(w) for w in weights)
    else:
        resolved = None
    return resolved


@source_builder(shuffle=False)
def from_items(
    cls: type[Pipeline],
    items: Sequence[Any],
    *,
    on_error: OnError = _ITEMS.on_error,
    **options: Unpack[SourceKwargs],
) -> Pipeline:
    """An in-memory sequence of samples.

    ``fetch``/``decode_text`` are not needed after it (and are harmless).
    Unlike the file sources, it keeps the items' order unless
    ``shuffle=True``. The other source options are described in
    :class:`~zephon_torch.sources.SourceOptions`.

    Args:
        items: The samples: dict payloads (used as they are), strings
            (``s`` becomes ``{"text": s}``) or 1-D arrays of token ids.
        on_error: ``"raise"`` or ``"skip"`` (a tombstone) for bad samples
            met by ``fetch``/``decode_text``.
        shuffle: Read in a seeded order (default: the items' order).

    Returns:
        A pipeline with no operators yet.

    Raises:
        ValueError: ``items`` is a single str or dict, or an option is out
            of range.
        TypeError: An item is neither a dict, a str nor token ids.

    Example:
        >>> import zephon_torch as zt
        >>> pipe = zt.Pipeline.from_items(["a b", "c"], num_lanes=1).batch(2)
        >>> [r.payload["text"] for b in pipe for r in b]
        ['a b', 'c']
    """
    return _from_format(cls, "items", items, options, on_error=on_error)

@source_builder()
def from_jsonl(
    cls: type[Pipeline],
    paths: str | Sequence[str],
    *,
    on_error: OnError = _JSONL.on_error,
    cache_dir: str | os.PathLike | None = _JSONL.cache_dir,
    **options: Unpack[SourceKwargs],
) -> Pipeline:
    """JSON Lines files, one sample per non-blank line.

    Plain files are read by pointer through a line index built once and
    cached; ``.gz`` and ``.zst`` files are read as streams. Follow with
    ``.fetch().decode_text()``. The source options are described in
    :class:`~zephon_torch.sources.SourceOptions`.

    Args:
        paths: A path, glob, directory or fsspec URL, or a list of them.
            A path that exists is that file or folder, even with ``*``, ``?``
            or ``[`` in its name (``shard[1].jsonl``); see ``expand_paths``.
        on_error: ``"raise"``: a truncated compressed file, an unreadable
            glob match or a bad line is an error naming the file and line;
            ``"skip"``: keep the complete lines before the damage, leave
            out unreadable matches (with a warning) and tombstone bad lines.
        cache_dir: Folder of the line-index cache (default
            ``$ZEPHON_CACHE_DIR`` or ``~/.cache/zephon_torch/index``).

    Returns:
        A pipeline with no operators yet.

    Raises:
        FileNotFoundError: A path or glob that matches no file.
        ValueError: An unsupported extension or an option out of range.
    """
    return _from_format(cls, "jsonl", paths, options, on_error=on_error, cache_dir=cache_dir)

@source_builder()
def from_parquet(
    cls: type[Pipeline],
    paths: str | Sequence[str],
    columns: Sequence[str] | None = _PARQUET.columns,
    *,
    on_error: OnError = _PARQUET.on_error,
    **options: Unpack[SourceKwargs],
) -> Pipeline:
    """Parquet files, one sample (a dict) per row, read by row group.

    Needs ``pyarrow`` (``pip install 'zephon-torch[parquet]'``). The
    source options are described in :class:`~zephon_torch.sources.SourceOptions`.

    Args:
        paths: A path, glob, directory or fsspec URL, or a list of them.
            A path that exists is that file or folder, even with ``*``, ``?``
            or ``[`` in its name (``shard[1].jsonl``); see ``expand_paths``.
        columns: Columns to read (``None``: all); a str names one column.
        on_error: ``"raise"``: a file that cannot be opened is an error;
            ``"skip"``: it counts as an empty file, with a warning.

    Returns:
        A pipeline with no operators yet.

    Raises:
        FileNotFoundError: A path or glob that matches no file.
        ValueError: A missing column, an unreadable file (with
            ``on_error="raise"``) or an option out of range.
        ImportError: ``pyarrow`` is not installed.
    """
    return _from_format(cls, "parquet", paths, options, columns=columns, on_error=on_error)

@source_builder()
def from_text_files(
    cls: type[Pipeline],
    paths: str | Sequence[str],
    *,
    on_error: OnError = _TEXT_FILES.on_error,
    field: str = _TEXT_FILES.field,
    **options: Unpack[SourceKwargs],
) -> Pipeline:
    """Text files, each file one document.

    Follow with ``.fetch().decode_text()``, which makes each file
    ``{field: text}``. The source options are described in
    :class:`~zephon_torch.sources.SourceOptions`.

    Args:
        paths: A path, glob, directory or fsspec URL, or a list of them
            (any extension). A path that exists is that file or folder, even
            with ``*``, ``?`` or ``[`` in its name; see ``expand_paths``.
        on_error: ``"raise"`` or ``"skip"`` (a tombstone) for a file that
            is not UTF-8.
        field: The payload key the text goes to.

    Returns:
        A pipeline with no operators yet.

    Raises:
        FileNotFoundError: A path or glob that matches no file.
        ValueError: An option out of range.
    """
    return _from_format(cls, "text_files", paths, options, on_error=on_error, field=field)


#: A dataset factory's parameters that a builder does not take: a builder reads one
#: dataset, its component and name are the defaults, and ``passes`` is a source option.
DATASET_ONLY = ("component_id", "name", "passes")


def derived_builder(source_format: SourceFormat) -> classmethod[Any, Any, Any]:
    """The ``Pipeline.from_<name>`` class method of a format, made from its factory.

    Its parameters are the factory's (what it reads first, then its own
    options, less :data:`DATASET_ONLY`) followed by the source options with
    :class:`SourceConfig`'s defaults, the order of the written builders; its
    docstring names the factory and documents the source options.

    Raises:
        ValueError: The format names no builder.
    """
    name = source_format.builder
    if name is None:
        raise ValueError(f"source format {source_format.name!r} names no builder")
    factory = source_format.factory
    params = [p for p in inspect.signature(factory).parameters.values()
              if p.name not in DATASET_ONLY]
    what, own = params[0], params[1:]
    shared = _source_parameters({})
    cls_param = inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                  annotation="type[Pipeline]")
    signature = inspect.Signature([cls_param, *params, *shared], return_annotation="Pipeline")
    where = f"{factory.__module__}.{factory.__qualname__}"

    def builder(cls: type[Pipeline], *args: Any, **kwargs: Any) -> Pipeline:
        bound = signature.bind(cls, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        return _from_format(cls, source_format.name, arguments[what.name],
                            {n: arguments[n] for n in SOURCE_OPTION_NAMES},
                            **{p.name: arguments[p.name] for p in own})

    builder.__name__ = name
    builder.__signature__ = signature  # type: ignore[attr-defined]
    entries = "".join(f"    {p.name}: Passed to ``{where}``.\n" for p in params)
    builder.__doc__ = (
        f"The {source_format.name} format alone: one dataset made by ``{where}``.\n\n"
        "Derived from the format's registration; the source options are described in\n"
        ":class:`~zephon_torch.sources.SourceOptions`.\n\n"
        f"Args:\n{entries}\n"
        "Returns:\n    A pipeline with no operators yet.\n")
    return pipeline_class_method(document_source_options(builder))


def attach_builder(pipeline_class: type[Pipeline], source_format: SourceFormat) -> None:
    """Give ``pipeline_class`` the derived builder of a format it has no builder for."""
    if source_format.builder is not None and not hasattr(pipeline_class, source_format.builder):
        setattr(pipeline_class, source_format.builder, derived_builder(source_format))
