"""The operator contract.

An operator is one transformation of the stream (fetch, tokenize, pack,
shuffle, batch ...). It splits its work in two:

* its **accumulator** (``accumulator(deterministic=..., ctx=...)``) sees the
  stage's input one element after another, in stream order, on a single
  thread, decides where micro-batches begin and end, and holds every piece of
  state that spans calls (packing bins, shuffle buffers, partial batches);
* ``process_many(elems)`` turns one micro-batch into its outputs and is
  *stateless*: it may run on any worker, in any order, any number of times,
  and the runner's reorder buffer puts the results back in micro-batch order.

That split is what makes the runner, the worker count and the micro-batch
sizes pure performance knobs::

    upstream ──► accumulator ──► [mb0] [mb1] [mb2] ──► workers ──► reorder ──► downstream
                 (one thread,         (process_many,      (sequence
                  stream order)        any order)          numbers)

A user operator subclasses :class:`Operator` and is added with
``Pipeline.apply(op)``. The minimum is ``process_many``; the default
accumulator groups elements into micro-batches of ``microbatch_size``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, count
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from zephon_torch.block import Block
from zephon_torch.types import SampleBatch, SampleRecord
from zephon_torch.vocab import TOMBSTONE_DETAIL_TAG, TOMBSTONE_REASON_TAG, tombstone_tags

if TYPE_CHECKING:
    from zephon_torch.ops.accumulators import Accumulator

__all__ = [
    "TOMBSTONE_DETAIL_TAG",
    "TOMBSTONE_REASON_TAG",
    "Element",
    "OpContext",
    "OpTraits",
    "Operator",
    "check_elements",
    "live_records",
    "live_rows",
    "operator_class",
    "tombstone",
]

#: What flows between stages: a record, or a batch of records after ``batch()``.
Element = SampleRecord | SampleBatch


@dataclass(frozen=True, kw_only=True, slots=True)
class OpTraits:
    """Static facts about an operator that the planner and runner rely on.

    Attributes:
        preserves_cursor_order: Outputs leave in the cursor order of their
            inputs (children right after their parent's position). Plans
            with an operator that does not (packing, shuffle, mixture) use
            flush sentinels to bound replay.
        accepts_pointers: The operator reads pointer records (only ``fetch``).
        produces_batches: Outputs are :class:`SampleBatch` (only ``batch``).
        fan_out: One input may give several outputs (children with lineage).
        inline: ``process_many`` is trivial glue (wrapping records into a
            batch, a passthrough): run it on the driver thread instead of
            shipping the micro-batch to a worker.
        elementwise: Each input's outputs depend on that input alone and come
            out in input order (``process_many(a + b) == process_many(a) +
            process_many(b)``), tombstones pass through untouched, and the
            operator keeps the default accumulator. The planner may then fuse
            consecutive such stages into one (one micro-batch runs through all
            of them on one worker), which changes no output.
    """

    preserves_cursor_order: bool = True
    accepts_pointers: bool = False
    produces_batches: bool = False
    fan_out: bool = False
    inline: bool = False
    elementwise: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class OpContext:
    """What ``setup`` and ``accumulator`` receive: layout, seed and plan facts.

    Attributes:
        num_lanes: Lanes of the whole job (fixed for the life of a run).
        lanes: The lanes this iterator owns, ascending.
        rank: This consumer's rank.
        world_size: Number of ranks.
        seed: The pipeline's seed for this run: the seed itself in epoch 0,
            derived from it and the epoch otherwise (``zephon_torch.epochs``).
        stage_index: Position of the stage in the compiled plan.
        stage_name: The stage's name (``"tokenize"``, ``"map_transform_2"``).
        microbatch_size: The micro-batch size chosen for this stage (the
            operator's default unless overridden with ``microbatch_sizes``).
        component_weights: Target share of each mixture component, from the
            sources (``None`` for a single dataset).
        plan: Free-form plan metadata (for example ``"has_tokens"``).
        earlier_params: On a resume under a changed parameter that takes effect at
            an epoch boundary (:attr:`Operator.resume_may_change_at_epoch`), per
            lane, ``(until_chunk, params)`` pairs by ascending ``until_chunk``: the
            lane's chunks before ``until_chunk`` (and from the previous pair's on)
            run with ``params`` in place of the operator's own, as the saved run
            ran them; later chunks with the operator as it is. Empty otherwise
            (see ``zephon_torch.resume_changes``).
    """

    num_lanes: int = 1
    lanes: tuple[int, ...] = (0,)
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    stage_index: int = 0
    stage_name: str = ""
    microbatch_size: int | None = None
    component_weights: Mapping[int, float] | None = None
    plan: Mapping[str, Any] = field(default_factory=dict)
    earlier_params: Mapping[int, Sequence[tuple[int, Mapping[str, Any]]]] = field(
        default_factory=dict)


class Operator:
    """Base class of every operator.

    Subclasses override :meth:`process_many` (stateless work on one
    micro-batch) and, when they keep cross-element state, :meth:`accumulator`.
    ``name`` is the stage name stem; ``default_microbatch_size`` is used when
    the plan does not override it.
    """

    name: ClassVar[str] = "apply"
    default_microbatch_size: ClassVar[int] = 64
    #: The size of a lane's first micro-batch under the default accumulator; each
    #: next one is twice as large, up to the stage's size. The first results of a
    #: run (and of a resume) then wait for little work, and the steady state runs
    #: at the full size. Where micro-batches are cut never changes the output of
    #: an operator using the default accumulator. ``None``: full size from the start.
    first_microbatch_size: ClassVar[int | None] = 8
    #: What :meth:`config` names this very class (subclasses do not inherit it) when
    #: that is not its import path: a built-in operator moved to another module keeps
    #: the name that saved states' fingerprints hold. ``None``: ``module.qualname``.
    _config_name: ClassVar[str | None] = None

    def setup(self, ctx: OpContext) -> None:
        """Run once per process before any data arrives (load models, open files)."""

    def for_epoch(self, epoch: int) -> Operator:
        """The operator that runs in ``epoch`` (see ``zephon_torch.epochs``).

        The default is the operator itself. One with randomness of its own
        returns a copy whose randomness folds in the epoch (``shuffle`` does),
        with the same :meth:`config`; epoch 0 must behave exactly as the
        operator itself. An operator that takes its randomness from
        ``ctx.seed`` needs nothing: the context carries the epoch's seed.
        """
        return self

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> Accumulator:
        """Return a fresh accumulator that cuts the input into micro-batches.

        The default groups each lane's elements into micro-batches of
        ``ctx.microbatch_size`` (or ``default_microbatch_size``), the first
        ones growing from ``first_microbatch_size``.
        """
        from zephon_torch.ops.accumulators import CountingAccumulator

        return CountingAccumulator(ctx.microbatch_size or self.default_microbatch_size,
                                   ramp_from=self.first_microbatch_size)

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Transform one micro-batch; must not depend on any earlier call."""
        return list(elems)

    def process_block(self, block: Block) -> Block | list[Element]:
        """Transform one micro-batch held as a block (one lane's rows, in order).

        Built-in operators override it with array code; the engine uses it
        when the stage runs in block mode (the accumulator ``takes_blocks``).
        The default runs :meth:`process_many` on the block's records.
        """
        return self.process_many(block.records())

    def has_block_path(self) -> bool:
        """Whether this operator overrides :meth:`process_block` with a block path."""
        return type(self).process_block is not Operator.process_block

    def process_one(self, elem: Element) -> list[Element]:
        """Transform a single element (by default ``process_many([elem])``)."""
        return self.process_many([elem])

    def traits(self) -> OpTraits:
        """Return the operator's :class:`OpTraits`."""
        return OpTraits()

    def config(self) -> dict[str, Any]:
        """JSON-able parameters that define the output, for the checkpoint fingerprint.

        The default describes the operator by its class; subclasses add their
        parameters. Performance knobs (worker counts, micro-batch sizes) must
        not appear here.
        """
        kind = type(self)
        return {"op": kind.__dict__.get("_config_name")
                or f"{kind.__module__}.{kind.__qualname__}"}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "op")
        return f"{type(self).__name__}({params})"

    # Saved states of an earlier form. A checkpoint names each operator by the digest
    # of its config(); when an operator's config changes form (a new entry recording
    # what a parameter means, say), states saved before no longer match. These hooks
    # let the operator itself, never the checkpoint module, say which of those states
    # still resume (the same output) and how to refuse the others.

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Under the name its configs write (a moved class keeps its earlier one).
        _CLASSES[cls.__dict__.get("_config_name")
                 or f"{cls.__module__}.{cls.__qualname__}"] = cls

    #: Parameters of this operator that a resume may change: where the operator
    #: stands after the resume point (at or after ``batch``, which the replay filter
    #: precedes), it only acts on what comes next, so a state saved with other
    #: values resumes as a run that changed them at that step. ``batch`` names its
    #: size and ``drop_last``.
    resume_may_change: ClassVar[frozenset[str]] = frozenset()
    #: Parameters of this operator, standing before the resume point, that a resume
    #: may change from each lane's next epoch boundary on (``shuffle`` names its
    #: ``buffer_size``): the lane's replayed epochs run with the saved values, which
    #: the accumulator receives in ``ctx.earlier_params`` and must honour (through
    #: :meth:`with_params`); see ``zephon_torch.resume_changes``.
    resume_may_change_at_epoch: ClassVar[frozenset[str]] = frozenset()

    def with_params(self, params: Mapping[str, Any]) -> Operator:
        """A copy of this operator with the parameters ``params`` (by their
        :meth:`config` names) in place of its own, for the epochs a resume replays.

        Only parameters named in :attr:`resume_may_change_at_epoch` are asked for.

        Raises:
            ValueError: A parameter this operator cannot take this way, or a value
                it refuses.
        """
        raise ValueError(f"{type(self).__name__} cannot run with the parameters {dict(params)} "
                         "of a saved state: none of its parameters may change on resume")

    @classmethod
    def earlier_config(cls, config: Mapping[str, Any], saved: Mapping[str, str], *,
                       num_lanes: int) -> dict[str, Any] | None:
        """The config an earlier form of this operator wrote for the output ``config`` gives.

        Asked when a state's digest of this operator differs from this
        pipeline's. A state whose digest is that of the returned config
        resumes as if it matched.

        Args:
            config: This pipeline's ``config()`` of the operator.
            saved: The state's details of the operator: its parameters as
                :func:`~zephon_torch.fingerprint.fingerprint_parts` keeps them
                (JSON text, or a digest when long), by name.
            num_lanes: The source's number of lanes.

        Returns:
            The earlier config, or ``None`` (the default): ``saved`` comes from
            no earlier form that gave this output.
        """
        return None

    @classmethod
    def refuse_earlier_state(cls, differ: Sequence[str], mine: Mapping[str, Any],
                             theirs: Mapping[str, Any], *, num_lanes: int) -> str | None:
        """Why a state saved by an earlier form of this operator cannot resume, or ``None``.

        Asked, for each operator class of this pipeline, when a state's
        fingerprint differs; the first message is the refusal, in place of
        the generic one (which would tell the user to resume with the same
        operators, which they may have done).

        Args:
            differ: The differing parts
                (:func:`~zephon_torch.checkpoint.differing_parts`).
            mine: This pipeline's fingerprint parts.
            theirs: The state's fingerprint parts.
            num_lanes: The state's number of lanes.
        """
        return None


#: Every operator class, by the path its ``config()`` names it with (``"op"``).
_CLASSES: weakref.WeakValueDictionary[str, type[Operator]] = weakref.WeakValueDictionary()


def operator_class(path: str) -> type[Operator] | None:
    """The operator class a config's ``"op"`` entry names (``None``: no such class is loaded)."""
    return _CLASSES.get(path) if isinstance(path, str) else None


def check_elements(result: Any, stage: str) -> list[Element]:
    """Validate what ``process_many`` returned: a list of records or batches.

    Raises:
        TypeError: ``"Unsupported element type: ..."`` for anything else.
    """
    if not isinstance(result, list):
        if isinstance(result, (tuple, SampleBatch)) or result is None:
            raise TypeError(
                f"Unsupported element type: stage {stage!r} process_many returned "
                f"{type(result).__name__}; it must return a list of SampleRecord or "
                "SampleBatch elements"
            )
        result = list(result)
    for elem in result:
        kind = type(elem)
        if kind is not SampleRecord and kind is not SampleBatch and not isinstance(
            elem, (SampleRecord, SampleBatch)
        ):
            raise TypeError(
                f"Unsupported element type: {kind.__name__} from stage {stage!r}; "
                "process_many must return SampleRecord or SampleBatch elements (rebuild the "
                "payload and keep the meta: SampleRecord(elem.meta, new_payload))"
            )
    return result


def live_records(elems: Sequence[Element], stage: str) -> Iterator[tuple[int, SampleRecord]]:
    """``(index, record)`` of each data record of a micro-batch, in order.

    The skip every record-wise operator makes: a control record (a tombstone,
    a flush sentinel) is passed over, and stays in the output at its index
    untouched; only data records reach the operator's work::

        out = list(elems)
        for i, rec in live_records(elems, self.name):
            out[i] = SampleRecord(rec.meta, work(rec.payload))
        return out

    An element that is not a record raises when the iteration reaches it, so
    an error in the work on an earlier record comes first, as in a loop
    written out by hand.

    Raises:
        TypeError: An element is not a :class:`SampleRecord` (a batch: the
            operator was placed after ``batch()``).
    """
    # One comprehension flags what needs a closer look (an element that is not a plain
    # record, or one with tags): a micro-batch with none, the usual one, is then walked
    # by ``enumerate``, and one with control records by ``compress`` over a mask, with
    # no Python frame per record either way.
    odd = [type(rec) is not SampleRecord or rec.meta.tags for rec in elems]
    if not any(odd):
        return enumerate(elems)
    keep = [True] * len(odd)
    for at in compress(count(), odd):
        rec = elems[at]
        if not isinstance(rec, SampleRecord):
            return _checked_records(elems, stage)
        if rec.meta.is_sentinel:
            keep[at] = False
    return compress(enumerate(elems), keep)


def _checked_records(elems: Sequence[Element], stage: str
                     ) -> Iterator[tuple[int, SampleRecord]]:
    """:func:`live_records` one element at a time, for a micro-batch holding a non-record."""
    for i, rec in enumerate(elems):
        if not isinstance(rec, SampleRecord):
            raise TypeError(
                f"{stage} works on SampleRecord elements, got {type(rec).__name__}; "
                "place it before batch()"
            )
        if rec.meta.is_sentinel:
            continue
        yield i, rec


def live_rows(block: Block) -> Sequence[int]:
    """The positions of a block's data rows, ascending: :func:`live_records` for a block.

    Tombstone rows are left out (a block holds no flush sentinels: they travel
    between blocks)::

        tomb [F, T, F, F]  ->  [0, 2, 3]        tomb None (no tombstone)  ->  range(4)
    """
    tomb = block.tomb
    return range(len(block)) if tomb is None else np.flatnonzero(~tomb).tolist()


def tombstone(record: SampleRecord, reason: str, detail: str | None = None) -> SampleRecord:
    """Turn a dropped record into a tombstone that still closes its base offsets.

    The tombstone keeps the record's meta (its cursor and contributors), so
    progress accounting closes exactly what the record would have closed; it
    carries no payload and the ``reason`` under :data:`TOMBSTONE_REASON_TAG`.
    Reasons ending in ``"_error"`` mean a bad sample skipped by
    ``on_error="skip"``; ``detail`` (what was wrong, under
    :data:`TOMBSTONE_DETAIL_TAG`) then reaches ``stats()["bad_samples"]`` and
    the iterator's skip warning.
    """
    meta = record.meta
    return SampleRecord(meta._replace(tags=tombstone_tags(meta.tags, reason, detail)), None)
