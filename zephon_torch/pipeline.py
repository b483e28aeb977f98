"""The pipeline builder.

A :class:`Pipeline` is an immutable description: a source configuration and
a chain of operators. Every builder method returns a new pipeline, so a
pipeline can be shared, extended in two directions, and pickled::

    pipe = (
        Pipeline.from_jsonl("data/*.jsonl", num_lanes=8, chunk_size=512, seed=0)
        .fetch()
        .decode_text()
        .tokenize(tokenizer)
        .pack_flat(2049, pad_token_id=0)
        .shuffle(buffer_size=4096, seed=1)
        .batch(8, drop_last=True)
    )
    for batch in pipe.iter(runner="process", num_workers=4):
        ...

:meth:`Pipeline.compile` is the planner (``zephon_torch/planner.py``): it
names the stages, inserts the replay filter right before ``batch`` (or at the
end), checks the chain and fixes each stage's micro-batch size;
:meth:`Pipeline.flush_every` decides the flush-sentinel period.
:meth:`Pipeline.fingerprint` (``zephon_torch/fingerprint.py``) is the
configuration that defines the output, which checkpoints compare.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from zephon_torch import length
from zephon_torch.fingerprint import fingerprint_digest, pipeline_fingerprint
from zephon_torch.ops.base import Operator
from zephon_torch.ops.batch import Batch
from zephon_torch.ops.chat_templates import ChatTemplate
from zephon_torch.ops.io import DecodeText, Fetch, OnError
from zephon_torch.ops.mixture import EnsureMixture, WeightBy
from zephon_torch.ops.packing import PackFlat, PackSequences
from zephon_torch.ops.placement import with_placement
from zephon_torch.ops.shuffle import Shuffle
from zephon_torch.ops.tokenize import Tokenize
from zephon_torch.ops.tokenize_chat import TokenizeChat
from zephon_torch.ops.transform import Filter, MapTransform
from zephon_torch.planner import CompiledStage, compile_plan, flush_every, stage_names
from zephon_torch.runners.options import RunOptions
from zephon_torch.sources import datasets as _datasets
from zephon_torch.sources.base import Dataset
from zephon_torch.sources.formats.registry import format_named
from zephon_torch.sources.mixing import check_weights
from zephon_torch.sources.options import SourceOptions, document_source_options
from zephon_torch.topology import worker_lanes

if TYPE_CHECKING:
    from torch.utils.data import IterableDataset

    from zephon_torch.runners.iterator import PipelineIterator

__all__ = ["CompiledStage", "Pipeline", "SourceConfig"]

#: Makes :meth:`Pipeline.to_torch_dataset`'s wrapper,
#: ``zephon_torch.torch.dataset.TorchIterableDataset(pipeline, **iter_kwargs)``. The torch
#: integration imports this module, never the reverse: the package root installs it
#: (:func:`install_torch_dataset`, in ``zephon_torch/__init__.py``), importing the
#: integration (and torch) at the first call.
_torch_dataset: Callable[..., IterableDataset] | None = None


def install_torch_dataset(make: Callable[..., IterableDataset]) -> None:
    """Make ``make(pipeline, **iter_kwargs)`` what :meth:`Pipeline.to_torch_dataset` returns.

    The package root calls it once; nothing else needs to.
    """
    global _torch_dataset
    _torch_dataset = make

@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig(SourceOptions):
    """How the sources are read and dealt to lanes: what ``Pipeline.from_*`` build.

    The source options ``num_lanes`` ... ``exhausted``, their defaults and
    their checks are those of :class:`~zephon_torch.sources.SourceOptions`,
    which describes each.

    Attributes:
        datasets: The datasets, each with its mixture component id.
        weights: Each dataset's share (``None``: proportional to sizes).
    """

    datasets: tuple[Dataset, ...]
    weights: tuple[float, ...] | None = None

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


def _defaults(of: Callable[..., Any]) -> SimpleNamespace:
    """The parameter defaults of ``of`` (a class: of its ``__init__``), by name.

    The builders below take their defaults from here: an operator's
    ``__init__`` (or a source's constructor, or :class:`SourceConfig`) is the
    one place a default is written, so a builder cannot drift from it.
    """
    if isinstance(of, type) and hasattr(of, "__dataclass_fields__"):
        return SimpleNamespace(**{f.name: f.default for f in fields(of)
                                  if f.default is not MISSING})
    params = inspect.signature(of).parameters.values()
    return SimpleNamespace(**{p.name: p.default for p in params if p.default is not p.empty})


_SOURCE = _defaults(SourceConfig)
_ITEMS = _defaults(_datasets.items)
_JSONL = _defaults(_datasets.jsonl)
_PARQUET = _defaults(_datasets.parquet)
_TEXT_FILES = _defaults(_datasets.text_files)
_FETCH = _defaults(Fetch)
_DECODE_TEXT = _defaults(DecodeText)
_TOKENIZE = _defaults(Tokenize)
_TOKENIZE_CHAT = _defaults(TokenizeChat)
_MAP_TRANSFORM = _defaults(MapTransform)
_PACK_SEQUENCES = _defaults(PackSequences)
_PACK_FLAT = _defaults(PackFlat)
_ENSURE_MIXTURE = _defaults(EnsureMixture)
_SHUFFLE = _defaults(Shuffle)
_BATCH = _defaults(Batch)

_POSITIVE_HINTS = {
    "num_lanes": "it is the unit of parallelism, fixed for a run: use at least the largest "
                 "world size you will train on (8 is the default)",
    "chunk_size": "it is the number of samples a lane reads at a time (512 is the default)",
    "passes": "use a count of trips over the data, or None to repeat forever",
}


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        hint = _POSITIVE_HINTS.get(name)
        raise ValueError(f"{name} must be a positive integer, got {value!r}"
                         + (f"; {hint}" if hint else ""))


class Pipeline:
    """An immutable description of a data pipeline: sources and operators.

    Build one with a ``from_*`` class method, chain operators, then iterate
    with :meth:`iter` (or plainly: ``for batch in pipe``).
    """

    __slots__ = ("_ops", "_source")

    def __init__(self, source: SourceConfig, ops: tuple[Operator, ...] = ()) -> None:
        self._source = source
        self._ops = ops

    # ------------------------------------------------------------------ sources
    #
    # The source options (num_lanes ... exhausted) are spelled out in each builder's
    # signature, with SourceConfig's defaults; each builder collects them into one
    # SourceOptions (which checks them) and takes their docstring entries from it.

    @classmethod
    @document_source_options
    def from_sources(
        cls,
        sources: Sequence[Dataset],
        weights: Mapping[int, float] | Sequence[float] | None = None,
        *,
        num_lanes: int = _SOURCE.num_lanes,
        chunk_size: int = _SOURCE.chunk_size,
        seed: int = _SOURCE.seed,
        flush_every_k_chunks: int | None = _SOURCE.flush_every_k_chunks,
        passes: int | None = _SOURCE.passes,
        shuffle: bool = _SOURCE.shuffle,
        exhausted: str = _SOURCE.exhausted,
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
        return cls._from_datasets(datasets, resolved, SourceOptions.collect(locals()))

    @classmethod
    def _from_datasets(cls, datasets: tuple[Dataset, ...], weights: tuple[float, ...] | None,
                       options: SourceOptions) -> Pipeline:
        """The pipeline of these datasets and weights, read with ``options``."""
        return cls(SourceConfig(datasets=datasets, weights=weights, **options.as_dict()))

    @classmethod
    def _from_format(cls, name: str, what: Any, arguments: Mapping[str, Any],
                     **format_options: Any) -> Pipeline:
        """One dataset of the registered format ``name``, made from ``what`` and
        ``format_options``, read with the source options among ``arguments``."""
        dataset = format_named(name).open(what, **format_options)
        return cls._from_datasets((dataset,), None, SourceOptions.collect(arguments))

    @classmethod
    @document_source_options
    def from_items(
        cls,
        items: Sequence[Any],
        *,
        on_error: OnError = _ITEMS.on_error,
        num_lanes: int = _SOURCE.num_lanes,
        chunk_size: int = _SOURCE.chunk_size,
        seed: int = _SOURCE.seed,
        flush_every_k_chunks: int | None = _SOURCE.flush_every_k_chunks,
        passes: int | None = _SOURCE.passes,
        shuffle: bool = False,
        exhausted: str = _SOURCE.exhausted,
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
        return cls._from_format("items", items, locals(), on_error=on_error)

    @classmethod
    @document_source_options
    def from_jsonl(
        cls,
        paths: str | Sequence[str],
        *,
        on_error: OnError = _JSONL.on_error,
        cache_dir: str | os.PathLike | None = _JSONL.cache_dir,
        num_lanes: int = _SOURCE.num_lanes,
        chunk_size: int = _SOURCE.chunk_size,
        seed: int = _SOURCE.seed,
        flush_every_k_chunks: int | None = _SOURCE.flush_every_k_chunks,
        passes: int | None = _SOURCE.passes,
        shuffle: bool = _SOURCE.shuffle,
        exhausted: str = _SOURCE.exhausted,
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
        return cls._from_format("jsonl", paths, locals(), on_error=on_error,
                                cache_dir=cache_dir)

    @classmethod
    @document_source_options
    def from_parquet(
        cls,
        paths: str | Sequence[str],
        columns: Sequence[str] | None = _PARQUET.columns,
        *,
        on_error: OnError = _PARQUET.on_error,
        num_lanes: int = _SOURCE.num_lanes,
        chunk_size: int = _SOURCE.chunk_size,
        seed: int = _SOURCE.seed,
        flush_every_k_chunks: int | None = _SOURCE.flush_every_k_chunks,
        passes: int | None = _SOURCE.passes,
        shuffle: bool = _SOURCE.shuffle,
        exhausted: str = _SOURCE.exhausted,
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
        return cls._from_format("parquet", paths, locals(), columns=columns,
                                on_error=on_error)

    @classmethod
    @document_source_options
    def from_text_files(
        cls,
        paths: str | Sequence[str],
        *,
        on_error: OnError = _TEXT_FILES.on_error,
        field: str = _TEXT_FILES.field,
        num_lanes: int = _SOURCE.num_lanes,
        chunk_size: int = _SOURCE.chunk_size,
        seed: int = _SOURCE.seed,
        flush_every_k_chunks: int | None = _SOURCE.flush_every_k_chunks,
        passes: int | None = _SOURCE.passes,
        shuffle: bool = _SOURCE.shuffle,
        exhausted: str = _SOURCE.exhausted,
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
        return cls._from_format("text_files", paths, locals(), on_error=on_error, field=field)

    # ------------------------------------------------------------------ operators
    #
    # Each builder spells out its operator's parameters and takes their
    # defaults from the operator's __init__ (the namespaces made by _defaults
    # above), so the two cannot disagree; tests/test_api_reference.py checks
    # the names, order, kinds and annotations.

    def apply(self, op: Operator, *, placement: Any = None) -> Pipeline:
        """Append an operator of your own.

        Args:
            op: A :class:`~zephon_torch.ops.Operator` (see
                ``docs/writing-an-operator.md``).
            placement: ``"local"``, ``"remote"`` or a ``Remote(...)`` places a
                copy of ``op`` there; ``None`` keeps the operator's own
                (local by default).

        Returns:
            A new pipeline ending with ``op``.

        Raises:
            TypeError: ``op`` is not an ``Operator`` (wrap a function with
                :meth:`map_transform` instead).
        """
        if not isinstance(op, Operator):
            raise TypeError(
                f"apply() takes a zephon_torch.ops.Operator, got {type(op).__name__}; wrap a "
                "function with map_transform() instead"
            )
        if placement is not None:
            op = with_placement(op, placement)
        return Pipeline(self._source, (*self._ops, op))

    def fetch(self, *, placement: Any = _FETCH.placement) -> Pipeline:
        """Read the bytes of pointer records (on the workers).

        File sources emit pointers (the bytes are still on disk); ``fetch``
        reads them where the stage runs, so reading scales with the workers.

        Args:
            placement: ``"local"`` (the pipeline's runner), ``"remote"`` or a
                ``Remote(...)`` (Ray actors; ``docs/remote-stages.md``).

        Returns:
            A new pipeline.
        """
        return self.apply(Fetch(placement=placement))

    def decode_text(self, field: str = _DECODE_TEXT.field, *,
                    on_error: OnError = _DECODE_TEXT.on_error,
                    placement: Any = _DECODE_TEXT.placement) -> Pipeline:
        """Turn raw bytes into dict payloads (JSON rows, or ``{field: text}``).

        Args:
            field: The key holding the document's text. JSON lines must hold
                a string under it (or, for chat data, a list such as
                ``messages``); text files are decoded to ``{field: text}``.
            on_error: ``"skip"`` turns bad samples (invalid JSON or UTF-8, a
                missing field) into ``"decode_error"`` tombstones;
                ``"raise"`` defers to the source's ``on_error``.
            placement: As for :meth:`fetch`.

        Returns:
            A new pipeline.
        """
        return self.apply(DecodeText(field=field, on_error=on_error, placement=placement))

    def tokenize(
        self,
        tokenizer: Any,
        *,
        field: str = _TOKENIZE.field,
        out_field: str = _TOKENIZE.out_field,
        special_tokens: str = _TOKENIZE.special_tokens,
        bos_token_id: int | None = _TOKENIZE.bos_token_id,
        eos_token_id: int | None = _TOKENIZE.eos_token_id,
        max_length: int | None = _TOKENIZE.max_length,
        on_error: str = _TOKENIZE.on_error,
        placement: Any = _TOKENIZE.placement,
    ) -> Pipeline:
        """Encode a text field into an ``int32`` array of token ids.

        Texts are encoded without the tokenizer's own special tokens; the
        operator places BOS/EOS around each document as ``special_tokens``
        says, so that packing sees document boundaries.

        Args:
            tokenizer: A ``tokenizers.Tokenizer``, the path of a
                ``tokenizer.json`` (or of a folder holding one), or a
                ``transformers`` fast tokenizer.
            field: Payload key holding the text.
            out_field: Payload key that receives the ids.
            special_tokens: Which special tokens frame each document:
                ``"eos"`` (the default: one EOS after each document, so packed
                documents are separated by one token), ``"bos_eos"``,
                ``"bos"`` or ``"none"``.
            bos_token_id: BOS id; by default the tokenizer's own (from
                ``tokenizer_config.json`` of a tokenizer directory, or a
                transformers tokenizer's ``bos_token_id``).
            eos_token_id: EOS id; by default the tokenizer's own (found the
                same way).
            max_length: Keep at most this many ids, special tokens included
                (BOS stays first, EOS last); ``None``: no limit.
            on_error: A payload without a string ``field``, or a text the
                tokenizer cannot encode: ``"raise"`` a ``ValueError`` naming
                the sample's file and line, or ``"skip"`` it (a tombstone).
            placement: ``"local"``, ``"remote"`` or a ``Remote(...)``: where
                the stage runs (``docs/remote-stages.md``).

        Returns:
            A new pipeline.

        Raises:
            ValueError: An unknown mode, a special token the tokenizer does
                not have (pass its id), or a bad ``max_length``.
            TypeError: ``tokenizer`` is none of the accepted kinds.
            FileNotFoundError: ``tokenizer`` is a path that does not exist.
        """
        return self.apply(Tokenize(
            tokenizer, field=field, out_field=out_field, special_tokens=special_tokens,
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, max_length=max_length,
            on_error=on_error, placement=placement,
        ))

    def tokenize_chat(
        self,
        tokenizer: Any,
        *,
        field: str = _TOKENIZE_CHAT.field,
        out_field: str = _TOKENIZE_CHAT.out_field,
        mask_field: str = _TOKENIZE_CHAT.mask_field,
        chat_template: str | ChatTemplate | None = _TOKENIZE_CHAT.chat_template,
        loss_on_last_turn_only: bool = _TOKENIZE_CHAT.loss_on_last_turn_only,
        roles: Sequence[str] = _TOKENIZE_CHAT.roles,
        special_tokens: str | None = _TOKENIZE_CHAT.special_tokens,
        bos_token_id: int | None = _TOKENIZE_CHAT.bos_token_id,
        eos_token_id: int | None = _TOKENIZE_CHAT.eos_token_id,
        max_length: int | None = _TOKENIZE_CHAT.max_length,
        chat_template_kwargs: Mapping[str, Any] | None = _TOKENIZE_CHAT.chat_template_kwargs,
        on_error: str = _TOKENIZE_CHAT.on_error,
        placement: Any = _TOKENIZE_CHAT.placement,
    ) -> Pipeline:
        """Chat conversations to ``input_ids`` and an assistant-only ``loss_mask``.

        Each sample's ``field`` is a list of ``{"role": ..., "content": ...}``
        messages; the ``uint8`` mask is 1 on what the assistant writes (its
        content and the end of each of its turns) and 0 elsewhere. How the
        text is tokenized depends on the template. A Jinja template (the
        model's own, or a string holding ``{%``/``{{``) is rendered as
        transformers' ``apply_chat_template`` renders it and tokenized as
        one text, so the ids are what the model sees at inference; the mask
        marks the tokens that cover an assistant span. A format string or a
        callable is rendered into segments, each tokenized on its own, so
        the mask lines up with the tokens by construction, with the EOS the
        operator adds after each assistant turn supervised.

        Args:
            tokenizer: As for :meth:`tokenize`.
            field: Payload key holding the messages.
            out_field: Payload key receiving the ``int32`` ids.
            mask_field: Payload key receiving the ``uint8`` mask.
            chat_template: How a conversation is rendered: ``None`` for the
                tokenizer's own Jinja template (``chat_template.jinja`` or
                ``tokenizer_config.json`` of a tokenizer directory, a
                transformers tokenizer's ``chat_template``), else the built-in
                per-turn format ``"<|{role}|>\\n{content}\\n"``; a Jinja
                string (holding ``{%`` or ``{{``); a format string with one
                ``{content}`` and any ``{role}`` placeholders; or a callable
                ``messages -> [(text, is_assistant), ...]``.
            loss_on_last_turn_only: Supervise only the last assistant turn.
            roles: Accepted message roles (must include ``"assistant"``).
            special_tokens: ``None``: ``"none"`` with a Jinja template (which
                writes the model's own special tokens), ``"bos_eos"`` otherwise
                (BOS first, EOS after each assistant turn). Or ``"eos"``,
                ``"bos"``, ``"none"``.
            bos_token_id: As for :meth:`tokenize`.
            eos_token_id: As for :meth:`tokenize`.
            max_length: Cut ids and mask to this many tokens; ``None``: no
                limit.
            chat_template_kwargs: Extra variables for a Jinja template (JSON
                values), like the keyword arguments of transformers'
                ``apply_chat_template`` (``{"enable_thinking": False}``).
            on_error: Malformed messages or text the tokenizer cannot encode:
                ``"raise"`` a ``ValueError`` or ``"skip"`` (a tombstone).
            placement: As for :meth:`tokenize`.

        Returns:
            A new pipeline.

        Raises:
            ValueError: A bad template, mode, role list or ``max_length``, or
                a special token the tokenizer does not have.
            TypeError: ``tokenizer`` or ``chat_template`` of the wrong kind.
        """
        return self.apply(TokenizeChat(
            tokenizer, field=field, out_field=out_field, mask_field=mask_field,
            chat_template=chat_template, loss_on_last_turn_only=loss_on_last_turn_only,
            roles=roles, special_tokens=special_tokens, bos_token_id=bos_token_id,
            eos_token_id=eos_token_id, max_length=max_length,
            chat_template_kwargs=chat_template_kwargs, on_error=on_error, placement=placement,
        ))

    def map_transform(self, fn: Callable[[Any], Any], *,
                      drop_none: bool = _MAP_TRANSFORM.drop_none,
                      placement: Any = _MAP_TRANSFORM.placement) -> Pipeline:
        """Apply ``fn(payload) -> payload`` to every sample, keeping its identity.

        Args:
            fn: The function. It must be deterministic (it may run in any
                worker, and again after a resume); returning its input
                unchanged reuses the record as it is.
            drop_none: ``True``: a ``None`` result drops the sample (a
                counted tombstone, reason ``"map_none"``); ``False``: ``None``
                is kept as the payload.
            placement: As for :meth:`tokenize`.

        Returns:
            A new pipeline.

        Raises:
            TypeError: ``fn`` is not callable.
        """
        return self.apply(MapTransform(fn, drop_none=drop_none, placement=placement))

    def filter(self, predicate: Callable[[Any], Any]) -> Pipeline:
        """Keep the samples whose payload passes ``predicate``.

        Args:
            predicate: ``predicate(payload) -> bool``; a sample for which it
                is falsy becomes a counted tombstone (reason ``"filter"``).

        Returns:
            A new pipeline.

        Raises:
            TypeError: ``predicate`` is not callable.
        """
        return self.apply(Filter(predicate))

    def pack_sequences(
        self,
        max_length: int,
        *,
        num_bins: int = _PACK_SEQUENCES.num_bins,
        algorithm: str = _PACK_SEQUENCES.algorithm,
        tokens_field: str = _PACK_SEQUENCES.tokens_field,
        min_sequence_length: int = _PACK_SEQUENCES.min_sequence_length,
        oversized: str = _PACK_SEQUENCES.oversized,
        bfd_window: int | None = _PACK_SEQUENCES.bfd_window,
    ) -> Pipeline:
        """Pack documents into bins of at most ``max_length`` tokens, kept apart.

        Each output payload is ``{"packed_samples": [segment payloads...]}``:
        whole documents as they were, pieces of a split document as copies
        cut to the piece. Nothing is padded.

        Args:
            max_length: Most tokens per bin.
            num_bins: Bins that may be open per lane (ignored by ``"wrap"``
                and ``"best_fit_decreasing"``).
            algorithm: ``"first_fit"``, ``"best_fit"``, ``"wrap"``
                (documents cut at bin boundaries) or ``"best_fit_decreasing"``
                (over windows of ``bfd_window`` documents).
            tokens_field: Payload field holding the token ids, or ``"auto"``
                (``input_ids``, ``tokens``, ``token_ids``, ``ids``, in that
                order).
            min_sequence_length: A bin whose room drops below this is
                emitted.
            oversized: What happens to a document longer than ``max_length``:
                ``"split"`` into pieces, ``"drop"`` (a tombstone) or
                ``"truncate"``.
            bfd_window: Documents per ``"best_fit_decreasing"`` window
                (``None``: 4096); only for that algorithm.

        Returns:
            A new pipeline.

        Raises:
            ValueError: A parameter out of range or an unknown mode.
        """
        return self.apply(PackSequences(
            max_length, num_bins=num_bins, algorithm=algorithm, tokens_field=tokens_field,
            min_sequence_length=min_sequence_length, oversized=oversized,
            bfd_window=bfd_window,
        ))

    def pack_flat(
        self,
        max_length: int,
        *,
        num_bins: int = _PACK_FLAT.num_bins,
        algorithm: str = _PACK_FLAT.algorithm,
        tokens_field: str = _PACK_FLAT.tokens_field,
        pad_token_id: int = _PACK_FLAT.pad_token_id,
        emit_positions: bool = _PACK_FLAT.emit_positions,
        min_sequence_length: int = _PACK_FLAT.min_sequence_length,
        oversized: str = _PACK_FLAT.oversized,
        bfd_window: int | None = _PACK_FLAT.bfd_window,
    ) -> Pipeline:
        """Pack documents into flat rows of exactly ``max_length`` tokens.

        Each row is ``{"input_ids": int32[max_length]}`` plus ``positions``
        (restarting at 0 for every document) and ``loss_mask`` when the
        documents carry one; the trailing padding length is in the record's
        metadata, which ``to_training`` reads.

        Args:
            max_length: Row length: the model's sequence length + 1, since
                labels shift by one.
            num_bins: Bins that may be open per lane (ignored by ``"wrap"``
                and ``"best_fit_decreasing"``).
            algorithm: ``"first_fit"``, ``"best_fit"``, ``"wrap"``
                (concatenate and cut: no padding) or ``"best_fit_decreasing"``
                (over windows of ``bfd_window`` documents).
            tokens_field: As for :meth:`pack_sequences`.
            pad_token_id: Token id written into the trailing padding.
            emit_positions: Emit the per-document ``positions`` field.
            min_sequence_length: A bin whose room drops below this is
                emitted.
            oversized: As for :meth:`pack_sequences`.
            bfd_window: As for :meth:`pack_sequences`.

        Returns:
            A new pipeline.

        Raises:
            ValueError: A parameter out of range or an unknown mode.
        """
        return self.apply(PackFlat(
            max_length, num_bins=num_bins, algorithm=algorithm, tokens_field=tokens_field,
            pad_token_id=pad_token_id, emit_positions=emit_positions,
            min_sequence_length=min_sequence_length, oversized=oversized,
            bfd_window=bfd_window,
        ))

    def ensure_mixture(
        self,
        *,
        weight_by: WeightBy = _ENSURE_MIXTURE.weight_by,
        max_buffer_size: int = _ENSURE_MIXTURE.max_buffer_size,
        mixture: Mapping[int, float] | None = _ENSURE_MIXTURE.mixture,
    ) -> Pipeline:
        """Reorder each lane so its component shares track the target mixture.

        A per-lane smooth weighted round-robin over the components, toward
        ``mixture`` or the source weights: it corrects what filtering and
        packing did to the shares.

        Args:
            weight_by: What a share counts: ``"auto"`` (tokens when the
                records carry token ids, else samples), ``"samples"``,
                ``"tokens"``, a payload field name, or ``fn(record) ->
                float``.
            max_buffer_size: Most records a lane holds while waiting for a
                missing component; beyond it records leave from what is there.
            mixture: Component id -> weight; ``None`` uses the sources'
                weights (equal weights when there are none).

        Returns:
            A new pipeline.

        Raises:
            ValueError: A bad ``max_buffer_size``, weight or ``weight_by``.
        """
        return self.apply(EnsureMixture(weight_by=weight_by, max_buffer_size=max_buffer_size,
                                        mixture=mixture))

    def shuffle(self, buffer_size: int = _SHUFFLE.buffer_size, *, seed: int = _SHUFFLE.seed,
                algorithm: str = _SHUFFLE.algorithm) -> Pipeline:
        """Shuffle each lane's records, with an order derived from the data and ``seed``.

        The order is a function of the records' cursor keys and the seed, so
        it is the same on every runner and worker count and after a resume.

        Args:
            buffer_size: Records the shuffle holds, over all lanes: each lane
                shuffles its own records in a share of ``ceil(buffer_size /
                num_lanes)`` (the source's ``num_lanes``, so the share is the
                same on any world size and worker count), the reservoir of
                ``"streaming"`` or the block of ``"block"`` and
                ``"block_warmup"``. The first records come out once a lane's
                share is full, after about ``buffer_size`` were read. Larger
                mixes further and holds more in memory; it defines the
                output. It must exceed ``num_lanes`` (one record a lane does
                not shuffle). This meaning is new: ``buffer_size`` was each
                lane's size, so pipelines that shuffle give another order
                than before; ``buffer_size * num_lanes`` gives the old one
                and resumes a state saved before, which any other size
                refuses (``docs/migration.md``).
            seed: The shuffle's own seed (the pipeline's seed does not enter
                it); another seed gives another order.
            algorithm: ``"streaming"`` (a reservoir per lane: once full,
                each arrival takes the place of a held record, which leaves),
                ``"block"`` (each block of a lane's share in a shuffled
                order) or ``"block_warmup"`` (as ``"block"``, with blocks
                doubling from ``min(64, share // 16)`` up to the share, so
                the first batches come sooner).

        Returns:
            A new pipeline.

        Raises:
            ValueError: ``buffer_size`` is not a positive integer or is at
                most ``num_lanes``, ``seed`` is not an integer, or
                ``algorithm`` is unknown. (``iter()`` checks ``num_lanes``
                again, for a source changed later by ``with_source`` or a
                ``Shuffle`` given to ``apply``.)
        """
        op = Shuffle(buffer_size, seed=seed, algorithm=algorithm)
        op.lane_buffer_size(self._source.num_lanes)  # at once, as other parameters are checked
        return self.apply(op)

    def batch(self, microbatch_size: int, *,
              drop_last: bool = _BATCH.drop_last) -> Pipeline:
        """Group each lane's records into batches (:class:`~zephon_torch.SampleBatch`).

        Args:
            microbatch_size: Records (rows) per batch, as handed to the
                trainer.
            drop_last: Drop (as counted tombstones) the partial batch a lane
                holds at the end of the stream instead of emitting it.

        Returns:
            A new pipeline.

        Raises:
            ValueError: ``microbatch_size`` is not a positive integer.
        """
        return self.apply(Batch(microbatch_size, drop_last=drop_last))

    # ------------------------------------------------------------------ planning

    @property
    def source(self) -> SourceConfig:
        """The source configuration."""
        return self._source

    @property
    def ops(self) -> tuple[Operator, ...]:
        """The user's chain of operators (without the planner's replay filter)."""
        return self._ops

    def with_source(self, **changes: Any) -> Pipeline:
        """A copy with source settings changed (``num_lanes``, ``seed`` ...)."""
        return Pipeline(replace(self._source, **changes), self._ops)

    def flush_every(self) -> int:
        """The effective flush-sentinel period (0: no sentinels)."""
        return flush_every(self._source, self._ops)

    def stage_names(self) -> list[str]:
        """The names of the user's stages (method names, suffixed when repeated)."""
        return stage_names(self._ops)

    def compile(self, microbatch_sizes: Mapping[str, int] | None = None) -> list[CompiledStage]:
        """The planner: validated stages with the replay filter in place."""
        return compile_plan(self._source, self._ops, microbatch_sizes)

    def fingerprint(self) -> dict[str, Any]:
        """The configuration that defines the output, as JSON-able builtins."""
        return pipeline_fingerprint(self._source, self._ops, self.flush_every())

    def fingerprint_digest(self) -> str:
        """A short hash of :meth:`fingerprint`."""
        return fingerprint_digest(self.fingerprint())

    # ------------------------------------------------------------------ running

    def iter(
        self,
        runner: str = "threads",
        num_workers: int | None = None,
        deterministic: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        microbatch_sizes: Mapping[str, int] | None = None,
        lanes: Sequence[int] | None = None,
        verify: bool = False,
        task_timeout: float | None = None,
        epoch: int | None = None,
    ) -> PipelineIterator:
        """Run the pipeline: an iterator of its output with ``state_dict()``/``load_state_dict()``.

        Use it in a ``with`` block (or call ``close()``) to stop its workers
        when you leave the loop early. The runner, the worker count and the
        micro-batch sizes never change the output.

        Args:
            runner: Where the stages run: ``"threads"`` (threads of this
                process), ``"inline"`` (one thread, for debugging) or
                ``"process"`` (spawned worker processes: keep the script's
                top-level code under ``if __name__ == "__main__":``).
            num_workers: Threads or processes per pool (``None``: the CPU
                count, at most 4).
            deterministic: Release results in order (the default). ``False``
                takes them as they complete: faster with uneven work, but the
                output order varies and the iterator cannot checkpoint.
            rank: This process's rank (``None``: ``torch.distributed`` when
                initialized, else ``$RANK``, else 0); it reads the lanes
                ``l % world_size == rank``.
            world_size: The number of ranks (``None``: as for ``rank``, from
                ``$WORLD_SIZE``, else 1).
            microbatch_sizes: ``{stage name: size}``: how much work a task
                carries, per stage (performance only).
            lanes: Read exactly these lanes instead of the rank's (tools and
                tests).
            verify: At the end of the pass, check that every sample read was
                delivered or tombstoned exactly once (see
                :func:`zephon_torch.checks.assert_conserved`); costs a little
                work per sample.
            task_timeout: With ``runner="process"``: seconds one micro-batch
                may run before its worker is killed and the micro-batch sent
                again, so that a hang ends in an error (``None``: no limit).
            epoch: The epoch to run: a new, reproducible order per epoch,
                derived from the seeds and the epoch (``0`` is the order as
                ever). ``None`` (the default): 0, or the epoch of a state
                loaded with ``load_state_dict``; an explicit epoch refuses a
                state of another epoch. See ``zephon_torch.epochs``.

        Returns:
            A :class:`~zephon_torch.runners.iterator.PipelineIterator`.

        Raises:
            ValueError: An unknown runner, a bad worker count or topology, or
                ``task_timeout`` without ``runner="process"``.
        """
        from zephon_torch.runners.iterator import PipelineIterator

        options = RunOptions(  # checked here, once
            runner=runner, num_workers=num_workers, deterministic=deterministic,
            rank=rank, world_size=world_size, microbatch_sizes=microbatch_sizes, lanes=lanes,
            verify=verify, task_timeout=task_timeout, epoch=epoch,
        )
        return PipelineIterator(self, options)

    def num_batches(self, *, rank: int | None = None, world_size: int | None = None,
                    lanes: Sequence[int] | None = None) -> int | None:
        """How many items one pass yields to a rank, when known without reading the data.

        Items are batches when the chain ends in ``batch``, else records.
        The count is exact or ``None`` (an upper bound would make a training
        loop wait for batches that never come): exact for finite sources that
        cannot make tombstones followed only by ``fetch``, ``tokenize``,
        ``shuffle``, a final ``batch`` (and ``decode_text`` over in-memory
        items); see ``zephon_torch.length``. :meth:`num_batches_reason` says
        why a count is ``None``. The same in every epoch.
        """
        return length.num_batches(self, rank=rank, world_size=world_size, lanes=lanes)

    def num_batches_reason(self) -> str | None:
        """Why :meth:`num_batches` is ``None``: every cause, in chain order (None: it is known).

        Example:
            >>> pipe = Pipeline.from_items(["a b"] * 4).map_transform(lambda p: p).batch(2)
            >>> pipe.num_batches_reason()
            'map_transform may drop, merge or hold back records'
        """
        return length.unknown_reason(self)

    def to_torch_dataset(self, **iter_kwargs: Any) -> IterableDataset:
        """This pipeline as a torch ``IterableDataset`` with ``state_dict``/``load_state_dict``.

        See :class:`zephon_torch.torch.dataset.TorchIterableDataset` (imports torch).
        """
        if _torch_dataset is None:  # only while zephon_torch/__init__.py is being imported
            raise RuntimeError("Pipeline.to_torch_dataset needs the zephon_torch package "
                               "imported first (import zephon_torch)")
        return _torch_dataset(self, **iter_kwargs)

    def __iter__(self) -> Iterator[Any]:
        # Inside a torch DataLoader worker, take this worker's share of the lanes
        # (the check never imports torch; see topology.py).
        share = worker_lanes(self._source.num_lanes)
        if share is None:
            return self.iter()
        if not share:
            return iter(())
        return self.iter(runner="inline", lanes=share)

    def __repr__(self) -> str:
        chain = "".join(f".{name}()" for name in self.stage_names())
        kinds = ",".join(d.kind for d in self._source.datasets)
        return f"Pipeline<{kinds}>{chain}"
