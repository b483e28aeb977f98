"""A pipeline as a ``torchdata.nodes`` source node.

:class:`PipelineNode` follows the ``BaseNode`` contract: ``reset(state)``
builds a fresh :class:`~zephon_torch.runners.iterator.PipelineIterator` (the
start of the stream, or the position ``state`` describes), ``next()`` hands
out the iterator's next item, and ``get_state()`` is the iterator's
``state_dict()``: the position after the last item ``next()`` returned. The
node's state *is* the pipeline state, plain JSON-able builtins, so it also
loads into ``pipe.iter()`` or ``zephon_torch.DataLoader`` and merges across
ranks.

It composes with the other nodes because they only rely on that contract::

    node = PipelineNode(pipe, runner="threads")
    node = Mapper(node, lambda batch: batch.to_training())
    node = Prefetcher(node, prefetch_factor=4)     # a thread runs ahead
    node = PinMemory(node)                         # with CUDA
    loader = Loader(node)                          # state_dict / load_state_dict

``Prefetcher`` and ``PinMemory`` snapshot their source's state together with
each item they buffer and report the snapshot of the last item the caller
took, so prefetching never shifts the saved position.
"""

from __future__ import annotations

from typing import Any

from zephon_torch._extras import missing

try:
    from torchdata.nodes import BaseNode
except ModuleNotFoundError as exc:  # an extra: say which one
    if (exc.name or "").split(".")[0] != "torchdata":
        raise
    raise missing("torchdata", "zephon_torch.torch.PipelineNode") from exc

from zephon_torch.pipeline import Pipeline
from zephon_torch.torch.dataset import LiveIterator, checked_pipeline, is_pipeline_state

__all__ = ["PipelineNode"]


class PipelineNode(BaseNode[Any]):
    """A ``torchdata.nodes.BaseNode`` over a pipeline, with exact save and restore.

    Args:
        pipeline: The pipeline to run.
        **iter_kwargs: Passed to :meth:`Pipeline.iter` (``runner``,
            ``num_workers``, ``rank``, ``world_size``, ``lanes``, ``epoch``
            ...). ``epoch=n`` runs the pipeline's epoch ``n`` (a new,
            reproducible order, see ``docs/epochs.md``) at every ``reset``;
            without it, ``reset(state)`` continues in the state's epoch.

    Raises:
        TypeError: ``pipeline`` is not a :class:`~zephon_torch.Pipeline`.
        ValueError: An unknown keyword for ``Pipeline.iter``.
    """

    def __init__(self, pipeline: Pipeline, **iter_kwargs: Any) -> None:
        super().__init__()
        self.pipeline = checked_pipeline("PipelineNode", pipeline, iter_kwargs)
        self.iter_kwargs = dict(iter_kwargs)
        self._live: LiveIterator | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Start over, from the beginning or from ``initial_state``.

        Raises:
            ValueError: ``initial_state`` is not a pipeline state, or one of
                another configuration (see ``PipelineIterator.load_state_dict``).
        """
        super().reset(initial_state)
        self.close()
        self._live = None
        if initial_state is not None and not is_pipeline_state(initial_state):
            raise ValueError(
                f"PipelineNode.reset takes a pipeline state (from get_state/state_dict), got "
                f"keys {sorted(initial_state)[:6]}"
            )
        iterator = self.pipeline.iter(**self.iter_kwargs)
        if initial_state is not None:
            try:
                iterator.load_state_dict(initial_state)
            except BaseException:
                iterator.close()
                raise
        self._live = LiveIterator(iterator)

    def next(self) -> Any:
        """The next item (``SampleBatch`` after ``.batch()``); StopIteration at the end."""
        if self._live is None:  # BaseNode resets before the first next(); be safe anyway
            self.reset(None)
        return next(self._live)  # type: ignore[arg-type]

    def get_state(self) -> dict[str, Any]:
        """The position after the last item returned by :meth:`next`."""
        if self._live is None:
            self.reset(None)
        return self._live.position()  # type: ignore[union-attr]

    def close(self) -> None:
        """Release the iterator's workers (they are also released when it ends).

        The position stays readable with ``get_state()``; ``reset()`` starts again.
        """
        if self._live is not None:
            self._live.close()

    def __repr__(self) -> str:
        return f"PipelineNode({self.pipeline!r})"
