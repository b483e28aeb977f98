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

The builder's methods are written in three rooms: this one (the class, with
:meth:`Pipeline.apply`, planning and running), ``zephon_torch/pipeline_sources.py``
(the ``from_*`` entry points and :class:`SourceConfig`) and
``zephon_torch/pipeline_operators.py`` (one builder per built-in operator);
the class binds the others in its body, so ``help()`` and the API reference
show one class.

:meth:`Pipeline.compile` is the planner (``zephon_torch/planner.py``): it
names the stages, inserts the replay filter right before ``batch`` (or at the
end), checks the chain and fixes each stage's micro-batch size;
:meth:`Pipeline.flush_every` decides the flush-sentinel period.
:meth:`Pipeline.fingerprint` (``zephon_torch/fingerprint.py``) is the
configuration that defines the output, which checkpoints compare.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from zephon_torch import length
from zephon_torch import pipeline_operators as _operators
from zephon_torch import pipeline_sources as _sources
from zephon_torch.append import append_shards
from zephon_torch.fingerprint import fingerprint_digest, pipeline_fingerprint
from zephon_torch.ops.base import Operator
from zephon_torch.ops.placement import with_placement
from zephon_torch.pipeline_sources import SourceConfig
from zephon_torch.planner import CompiledStage, compile_plan, flush_every, stage_names
from zephon_torch.relane import change_lanes
from zephon_torch.reweight import change_weights
from zephon_torch.runners.options import RunOptions
from zephon_torch.sources.formats.registry import on_register
from zephon_torch.sources.lane_plan import lane_count
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
    # The source entry points and SourceConfig are written in pipeline_sources.py
    # (one from_<format> per registered format that names a builder, and from_sources).

    from_sources = _sources.from_sources
    from_items = _sources.from_items
    from_jsonl = _sources.from_jsonl
    from_parquet = _sources.from_parquet
    from_text_files = _sources.from_text_files

    # ------------------------------------------------------------------ operators
    #
    # apply() appends any operator; the builders of the built-in operators are
    # written in pipeline_operators.py.

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

    fetch = _operators.fetch
    decode_text = _operators.decode_text
    tokenize = _operators.tokenize
    tokenize_chat = _operators.tokenize_chat
    map_transform = _operators.map_transform
    filter = _operators.filter
    pack_sequences = _operators.pack_sequences
    pack_flat = _operators.pack_flat
    ensure_mixture = _operators.ensure_mixture
    shuffle = _operators.shuffle
    batch = _operators.batch

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

    def change_weights(self, weights: Mapping[int, float] | Sequence[float], *,
                       state: Mapping[str, Any]) -> Pipeline:
        """This mixture with new ``weights`` from ``state``'s step on, to resume it.

        The chunks the state has registered or replays keep the weights they
        were made with; from the first global chunk after them (the same for
        every world size) the round-robin follows the new shares. Resuming
        ``state`` on the result is a run that changed its weights at that
        step; its states carry the change (call this again on the original
        pipeline with a later state: it adds nothing when ``weights`` are
        already in force). See ``zephon_torch/reweight.py`` and
        docs/checkpoints.md, "What a resume may change".

        Example:
            >>> annealed = pipe.change_weights([0.2, 0.8], state=state)  # doctest: +SKIP
            >>> it = annealed.iter(); it.load_state_dict(state)  # doctest: +SKIP

        Raises:
            ValueError: ``state`` is not this pipeline's or not a whole state
                (merge the ranks' states), its stream has ended, or the
                weights are invalid.
        """
        return change_weights(self, weights, state=state)

    def change_lanes(self, num_lanes: int, *, state: Mapping[str, Any]) -> Pipeline:
        """This pipeline with ``num_lanes`` lanes from ``state``'s step on, to resume it
        on more ranks than it has lanes.

        The chunks the state has registered or replays keep their lanes; from
        the first global chunk after them (the same for every world size) the
        chunks go round ``num_lanes`` lanes: the old lanes carry on as they
        were, the new ones start fresh. Resuming ``state`` on the result is a
        run that grew its lanes at that step; its states carry the change
        (calling this again on the original pipeline with a later state adds
        nothing when ``num_lanes`` is already in force). Per-lane settings (a
        shuffle's share of its buffer) stay those of the pipeline as built.
        See ``zephon_torch/relane.py`` and docs/checkpoints.md, "What a resume
        may change".

        Example:
            >>> wider = pipe.change_lanes(64, state=state)  # doctest: +SKIP
            >>> it = wider.iter(rank=40, world_size=64); it.load_state_dict(state)  # doctest: +SKIP

        Raises:
            ValueError: ``state`` is not this pipeline's or not a whole state
                (merge the ranks' states), its stream has ended, or
                ``num_lanes`` is fewer than the state's lanes.
        """
        return change_lanes(self, num_lanes, state=state)

    def append_shards(self, *, state: Mapping[str, Any]) -> Pipeline:
        """This pipeline, over files that grew since ``state``, reading the new ones from
        the next pass on, to resume it.

        Build the pipeline over the files as they are now (the state's shards
        first, unchanged; new ones after them in the dataset's order). The
        pass the saved run is in is finished over the old shards exactly as
        it would have been; from the next pass of the dataset (the same for
        every world size) each pass runs over the grown shards, in the order
        a fresh pipeline over them gives that pass. Its states carry the
        growth (call this again on a later state: it adds only shards
        appended since). See ``zephon_torch/append.py`` and
        docs/checkpoints.md, "What a resume may change".

        Example:
            >>> grown = zt.Pipeline.from_jsonl("data/*.jsonl").batch(8)  # doctest: +SKIP
            >>> it = grown.append_shards(state=state).iter()  # doctest: +SKIP
            >>> it.load_state_dict(state)  # doctest: +SKIP

        Raises:
            ValueError: A mixture, shards of the state removed, changed or
                reordered, a state that is not this pipeline's or not whole
                (merge the ranks' states), or no pass left to join.
        """
        return append_shards(self, state=state)

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
        return self.run(RunOptions(  # checked here, once
            runner=runner, num_workers=num_workers, deterministic=deterministic,
            rank=rank, world_size=world_size, microbatch_sizes=microbatch_sizes, lanes=lanes,
            verify=verify, task_timeout=task_timeout, epoch=epoch,
        ))

    def run(self, options: RunOptions) -> PipelineIterator:
        """Run the pipeline under checked options: the one entry point of every run.

        :meth:`iter` makes the :class:`~zephon_torch.runners.options.RunOptions`
        from its arguments; the integrations (``zephon_torch.DataLoader``,
        the torchdata node, Lightning) make theirs, with the two fields only
        lane workers take (``finish``, ``prefetch``), and come here.

        Returns:
            A :class:`~zephon_torch.runners.iterator.PipelineIterator`.
        """
        from zephon_torch.runners.iterator import PipelineIterator

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
        share = worker_lanes(lane_count(self._source))
        if share is None:
            return self.iter()
        if not share:
            return iter(())
        return self.iter(runner="inline", lanes=share)

    def __repr__(self) -> str:
        chain = "".join(f".{name}()" for name in self.stage_names())
        kinds = ",".join(d.kind for d in self._source.datasets)
        return f"Pipeline<{kinds}>{chain}"


# A format registered with a builder the class does not write out (a user's
# format module, say) gets it derived from its factory, now or when it registers.
on_register(lambda source_format: _sources.attach_builder(Pipeline, source_format))
