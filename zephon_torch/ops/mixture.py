"""``ensure_mixture``: keep each lane's output close to the target component shares.

The work schedule already interleaves components in proportion, but what
reaches this stage can drift: filters drop samples, documents differ in
length, packing merges several into one row. The mixture accumulator buffers
each lane's records in one FIFO queue per component and releases them in the
order of a *smooth weighted round-robin* (SWRR) over the target weights
``w[c]`` (total ``W``), measured in the unit chosen by ``weight_by``.

Per lane it keeps a current weight ``cur[c]`` (0 at the start and after every
reset flush). One emission step:

1. Among components with a buffered record, pick the one with the largest
   ``cur[c] + w[c] * s[c]``, where ``s[c]`` is the size of that component's
   oldest record; ties go to the lowest component id.
2. Emit that oldest record (size ``s``): every component gains ``w[c] * s``
   and each component ``k`` inside the record loses ``W * part[k]`` (its share
   of ``s``; a plain record is one part of size ``s``). The weights always
   sum to 0; ``cur[c] / W`` is how far ``c`` is behind its share.

With unit sizes this is the classic SWRR (add ``w``, pick the largest,
subtract ``W``). Example: targets ``{0: 2, 1: 1}``, weight by samples, lane
input ``a0 b0 c1 d1 e0 f0`` (letter, component)::

    arrival  queues (0 | 1)   scores cur+w  emits  cur after
    a0       a | -            -             -      (0, 0)    1 has nothing: wait
    b0       a b | -          -             -      (0, 0)
    c1       a b | c          (2, 1)        a      (-1, 1)
                   b | c      (1, 2)        c      (1, -1)   1 empty again: wait
    d1       b | d            (3, 0)        b      (0, 0)
    e0       e | d            (2, 1)        e      (-1, 1)
    f0       f | d            (1, 2)        d      (1, -1)
    flush    f | -            (3, -)        f      lane reset to (0, 0)

Output components ``0 1 0 0 1 0``: two of 0 for each 1, as smooth as the
input allows.

When steps run: after each arrival, while every component with a positive
target has a buffered record (so the choice is a real one), or while the
lane holds more than ``max_buffer_size`` records (then from what is there).
A component that stays missing keeps gaining weight meanwhile, so it is
favoured when it returns, until the lane's next reset flush clears the debt.
Nothing is ever dropped; ``flush(reset=True, lane_id=l)`` runs steps until
lane ``l`` is empty and resets its weights, and ``flush()`` at the end does
every lane in ascending order.

Attribution: a packed record may hold several components. It waits in the
queue of its *dominant* component (the largest part in the ``weight_by``
unit, ties to the lowest id), while its emission is accounted to every
targeted component by its part, so packed rows do not bias the ratios.
Records of components without a positive target (and records that name no
component) have no share to keep: they pass straight through, in arrival
order. Without targets (no ``mixture`` and no source weights) every
component a lane has seen as dominant gets an equal weight.

Sizes (``weight_by``): ``"samples"`` counts base samples
(``component_sample_counts``); ``"tokens"`` uses ``component_token_counts``
when set, else the length of the payload's token field (``input_ids``,
``tokens``, ``token_ids`` or ``ids``; a bare array payload; the members of
``packed_samples``) split in proportion to the sample counts; a field name
uses ``len(payload[field])``; a callable ``fn(record) -> float`` is used as
is; ``"auto"`` means tokens when the plan says tokens exist, samples when it
says they do not, and otherwise decides per record (tokens when the record
has token counts or a token field).
"""

from __future__ import annotations

import math
import numbers
from bisect import insort
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from zephon_torch.block import Block
from zephon_torch.ops.accumulators import Accumulator, lane_of
from zephon_torch.ops.base import OpContext, Operator, OpTraits
from zephon_torch.sources.mixing import files_of
from zephon_torch.types import SampleRecord
from zephon_torch.vocab import AUTO_TOKEN_FIELDS

__all__ = ["WEIGHT_MODES", "EnsureMixture", "MixtureAccumulator", "WeightBy"]

#: The named ``weight_by`` modes; any other string is a payload field name.
WEIGHT_MODES = ("auto", "samples", "tokens")
#: ``weight_by``: a mode, a payload field name, or ``fn(record) -> float``.
WeightBy = str | Callable[[SampleRecord], float]

# The token fields to_training recognises, in its order.
_TOKEN_FIELDS = AUTO_TOKEN_FIELDS


class _Lane:
    """One lane's state: per-component queues and SWRR weights."""

    __slots__ = ("buffered", "current", "missing", "order", "queues", "total", "weights")

    def __init__(self, weights: dict[int, float], order: list[int], total: float) -> None:
        # In target mode these three are shared, read-only; without targets
        # the lane owns them and grows them as it sees components.
        self.weights = weights
        self.order = order
        self.total = total
        self.queues: dict[int, deque[tuple[SampleRecord, dict[int, float], float]]] = {}
        self.current: dict[int, float] = {}
        self.buffered = 0
        # Targeted components with nothing buffered; 0 means a real choice.
        self.missing = len(order)


class _Row:
    """A row of a block as the mixture's decisions read it: its meta and payload.

    The decisions (:meth:`MixtureAccumulator._classify`) are the record path's;
    they read ``meta.component_sample_counts``, ``component_token_counts``
    and, for token weights, the payload, which this view builds only when read.
    """

    __slots__ = ("block", "owner", "row")

    def __init__(self, block: Block, owner: int, row: int) -> None:
        self.block = block
        self.owner = owner
        self.row = row

    @property
    def meta(self) -> _Row:
        return self

    @property
    def component_sample_counts(self) -> dict[int, int]:
        return self.block._counts_list()[self.row]

    @property
    def component_token_counts(self) -> dict[int, int] | None:
        tokens = self.block.token_counts
        return None if tokens is None else tokens[self.row]

    @property
    def payload(self) -> Any:
        return self.block.payload(self.row)

    @property
    def lane_id(self) -> int:
        return self.block.lane

    def as_cursor_key(self) -> tuple[Any, ...]:
        return self.block.cursor_key(self.row)

    def record(self) -> SampleRecord:
        return self.block.record(self.row)


# Blocks a lane's buffers may refer to before their rows are copied out of them.
_POOL_LIMIT = 32


class MixtureAccumulator(Accumulator):
    """The accumulator of ``ensure_mixture``: per-lane SWRR over component queues.

    Args:
        targets: Component -> nonnegative weight, or ``None`` for equal
            weights among the components each lane sees.
        weight_by: ``"samples"``, ``"tokens"``, ``"auto"`` (decided per
            record), a payload field name, or ``fn(record) -> float``.
        max_buffer_size: Most records a lane holds after an arrival.

    ``push_many`` returns one micro-batch per lane that emitted anything
    during the call, in emission order.

    Raises:
        ValueError: Invalid ``targets``, ``weight_by`` or ``max_buffer_size``.
    """

    def __init__(self, targets: Mapping[int, float] | None, *, weight_by: WeightBy = "samples",
                 max_buffer_size: int = 1000) -> None:
        _check_weight_by(weight_by)
        _check_max_buffer_size(max_buffer_size)
        self.targets = None if targets is None else _check_weights(targets, "mixture weights")
        self.weight_by = weight_by
        self.max_buffer_size = max_buffer_size
        # Meta counts suffice for samples; everything else may need the payload.
        self.reads_payload = weight_by != "samples"
        if self.targets is not None:
            self._weights = {c: w for c, w in self.targets.items() if w > 0}
            self._order = sorted(self._weights)
            self._total = sum(self._weights.values())
        self._lanes: dict[int, _Lane] = {}
        self._pools: dict[int, list[Block]] = {}

    takes_blocks = True

    def push_block(self, block: Block) -> list[Block]:
        """:meth:`push_many` for a block: the same decisions, over views of its rows."""
        lane = block.lane
        pool = self._pools.setdefault(lane, [])
        owner = len(pool)
        pool.append(block)
        out = self.push_many([_Row(block, owner, i) for i in range(len(block))])
        emitted = [row for batch in out for row in batch]
        result = [self._gather(lane, emitted)] if emitted else []
        if len(pool) > _POOL_LIMIT:
            self._compact(lane)
        return result

    def _gather(self, lane: int, rows: list[_Row]) -> Block:
        return Block.gather(self._pools[lane], [r.owner for r in rows], [r.row for r in rows])

    def _compact(self, lane: int) -> None:
        """Copy the rows still buffered out of the blocks they came in, into one block."""
        st = self._lanes.get(lane)
        held = [entry for queue in st.queues.values() for entry in queue] if st else []
        if not held:
            self._pools[lane] = []
            return
        block = self._gather(lane, [entry[0] for entry in held])
        for i, entry in enumerate(held):
            row = entry[0]
            row.block, row.owner, row.row = block, 0, i
        self._pools[lane] = [block]

    # ------------------------------------------------------------------ interface

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        out: dict[int, list[Any]] = {}
        limit = self.max_buffer_size
        for rec in elems:
            lane = lane_of(rec)
            st = self._lanes.get(lane)
            if st is None:
                st = self._lanes[lane] = self._new_lane()
            emitted = out.get(lane)
            if emitted is None:
                emitted = out[lane] = []
            comp, parts, size = self._classify(st, rec)
            if comp is None:
                emitted.append(rec)
                continue
            queue = st.queues.get(comp)
            if queue is None:
                queue = st.queues[comp] = deque()
            if not queue:
                st.missing -= 1
            queue.append((rec, parts, size))
            st.buffered += 1
            while st.buffered and (st.missing == 0 or st.buffered > limit):
                emitted.append(self._emit_one(st))
        return [batch for batch in out.values() if batch]

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[Any]:
        lanes = sorted(self._lanes) if lane_id is None else [lane_id]
        out: list[Any] = []
        for lane in lanes:
            # Dropping the state is the reset: the lane starts over fresh.
            st = self._lanes.pop(lane, None)
            if st is None:
                continue
            batch = [self._emit_one(st) for _ in range(st.buffered)]
            if batch and type(batch[0]) is _Row:
                out.append(self._gather(lane, batch))
            elif batch:
                out.append(batch)
            self._pools.pop(lane, None)
        return out

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        return self.buffered_count(lane_id) > 0

    def buffered_count(self, lane_id: int | None = None) -> int:
        """Records held for ``lane_id`` (or for all lanes)."""
        if lane_id is None:
            return sum(st.buffered for st in self._lanes.values())
        st = self._lanes.get(lane_id)
        return 0 if st is None else st.buffered

    # ------------------------------------------------------------------ internals

    def _new_lane(self) -> _Lane:
        if self.targets is None:
            return _Lane({}, [], 0)
        return _Lane(self._weights, self._order, self._total)

    def _classify(self, st: _Lane, rec: Any) -> tuple[int | None, dict[int, float], float]:
        """The queue a record joins, its targeted parts and its size (their sum)."""
        parts = self._parts(rec)
        if self.targets is None and parts:
            dominant = _dominant(parts)
            if dominant not in st.weights:
                st.weights[dominant] = 1
                insort(st.order, dominant)
                st.total += 1
                st.missing += 1
        weights = st.weights
        targeted = {c: p for c, p in parts.items() if c in weights}
        if not targeted:
            return None, targeted, 0
        return _dominant(targeted), targeted, sum(targeted.values())

    def _parts(self, rec: Any) -> dict[int, float]:
        """The record's size per component, in the ``weight_by`` unit."""
        meta = rec.meta
        counts = meta.component_sample_counts
        if not counts:
            return {}
        mode = self.weight_by
        if mode == "auto":
            has_tokens = bool(meta.component_token_counts) or (
                _token_count(rec.payload) is not None
            )
            mode = "tokens" if has_tokens else "samples"
        if mode == "samples":
            return dict(counts)
        if mode == "tokens":
            if meta.component_token_counts:
                return dict(meta.component_token_counts)
            total = _token_count(rec.payload)
            if total is None:
                raise ValueError(
                    f"ensure_mixture(weight_by='tokens'): record {meta.as_cursor_key()} has no "
                    f"component_token_counts and no token field ({', '.join(_TOKEN_FIELDS)}); "
                    "tokenize before ensure_mixture or weigh by 'samples'"
                )
        elif callable(mode):
            total = mode(rec.record() if type(rec) is _Row else rec)  # the user sees records
            if (not isinstance(total, numbers.Real) or isinstance(total, bool)
                    or not math.isfinite(total) or total < 0):
                raise ValueError(
                    f"ensure_mixture weight_by function returned {total!r} for record "
                    f"{meta.as_cursor_key()}; it must return a finite number >= 0"
                )
        else:
            payload = rec.payload
            if not isinstance(payload, Mapping) or mode not in payload:
                raise ValueError(
                    f"ensure_mixture(weight_by={mode!r}): record {meta.as_cursor_key()} has no "
                    f"payload field {mode!r}"
                )
            total = len(payload[mode])
        if len(counts) == 1:
            return {c: total for c in counts}
        n = sum(counts.values())
        return {c: total * k / n for c, k in counts.items()}

    def _emit_one(self, st: _Lane) -> SampleRecord:
        """One SWRR step: pick a component, emit its oldest record, update weights."""
        best = -1
        best_score = 0.0
        current = st.current
        weights = st.weights
        for c in st.order:  # ascending, and ">" below: ties go to the lowest id
            queue = st.queues.get(c)
            if not queue:
                continue
            score = current.get(c, 0) + weights[c] * queue[0][2]
            if best < 0 or score > best_score:
                best, best_score = c, score
        queue = st.queues[best]
        rec, parts, size = queue.popleft()
        st.buffered -= 1
        if not queue:
            st.missing += 1
        for c in st.order:
            current[c] = current.get(c, 0) + weights[c] * size
        total = st.total
        for c, part in parts.items():
            current[c] -= total * part
        return rec


class EnsureMixture(Operator):
    """Reorder each lane so its component shares track the target mixture.

    Args:
        weight_by: ``"auto"``, ``"samples"``, ``"tokens"``, a payload field
            name, or ``fn(record) -> float`` (see the module docstring).
        max_buffer_size: Most records a lane may hold while waiting for a
            missing component; beyond it records leave from what is there.
        mixture: Component -> weight; ``None`` uses the sources' weights
            (``ctx.component_weights``), or equal weights when there are none.

    Raises:
        ValueError: ``max_buffer_size`` is not a positive integer, a weight is
            negative or not finite, the weights sum to 0, or ``weight_by`` is
            neither a non-empty string nor a callable. When the run starts:
            ``mixture`` gives a positive weight to a component the sources
            never read (no such source, no samples, or source weight 0), whose
            share would never come (the others would silently take it).
    """

    name = "ensure_mixture"

    def __init__(self, *, weight_by: WeightBy = "auto", max_buffer_size: int = 1000,
                 mixture: Mapping[int, float] | None = None) -> None:
        _check_weight_by(weight_by)
        _check_max_buffer_size(max_buffer_size)
        self.weight_by = weight_by
        self.max_buffer_size = max_buffer_size
        self.mixture = None if mixture is None else _check_weights(mixture, "mixture")

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> Accumulator:
        """Return a :class:`MixtureAccumulator` toward ``mixture`` or the source weights.

        ``weight_by="auto"`` reads ``ctx.plan["has_tokens"]`` when the planner
        set it; otherwise the accumulator decides per record.
        """
        targets = self.mixture
        if targets is None and ctx.component_weights is not None:
            targets = _check_weights(ctx.component_weights, "source component weights")
        elif targets is not None and "datasets" in ctx.plan:
            _check_fed(targets, ctx.plan["datasets"].values(), ctx.component_weights)
        weight_by = self.weight_by
        if weight_by == "auto" and "has_tokens" in ctx.plan:
            weight_by = "tokens" if ctx.plan["has_tokens"] else "samples"
        return MixtureAccumulator(targets, weight_by=weight_by,
                                  max_buffer_size=self.max_buffer_size)

    def process_block(self, block: Block) -> Block:
        """All the work is in the accumulator: the rows pass as they are."""
        return block

    def traits(self) -> OpTraits:
        """Mixture correction reorders, so plans with it use flush sentinels.

        All its work is in the accumulator: the passthrough ``process_many``
        runs on the driver thread.
        """
        return OpTraits(preserves_cursor_order=False, inline=True)

    def config(self) -> dict[str, Any]:
        """The parameters that define the output."""
        weight_by = self.weight_by
        if callable(weight_by):
            weight_by = f"{weight_by.__module__}.{weight_by.__qualname__}"
        mixture = self.mixture
        pairs = None if mixture is None else [[c, w] for c, w in sorted(mixture.items())]
        return {**super().config(), "weight_by": weight_by,
                "max_buffer_size": self.max_buffer_size, "mixture": pairs}


# ---------------------------------------------------------------------- helpers


def _dominant(parts: Mapping[int, float]) -> int:
    # Largest part; ties to the lowest component id.
    return min(parts, key=lambda c: (-parts[c], c))


def _token_count(payload: Any) -> int | None:
    """Token count of a payload, or ``None`` when it has no token field."""
    if isinstance(payload, Mapping):
        for name in _TOKEN_FIELDS:
            if name in payload:
                return len(payload[name])
        members = payload.get("packed_samples")
        if isinstance(members, (list, tuple)):
            counts = [_token_count(m) for m in members]
            if counts and all(n is not None for n in counts):
                return sum(counts)  # type: ignore[arg-type]
        return None
    if isinstance(payload, (str, bytes, bytearray, memoryview)) or payload is None:
        return None
    if hasattr(payload, "__len__") and (hasattr(payload, "__array__") or isinstance(payload, list)):
        return len(payload)
    return None


def _check_weights(weights: Any, what: str) -> dict[int, float]:
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(f"{what} must be a non-empty mapping component -> weight, got {weights!r}")
    checked: dict[int, float] = {}
    for comp, weight in weights.items():
        if not isinstance(comp, numbers.Integral) or isinstance(comp, bool):
            raise ValueError(f"{what}: component ids must be integers, got {comp!r}")
        if (not isinstance(weight, numbers.Real) or isinstance(weight, bool)
                or not math.isfinite(weight) or weight < 0):
            raise ValueError(
                f"{what}: weight of component {comp} must be a finite number >= 0, got {weight!r}"
            )
        # Integer weights stay integers so SWRR arithmetic is exact.
        checked[int(comp)] = int(weight) if isinstance(weight, numbers.Integral) else float(weight)
    total = sum(checked.values())
    if total <= 0:
        raise ValueError(f"{what} must sum to more than 0, got {weights!r}")
    if not math.isfinite(total):
        raise ValueError(f"{what} sum to inf (too large to add up in floating point), got "
                         f"{weights!r}; scale them down: only their ratios matter")
    return checked


def _check_fed(targets: Mapping[int, float], datasets: Iterable[Any],
               source_weights: Mapping[int, float] | None) -> None:
    """Refuse a positive target for a component the sources never read."""
    datasets = list(datasets)
    fed = ({c for c, w in source_weights.items() if w > 0} if source_weights is not None
           else {d.component_id for d in datasets if len(d) > 0})
    for comp, weight in sorted(targets.items()):
        if weight <= 0 or comp in fed:
            continue
        own = [d for d in datasets if d.component_id == comp]
        if not own:
            why = (f"no source has component {comp} (components: "
                   f"{sorted({d.component_id for d in datasets})})")
        else:
            why = "; ".join(
                f"dataset {d.name!r} holds no samples (files: {files_of(d)})" if not len(d)
                else f"dataset {d.name!r} has weight 0 in the sources" for d in own)
        raise ValueError(
            f"ensure_mixture: mixture gives component {comp} weight {weight!r}, but no sample "
            f"of component {comp} is read: {why}. Its share would never come and the other "
            f"components would silently fill it; give component {comp} weight 0 in mixture=, "
            "or give the sources samples (and a share) for it"
        )


def _check_weight_by(weight_by: Any) -> None:
    if callable(weight_by):
        return
    if not isinstance(weight_by, str) or not weight_by:
        raise ValueError(
            f"weight_by must be one of {', '.join(repr(m) for m in WEIGHT_MODES)}, a payload "
            f"field name or a callable, got {weight_by!r}"
        )


def _check_max_buffer_size(max_buffer_size: Any) -> None:
    if (not isinstance(max_buffer_size, int) or isinstance(max_buffer_size, bool)
            or max_buffer_size < 1):
        raise ValueError(
            f"ensure_mixture max_buffer_size must be a positive integer, got {max_buffer_size!r}"
        )
