"""The pipeline builder and the planner.

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

:meth:`Pipeline.compile` is the planner: it names the stages (the method
name, suffixed ``_1``, ``_2`` ... when it repeats), inserts the replay filter
right before ``batch`` (or at the end), checks the chain (a pointer record
may only meet ``fetch``), fixes each stage's micro-batch size (the operator's
default unless ``microbatch_sizes`` overrides it; sizes that define the
output are parameters, not knobs), and decides the flush-sentinel period:
``flush_every_k_chunks=None`` means 8 when an operator does not preserve
cursor order (packing, shuffle, mixture) and 0 (no sentinels) otherwise.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from zephon_torch.ops.base import Operator
from zephon_torch.sources.base import Dataset
from zephon_torch.sources.schedule import block_layout
from zephon_torch.topology import worker_lanes

if TYPE_CHECKING:
    from zephon_torch.runners.iterator import PipelineIterator
    from zephon_torch.torch.dataset import TorchIterableDataset

__all__ = ["CompiledStage", "Pipeline", "SourceConfig"]

_DEFAULT_FLUSH_EVERY = 8
# Stages whose size defines the output: naming them in microbatch_sizes is an error.
_OUTPUT_DEFINING = frozenset({"batch", "shuffle", "ensure_mixture", "replay_filter"})


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    """How the sources are read and dealt to lanes (see ``sources/schedule.py``)."""

    datasets: tuple[Dataset, ...]
    weights: tuple[float, ...] | None = None
    num_lanes: int = 8
    chunk_size: int = 512
    seed: int = 0
    flush_every_k_chunks: int | None = None
    passes: int | None = 1
    shuffle: bool = True
    exhausted: str = "repeat"

    def __post_init__(self) -> None:
        _positive_int("num_lanes", self.num_lanes)
        _positive_int("chunk_size", self.chunk_size)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.flush_every_k_chunks is not None:
            if not isinstance(self.flush_every_k_chunks, int) or self.flush_every_k_chunks < 0:
                raise ValueError(
                    f"flush_every_k_chunks must be None (automatic), 0 (no sentinels) or a "
                    f"positive integer, got {self.flush_every_k_chunks!r}"
                )
        if self.passes is not None:
            _positive_int("passes", self.passes)
        if self.exhausted not in ("repeat", "stop"):
            raise ValueError(f"exhausted must be 'repeat' or 'stop', got {self.exhausted!r}")
        if not self.datasets:
            raise ValueError("a pipeline needs at least one dataset")
        if self.weights is not None:
            if len(self.weights) != len(self.datasets):
                raise ValueError(
                    f"weights has {len(self.weights)} entries for {len(self.datasets)} "
                    "datasets; give one weight per source (or a mapping component -> weight)"
                )
            if any(not w >= 0 for w in self.weights) or not sum(self.weights) > 0:
                raise ValueError(
                    f"weights must be nonnegative and sum to a positive number, got "
                    f"{list(self.weights)}; give each component its share (they need not add "
                    "up to 1), or weights=None for shares proportional to the sizes"
                )


_POSITIVE_HINTS = {
    "num_lanes": "it is the unit of parallelism, fixed for a run: use at least the largest "
                 "world size you will train on (8 is the default)",
    "chunk_size": "it is the number of samples a lane reads at a time (512 is the default)",
    "passes": "use a count of trips over the data, or None to repeat forever",
}


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        hint = _POSITIVE_HINTS.get(name)
        if hint is None and name.startswith("microbatch_sizes"):
            hint = ("it is how many records one task of that stage holds; omit the stage to "
                    "use the operator's default")
        raise ValueError(f"{name} must be a positive integer, got {value!r}"
                         + (f"; {hint}" if hint else ""))


@dataclass(frozen=True, slots=True)
class CompiledStage:
    """A stage of a compiled plan."""

    name: str
    op: Operator
    microbatch_size: int | None
    local: bool


def _fuse(stages: list[CompiledStage]) -> list[CompiledStage]:
    """Merge runs of consecutive elementwise stages into fused stages.

    Stages join a run when both are elementwise, neither runs inline and
    they share a placement (remote stages: the same ``Remote`` options). A
    fused stage takes the largest micro-batch size overridden for any of its
    parts (else the largest default of its parts).
    Fusing changes where micro-batches are cut, which elementwise operators
    do not see, so no output changes (see ``ops/fused.py``).
    """
    from zephon_torch.ops.fused import FusedOperator
    from zephon_torch.ops.placement import placement_options

    def joins(prev: CompiledStage, nxt: CompiledStage) -> bool:
        a, b = prev.op.traits(), nxt.op.traits()
        return (a.elementwise and b.elementwise and not prev.local and not nxt.local
                and placement_options(prev.op) == placement_options(nxt.op))

    runs: list[list[CompiledStage]] = []
    for stage in stages:
        if runs and joins(runs[-1][-1], stage):
            runs[-1].append(stage)
        else:
            runs.append([stage])
    out = []
    for run in runs:
        if len(run) == 1:
            out.append(run[0])
            continue
        fused = FusedOperator([(c.name, c.op) for c in run])
        sizes = [c.microbatch_size for c in run if c.microbatch_size is not None]
        out.append(CompiledStage("+".join(c.name for c in run), fused,
                                 max(sizes) if sizes else None, False))
    return out


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

    @classmethod
    def from_sources(
        cls,
        sources: Sequence[Dataset],
        weights: Mapping[int, float] | Sequence[float] | None = None,
        *,
        num_lanes: int = 8,
        chunk_size: int = 512,
        seed: int = 0,
        flush_every_k_chunks: int | None = None,
        passes: int | None = 1,
        shuffle: bool = True,
        exhausted: str = "repeat",
    ) -> Pipeline:
        """Several datasets (mixture components) in one stream.

        Args:
            sources: ``zt.sources.items/jsonl/parquet/text_files`` objects,
                each with its ``component_id``.
            weights: Share of each component (a mapping component -> weight,
                or one weight per source); ``None``: proportional to sizes.
            exhausted: ``"repeat"`` (a dataset that runs out repeats,
                reshuffled, until every dataset has finished its passes) or
                ``"stop"`` (the stream ends when the first runs out).
            Other arguments: see :class:`SourceConfig`.
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
            # A component's weight is shared by its datasets in proportion to size.
            per_component: dict[int, int] = {}
            for d in datasets:
                per_component[d.component_id] = per_component.get(d.component_id, 0) + len(d)
            resolved = tuple(
                float(weights.get(d.component_id, 0.0))
                * (len(d) / per_component[d.component_id] if per_component[d.component_id] else 0)
                for d in datasets
            )
        elif weights is not None:
            resolved = tuple(float(w) for w in weights)
        else:
            resolved = None
        config = SourceConfig(
            datasets=datasets, weights=resolved, num_lanes=num_lanes, chunk_size=chunk_size,
            seed=seed, flush_every_k_chunks=flush_every_k_chunks, passes=passes,
            shuffle=shuffle, exhausted=exhausted,
        )
        return cls(config)

    @classmethod
    def from_items(cls, items: Sequence[Any], *, on_error: str = "raise",
                   shuffle: bool = False, **config: Any) -> Pipeline:
        """An in-memory sequence; each item is a payload dict, or a str (``{"text": s}``).

        ``fetch``/``decode_text`` are not needed after it (and are harmless).
        Unlike the file sources, it keeps the items' order unless
        ``shuffle=True``.
        """
        from zephon_torch.sources import datasets

        return cls.from_sources([datasets.items(items, on_error=on_error)],
                                shuffle=shuffle, **config)

    @classmethod
    def from_jsonl(cls, paths: str | Sequence[str], *, on_error: str = "raise",
                   **config: Any) -> Pipeline:
        """JSON Lines files (globs and fsspec URLs; ``.gz``/``.zst`` read as streams)."""
        from zephon_torch.sources import datasets

        return cls.from_sources([datasets.jsonl(paths, on_error=on_error)], **config)

    @classmethod
    def from_parquet(cls, paths: str | Sequence[str], columns: Sequence[str] | None = None,
                     *, on_error: str = "raise", **config: Any) -> Pipeline:
        """Parquet files, read by row group; ``columns`` limits what is read."""
        from zephon_torch.sources import datasets

        return cls.from_sources(
            [datasets.parquet(paths, columns=columns, on_error=on_error)], **config
        )

    @classmethod
    def from_text_files(cls, paths: str | Sequence[str], *, on_error: str = "raise",
                        **config: Any) -> Pipeline:
        """Text files; each file is one document."""
        from zephon_torch.sources import datasets

        return cls.from_sources([datasets.text_files(paths, on_error=on_error)], **config)

    # ------------------------------------------------------------------ operators

    def apply(self, op: Operator, *, placement: Any = None) -> Pipeline:
        """Append a user :class:`~zephon_torch.ops.Operator` (stateless ``process_many``).

        ``placement`` (``"local"``, ``"remote"`` or a ``Remote(...)``) places
        a copy of ``op``; ``None`` keeps the operator's own (local by default).
        """
        if not isinstance(op, Operator):
            raise TypeError(
                f"apply() takes a zephon_torch.ops.Operator, got {type(op).__name__}; wrap a "
                "function with map_transform() instead"
            )
        if placement is not None:
            from zephon_torch.ops.placement import with_placement

            op = with_placement(op, placement)
        return Pipeline(self._source, (*self._ops, op))

    def fetch(self, *, placement: Any = "local") -> Pipeline:
        """Read the bytes of pointer records (on the workers)."""
        from zephon_torch.ops.io import Fetch

        return self.apply(Fetch(placement=placement))

    def decode_text(self, field: str = "text", *, on_error: str = "raise",
                    placement: Any = "local") -> Pipeline:
        """Turn raw bytes into dict payloads (JSON rows, or ``{field: text}``)."""
        from zephon_torch.ops.io import DecodeText

        return self.apply(DecodeText(field=field, on_error=on_error, placement=placement))

    def tokenize(self, tokenizer: Any, **kwargs: Any) -> Pipeline:
        """Token ids as an int32 array in ``out_field`` (see ``ops/tokenize.py``)."""
        from zephon_torch.ops.tokenize import Tokenize

        return self.apply(Tokenize(tokenizer, **kwargs))

    def tokenize_chat(self, tokenizer: Any, **kwargs: Any) -> Pipeline:
        """Chat samples to ``input_ids`` and an assistant-only ``loss_mask``."""
        from zephon_torch.ops.tokenize import TokenizeChat

        return self.apply(TokenizeChat(tokenizer, **kwargs))

    def map_transform(self, fn: Callable[[Any], Any], *, drop_none: bool = True,
                      placement: Any = "local") -> Pipeline:
        """``fn(payload) -> payload``; ``None`` drops the sample (a tombstone)."""
        from zephon_torch.ops.transform import MapTransform

        return self.apply(MapTransform(fn, drop_none=drop_none, placement=placement))

    def filter(self, predicate: Callable[[Any], bool]) -> Pipeline:
        """Records failing ``predicate(payload)`` become tombstones."""
        from zephon_torch.ops.transform import Filter

        return self.apply(Filter(predicate))

    def pack_sequences(self, max_length: int, **kwargs: Any) -> Pipeline:
        """Bins of whole segments: payload ``{"packed_samples": [...]}``.

        Keywords as :class:`~zephon_torch.ops.packing.PackSequences`: ``num_bins``,
        ``algorithm`` (``"first_fit"``, ``"best_fit"``, ``"wrap"``,
        ``"best_fit_decreasing"`` with ``bfd_window``), ``tokens_field``,
        ``min_sequence_length``, ``oversized``.
        """
        from zephon_torch.ops.packing import PackSequences

        return self.apply(PackSequences(max_length, **kwargs))

    def pack_flat(self, max_length: int, **kwargs: Any) -> Pipeline:
        """Flat rows of exactly ``max_length`` tokens with positions and padding length.

        Keywords as :class:`~zephon_torch.ops.packing.PackFlat`: ``num_bins``,
        ``algorithm`` (``"first_fit"``, ``"best_fit"``, ``"wrap"``,
        ``"best_fit_decreasing"`` with ``bfd_window``), ``tokens_field``,
        ``pad_token_id``, ``emit_positions``, ``min_sequence_length``, ``oversized``.
        """
        from zephon_torch.ops.packing import PackFlat

        return self.apply(PackFlat(max_length, **kwargs))

    def ensure_mixture(self, **kwargs: Any) -> Pipeline:
        """Per-lane smooth weighted round-robin toward the source weights."""
        from zephon_torch.ops.mixture import EnsureMixture

        return self.apply(EnsureMixture(**kwargs))

    def shuffle(self, buffer_size: int = 8192, *, seed: int = 0,
                algorithm: str = "streaming") -> Pipeline:
        """Data-derived, per-lane shuffle (``"streaming"``, ``"block"``, ``"block_warmup"``)."""
        from zephon_torch.ops.shuffle import Shuffle

        return self.apply(Shuffle(buffer_size, seed=seed, algorithm=algorithm))

    def batch(self, microbatch_size: int, *, drop_last: bool = True) -> Pipeline:
        """``SampleBatch`` of one lane's records."""
        from zephon_torch.ops.batch import Batch

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
        configured = self._source.flush_every_k_chunks
        reorders = [op.name for op in self._ops if not op.traits().preserves_cursor_order]
        if configured == 0 and reorders:
            raise ValueError(
                f"flush_every_k_chunks=0 (no flush sentinels) needs an order-preserving plan, "
                f"but {reorders} reorder(s) records: their state would span the whole run and "
                "no checkpoint could resume it; leave flush_every_k_chunks=None (8) or set a "
                "positive period"
            )
        if configured is not None:
            return configured
        return _DEFAULT_FLUSH_EVERY if reorders else 0

    def stage_names(self) -> list[str]:
        """The names of the user's stages (method names, suffixed when repeated)."""
        stems = [op.name for op in self._ops]
        totals: dict[str, int] = {}
        for stem in stems:
            totals[stem] = totals.get(stem, 0) + 1
        seen: dict[str, int] = {}
        names = []
        for stem in stems:
            if totals[stem] > 1:
                seen[stem] = seen.get(stem, 0) + 1
                names.append(f"{stem}_{seen[stem]}")
            else:
                names.append(stem)
        return names

    def compile(self, microbatch_sizes: Mapping[str, int] | None = None) -> list[CompiledStage]:
        """The planner: validated stages with the replay filter in place."""
        from zephon_torch.checkpoint import ReplayFilter

        self._validate_chain()
        names = self.stage_names()
        overrides = dict(microbatch_sizes or {})
        for name, size in overrides.items():
            if name not in names:
                raise ValueError(
                    f"microbatch_sizes names {name!r}, which is not a stage of this pipeline "
                    f"(stages: {names})"
                )
            op = self._ops[names.index(name)]
            if op.name in _OUTPUT_DEFINING:
                raise ValueError(
                    f"microbatch_sizes[{name!r}]: the size of {op.name!r} defines the output, "
                    f"so it is a parameter of .{op.name}(), not a performance knob"
                )
            _positive_int(f"microbatch_sizes[{name!r}]", size)
        stages = _fuse([
            CompiledStage(name, op, overrides.get(name), op.traits().inline)
            for name, op in zip(names, self._ops)
        ])
        cut = next((i for i, c in enumerate(stages) if c.op.traits().produces_batches),
                   len(stages))
        replay = ReplayFilter()
        stages.insert(cut, CompiledStage("replay_filter", replay, None, True))
        return stages

    def _validate_chain(self) -> None:
        shards = [s for d in self._source.datasets for s in d.shards()]
        emits_pointers = any(s.access == "pointer" for s in shards)
        if not emits_pointers:
            return
        names = self.stage_names()
        if not self._ops or not self._ops[0].traits().accepts_pointers:
            where = f"before .{names[0]}()" if names else "to the pipeline"
            raise ValueError(
                f"this source emits pointer records (the bytes are still on disk): add "
                f".fetch() {where}, usually followed by .decode_text()"
            )

    def fingerprint(self) -> dict[str, Any]:
        """The configuration that defines the output, as JSON-able builtins."""
        src = self._source
        fingerprint = {
            "datasets": [d.describe() for d in src.datasets],
            "weights": None if src.weights is None else list(src.weights),
            "num_lanes": src.num_lanes,
            "chunk_size": src.chunk_size,
            "seed": src.seed,
            "flush_every_k_chunks": self.flush_every(),
            "passes": src.passes,
            "shuffle": src.shuffle,
            "exhausted": src.exhausted,
            "ops": [op.config() for op in self._ops],
        }
        if src.shuffle:  # a shuffled pass follows the shards' read blocks
            layout = block_layout(src.datasets)
            if layout:  # only shards of several blocks: the others keep their order
                fingerprint["blocks"] = layout
        return fingerprint

    def fingerprint_digest(self) -> str:
        """A short hash of :meth:`fingerprint`."""
        text = json.dumps(self.fingerprint(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

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
        """Run the pipeline; see :class:`~zephon_torch.runners.iterator.PipelineIterator`.

        ``verify=True`` checks at the end of the pass that every sample read
        was delivered or tombstoned exactly once (see
        :func:`zephon_torch.checks.assert_conserved`). ``task_timeout``
        (seconds, ``runner="process"`` only) kills a worker stuck on one
        micro-batch and sends the micro-batch again, so a hang ends in an error.
        ``epoch`` runs that epoch: a new, reproducible order per epoch, derived
        from the seeds and the epoch (0, the default, is the order as ever;
        ``None`` also takes a loaded state's epoch); see ``zephon_torch.epochs``.
        """
        from zephon_torch.runners.iterator import PipelineIterator

        return PipelineIterator(
            self, runner=runner, num_workers=num_workers, deterministic=deterministic,
            rank=rank, world_size=world_size, microbatch_sizes=microbatch_sizes, lanes=lanes,
            verify=verify, task_timeout=task_timeout, epoch=epoch,
        )

    def num_batches(self, *, rank: int | None = None, world_size: int | None = None,
                    lanes: Sequence[int] | None = None) -> int | None:
        """How many items one pass yields to a rank, when known without reading the data.

        Items are batches when the chain ends in ``batch``, else records.
        The count is exact or ``None`` (an upper bound would make a training
        loop wait for batches that never come): exact for finite sources that
        cannot make tombstones followed only by ``fetch``, ``tokenize``,
        ``shuffle``, a final ``batch`` (and ``decode_text`` over in-memory
        items); see ``zephon_torch.length``, whose ``unknown_reason`` says why
        a count is ``None``. The same in every epoch.
        """
        from zephon_torch.length import num_batches

        return num_batches(self, rank=rank, world_size=world_size, lanes=lanes)

    def to_torch_dataset(self, **iter_kwargs: Any) -> TorchIterableDataset:
        """This pipeline as a torch ``IterableDataset`` with ``state_dict``/``load_state_dict``.

        See :class:`zephon_torch.torch.dataset.TorchIterableDataset` (imports torch).
        """
        from zephon_torch.torch.dataset import TorchIterableDataset

        return TorchIterableDataset(self, **iter_kwargs)

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
