"""The work schedule: which samples form which chunk, and which lane gets it.

The schedule is a pure function of the configuration (datasets and their
sizes, weights, ``chunk_size``, ``num_lanes``, ``seed``, passes), so every
rank computes the same one and keeps only its own chunks.

**One dataset.** Its *stream* is pass 0, then pass 1, ...; inside a pass the
shards come in a seeded order and, for random-access shards, the samples of
a shard in a seeded *block* order (reshuffled per pass): the shard's read
blocks (:meth:`Dataset.blocks <zephon_torch.sources.base.Dataset.blocks>`:
Parquet row groups, about a megabyte of JSONL lines) in a seeded order, and
the samples of each block in a seeded order, so that a block is read about
once per pass instead of once per micro-batch that touches it (the shuffle
buffers downstream mix across blocks). Shard of 3 blocks ``A = 0-3``,
``B = 4-5``, ``C = 6-9``, block order ``C A B``::

    shard positions   0 1 2 3 | 4 5 6 7 | 8 9
    block             C C C C | A A A A | B B
    local ids         8 6 9 7 | 1 3 0 2 | 5 4      (each block permuted within)

Every order is a pure function of ``(seed, dataset, pass, shard, block)``
and of the blocks' layout, computed on demand with the memory-free
permutation of ``permute.py``: no per-sample array of a shard is ever made.
A shard of one block is ordered as it was before blocks existed. Sequential
(``"stream"``) shards keep file order. Position ``k`` of the stream is pass
``k // size``.

**Several datasets (a mixture).** Global position ``n`` takes its next
pointer from the component with the largest deficit ``(n + 1) * w_c -
count_c`` (ties: lowest component), which is smooth weighted round-robin: a
100-pointer chunk at 70/30 holds 70 and 30, interleaved. The state is just
``count_c`` per component, so a chunk is regenerated from its start counts.
Weights that change at a global chunk ``G`` (a resume under new weights,
``weight_plan.py``) restart the deficit there: ``(n - n(G) + 1) * w'_c -
(count_c - count_c(G))``; the schedule keeps each change's ``G`` and counts,
so a state is still just the counts.

**Chunks and lanes.** The global stream is cut into chunks of
``chunk_size`` pointers; global chunk ``g`` goes to lane ``g % num_lanes``
as its lane-local ``chunk_id = g // num_lanes``::

    global chunks   0   1   2   3   4   5   6   7 ...   (num_lanes = 3)
    lane            0   1   2   0   1   2   0   1
    chunk_id        0   0   0   1   1   1   2   2

A run may grow its lanes from a global chunk on (``lane_plan.py``); the
dealing before that chunk is the one above.

**The end.** A single dataset ends after its passes (``None``: never). A
mixture with ``exhausted="repeat"`` ends once every dataset has finished its
passes (the early finishers repeat, reshuffled); with ``"stop"`` it ends when
the first dataset runs out. The last chunk may be short. ``mixing.py`` works
out from the weights, sizes and passes about how long that is (a tiny weight
with ``"repeat"`` makes it very long: a warning, or an error beyond 2**53),
and refuses a weight that is not finite or a share given to a dataset with no
samples.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_torch.sources.base import Dataset, Shard
from zephon_torch.sources.lane_plan import LaneChange, LanePlan
from zephon_torch.sources.mixing import check_shares, check_weights, length_warning, stream_length
from zephon_torch.sources.permute import permute, seed_key
from zephon_torch.sources.shard_growth import growth_of, segments
from zephon_torch.sources.weight_plan import WeightChange

__all__ = ["Chunk", "ScheduleState", "WorkSchedule", "block_layout", "checked_blocks"]


@dataclass(frozen=True, slots=True)
class ScheduleState:
    """Where the schedule stands: the next global chunk and per-dataset counts."""

    global_chunk: int
    counts: tuple[int, ...]

    def to_json(self) -> list[int]:
        """Compact JSON form: ``[global_chunk, count_0, count_1, ...]``."""
        return [self.global_chunk, *self.counts]

    @staticmethod
    def from_json(value: Sequence[int]) -> ScheduleState:
        """Inverse of :meth:`to_json`."""
        return ScheduleState(int(value[0]), tuple(int(v) for v in value[1:]))


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of pointers, with everything needed to build its records.

    Attributes:
        start: The schedule state this chunk was generated from (its compact
            description in a checkpoint).
        lane_id: The lane that owns it.
        chunk_id: Its lane-local index.
        dataset_ids, shard_ids, local_ids: One entry per pointer, in order.
    """

    start: ScheduleState
    lane_id: int
    chunk_id: int
    dataset_ids: np.ndarray
    shard_ids: np.ndarray
    local_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.local_ids)


class _DatasetStream:
    """Maps stream positions of one dataset to ``(shard_id, local_id)``."""

    def __init__(self, dataset_id: int, dataset: Dataset, seed: int, shuffle: bool) -> None:
        self.dataset_id = dataset_id
        self.dataset = dataset
        self.shards: list[Shard] = dataset.shards()
        self.sizes = np.array([s.num_samples for s in self.shards], dtype=np.int64)
        self.size = int(self.sizes.sum())
        self.seed = seed
        self.shuffle = shuffle
        #: Shards appended during the run (``shard_growth.py``): ``(first pass, first
        #: position, shard count, pass size)`` per segment; None when it never grew.
        growth = growth_of(dataset)
        self.segments = segments(growth, self.sizes.tolist()) if growth else None
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # Per shard, its block starts; per (shard, pass), its block order. Bounded:
        # a pass moves through shards one after another.
        self._starts: OrderedDict[int, np.ndarray] = OrderedDict()
        self._block_orders: OrderedDict[tuple[int, int], _BlockOrder] = OrderedDict()

    def _segment(self, pass_index: int) -> tuple[int, int, int, int]:
        """The segment (``shard_growth.py``) pass ``pass_index`` lies in."""
        assert self.segments is not None
        for segment in reversed(self.segments):
            if segment[0] <= pass_index:
                return segment
        return self.segments[0]

    def pass_start(self, pass_index: int) -> int:
        """The stream position pass ``pass_index`` starts at."""
        if self.segments is None:
            return pass_index * self.size
        first, start, _, size = self._segment(pass_index)
        return start + (pass_index - first) * size

    def _passes_of(self, positions: np.ndarray) -> np.ndarray:
        """The pass of each stream position (ascending int64)."""
        if self.segments is None:
            return positions // self.size
        starts = np.array([s[1] for s in self.segments], dtype=np.int64)
        which = np.searchsorted(starts, positions, side="right") - 1
        out = np.empty(len(positions), dtype=np.int64)
        for i in np.unique(which).tolist():
            first, start, _, size = self.segments[i]
            sel = which == i
            out[sel] = first + (positions[sel] - start) // max(size, 1)
        return out

    def _pass_layout(self, pass_index: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard order of a pass and the cumulative sizes in that order."""
        layout = self._orders.get(pass_index)
        if layout is None:
            count = (len(self.shards) if self.segments is None
                     else self._segment(pass_index)[2])
            order = np.arange(count, dtype=np.int64)
            if self.shuffle and count > 1:
                order = permute(order, count, seed_key(self.seed, self.dataset_id, pass_index))
            layout = (order, np.cumsum(self.sizes[order]))
            if len(self._orders) > 4:
                self._orders.clear()
            self._orders[pass_index] = layout
        return layout

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard and local ids of stream ``positions`` (ascending int64)."""
        passes = self._passes_of(positions)
        if len(passes) and passes[0] == passes[-1]:  # ascending: all of one pass
            return self._locate_in_pass(int(passes[0]), positions)
        shard_ids = np.empty(len(positions), dtype=np.int64)
        local_ids = np.empty(len(positions), dtype=np.int64)
        for pass_index in np.unique(passes).tolist():
            sel = passes == pass_index
            shard_ids[sel], local_ids[sel] = self._locate_in_pass(pass_index, positions[sel])
        return shard_ids, local_ids

    def _locate_in_pass(self, pass_index: int, positions: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
        offsets = positions - self.pass_start(pass_index)
        if len(self.sizes) == 1 and not self.shuffle:  # one shard, in order: no search
            return np.zeros(len(offsets), dtype=np.int64), offsets.astype(np.int64, copy=False)
        order, ends = self._pass_layout(pass_index)
        slot = np.searchsorted(ends, offsets, side="right")
        shard = order[slot]
        within = offsets - (ends[slot] - self.sizes[shard])
        if self.shuffle:
            within = self._shuffle_within(shard, within, pass_index)
        return shard.astype(np.int64, copy=False), within.astype(np.int64, copy=False)

    def _shuffle_within(self, shard: np.ndarray, within: np.ndarray,
                        pass_index: int) -> np.ndarray:
        out = within.copy()
        for shard_id in np.unique(shard).tolist():
            info = self.shards[shard_id]
            if info.access == "stream":  # sequential only: keep file order
                continue
            sel = shard == shard_id
            key = seed_key(self.seed, self.dataset_id, pass_index, shard_id)
            starts = self.block_starts(shard_id)
            if len(starts) == 1:  # one block: the whole shard permuted, as ever
                out[sel] = permute(within[sel], info.num_samples, key)
            else:
                out[sel] = self._block_order(shard_id, pass_index, key, starts).map(within[sel])
        return out

    def block_starts(self, shard_id: int) -> np.ndarray:
        """The shard's block starts, checked (cached for a few shards)."""
        starts = self._starts.get(shard_id)
        if starts is None:
            starts = checked_blocks(self.dataset, shard_id, self.shards[shard_id].num_samples)
            self._starts[shard_id] = starts
            if len(self._starts) > _CACHED_SHARDS:
                self._starts.popitem(last=False)
        return starts

    def _block_order(self, shard_id: int, pass_index: int, key: int,
                     starts: np.ndarray) -> _BlockOrder:
        cache_key = (shard_id, pass_index)
        order = self._block_orders.get(cache_key)
        if order is None:
            order = _BlockOrder(starts, self.shards[shard_id].num_samples, key)
            self._block_orders[cache_key] = order
            cached = self._block_orders
            while len(cached) > 1 and (len(cached) > _CACHED_SHARDS or sum(
                    len(o.starts) for o in cached.values()) > _CACHED_BLOCKS):
                cached.popitem(last=False)
        return order


#: Shards whose block starts (and block orders, per pass) a stream keeps ...
_CACHED_SHARDS = 16
#: ... and at most this many blocks of block orders in all (32 bytes a block),
#: beyond the one in use.
_CACHED_BLOCKS = 1 << 20
#: Folded into a shard's key for the order of its blocks (the samples of block
#: ``b`` use the shard's key folded with ``b``).
_BLOCK_ORDER = 0xB10C


class _BlockOrder:
    """A shard's position -> local id map for one pass: blocks, then samples in a block.

    Holds three arrays of one entry per block (never per sample): the block
    permutation, the blocks' sizes and their cumulative ends in the permuted
    order.
    """

    __slots__ = ("ends", "key", "order", "sizes", "starts")

    def __init__(self, starts: np.ndarray, num_samples: int, key: int) -> None:
        count = len(starts)
        self.starts = starts
        self.sizes = np.diff(np.append(starts, num_samples))
        self.order = permute(np.arange(count, dtype=np.int64), count,
                             seed_key(key, _BLOCK_ORDER))
        self.ends = np.cumsum(self.sizes[self.order])
        self.key = key

    def map(self, within: np.ndarray) -> np.ndarray:
        """Local ids of shard positions ``within`` (in ``[0, num_samples)``)."""
        slot = np.searchsorted(self.ends, within, side="right")
        block = self.order[slot]
        offset = within - (self.ends[slot] - self.sizes[block])
        out = np.empty_like(within)
        # Group the positions by block (a chunk usually spans one or two).
        by_block = np.argsort(block, kind="stable")
        sorted_blocks = block[by_block]
        cuts = np.flatnonzero(sorted_blocks[1:] != sorted_blocks[:-1]) + 1
        for group in np.split(by_block, cuts):
            if not group.size:
                continue
            b = int(block[group[0]])
            size = int(self.sizes[b])
            out[group] = int(self.starts[b]) + permute(offset[group], size,
                                                        seed_key(self.key, b))
        return out


def _normalised(raw: Sequence[float]) -> list[float]:
    """Weights divided by their sum (all 0 when they sum to 0)."""
    total = float(sum(raw))
    return [w / total for w in raw] if total > 0 else [0.0] * len(raw)


def checked_blocks(dataset: Dataset, shard_id: int, num_samples: int) -> np.ndarray:
    """``dataset.blocks(shard_id)`` as int64, or a ValueError saying what is wrong with it."""
    raw = dataset.blocks(shard_id)
    starts = np.asarray(raw)
    if num_samples == 0 and starts.size == 0:
        return np.zeros(0, dtype=np.int64)
    if (starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer) or not starts.size
            or int(starts[0]) != 0 or int(starts[-1]) >= num_samples
            or bool((starts[1:] <= starts[:-1]).any())):
        shown = np.array2string(starts, threshold=8) if isinstance(raw, np.ndarray) else repr(raw)
        raise ValueError(
            f"dataset {dataset.name!r} (kind {dataset.kind!r}): blocks({shard_id}) returned "
            f"{shown[:200]}; it must be a 1-D integer array of block starts, ascending, "
            f"beginning at 0, each below the shard's {num_samples} samples (fix the "
            "dataset's blocks() method)"
        )
    return starts.astype(np.int64, copy=False)


def block_layout(datasets: Sequence[Dataset]) -> list[list[Any]]:
    """What of the datasets' block layout decides a shuffled order, for fingerprints.

    One ``[dataset, shard, blocks, digest]`` entry per shard of more than one
    block that is shuffled (shards of one block, and sequential ones, are
    ordered as they always were, so they add nothing): a resume over files
    whose row groups or line layout changed is refused instead of landing on
    other samples.
    """
    out: list[list[Any]] = []
    for d, dataset in enumerate(datasets):
        for shard in dataset.shards():
            if shard.access == "stream" or shard.num_samples == 0:
                continue
            starts = checked_blocks(dataset, shard.shard_id, shard.num_samples)
            if len(starts) > 1:
                digest = hashlib.sha256(starts.astype("<i8").tobytes()).hexdigest()[:16]
                out.append([d, shard.shard_id, len(starts), digest])
    return out


class WorkSchedule:
    """The global chunk sequence of a set of datasets (see the module doc).

    Args:
        datasets: The datasets; their index is their ``dataset_id``.
        chunk_size: Pointers per chunk.
        num_lanes: Lanes chunks are dealt to.
        seed: Seed of every shuffle.
        passes: Default trips over each dataset (``None``: forever); a
            dataset's own ``passes`` overrides it.
        shuffle: Shuffle shard order and sample order per pass.
        weights: Share of each dataset in the stream (``None``: proportional
            to their sizes). Normalised here.
        exhausted: ``"repeat"`` or ``"stop"`` (see the module doc).
        lane_changes: Where the lanes grew (``lane_plan.py``), as the epoch at
            hand runs them; empty for most pipelines.

    Raises:
        ValueError: A weight that is not a finite number >= 0, a positive
            weight on a dataset with no samples, or a ``"repeat"`` mixture
            longer than ``mixing.MAX_POSITIONS`` (see ``mixing.py``).
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        *,
        chunk_size: int,
        num_lanes: int,
        seed: int = 0,
        passes: int | None = 1,
        shuffle: bool = True,
        weights: Sequence[float] | None = None,
        exhausted: str = "repeat",
        lane_changes: Sequence[LaneChange] = (),
    ) -> None:
        if exhausted not in ("repeat", "stop"):
            raise ValueError(f"exhausted must be 'repeat' or 'stop', got {exhausted!r}")
        self.chunk_size = chunk_size
        self.num_lanes = num_lanes
        #: How chunks are dealt to lanes (``lane_plan.py``) and the lanes in all.
        self.lanes = LanePlan(num_lanes, lane_changes)
        self.lane_changes = tuple(lane_changes)
        self.total_lanes = self.lanes.total
        self.streams = [_DatasetStream(i, d, seed, shuffle) for i, d in enumerate(datasets)]
        self.limits: list[float] = []
        for dataset, stream in zip(datasets, self.streams):
            trips = dataset.passes if dataset.passes is not None else passes
            self.limits.append(float("inf") if trips is None else stream.pass_start(trips))
        sizes = [s.size for s in self.streams]
        changes: tuple[WeightChange, ...] = getattr(weights, "changes", ())
        for given in ([weights] if weights is not None else []) + [c.weights for c in changes]:
            check_weights(datasets, given)
            # A share needs samples: an empty dataset with a weight is an error, not 0.
            check_shares(datasets, given, sizes)
        # Without weights, an empty dataset's share is its size: 0.
        raw = list(weights) if weights is not None else [float(n) for n in sizes]
        self.weights = _normalised(raw)
        self.exhausted = exhausted
        self._active = [i for i, w in enumerate(self.weights) if w > 0]
        self._mixture = len(self._active) > 1
        #: The weight changes as given (``weight_plan.py``), and as the deficits use them:
        #: ``(at_chunk, positions before it, counts there, weights,
        #: active datasets)``, by chunk (see the module doc); empty for most pipelines.
        self.weight_changes = changes
        self.changes = [(c.at_chunk, sum(c.counts), c.counts, w,
                         [i for i, x in enumerate(w) if x > 0])
                        for c in changes for w in [_normalised(c.weights)]]
        current = self.changes[-1][3] if self.changes else self.weights
        #: About how many positions the stream holds (``inf``: endless; mixing.py).
        self.expected_positions = stream_length(current, self.limits, exhausted)
        #: What to warn before the first item (a ``"repeat"`` mixture far longer
        #: than its data), or None; a stream beyond ``MAX_POSITIONS`` is refused here.
        self.length_warning = length_warning(datasets, current, self.limits, exhausted)

    @classmethod
    def for_source(cls, source: Any) -> WorkSchedule:
        """The schedule of a pipeline's source config (every rank computes the same one)."""
        return cls(source.datasets, chunk_size=source.chunk_size, num_lanes=source.num_lanes,
                   seed=source.seed, passes=source.passes, shuffle=source.shuffle,
                   weights=source.weights, exhausted=source.exhausted,
                   lane_changes=getattr(source, "lane_changes", ()))

    @property
    def component_count(self) -> int:
        """Number of datasets."""
        return len(self.streams)

    def initial_state(self) -> ScheduleState:
        """The state before the first chunk."""
        return ScheduleState(0, (0,) * len(self.streams))

    def lane_of(self, global_chunk: int) -> tuple[int, int]:
        """``(lane_id, chunk_id)`` of a global chunk."""
        return self.lanes.lane_of(global_chunk)

    def advance(self, state: ScheduleState) -> tuple[np.ndarray | None, ScheduleState]:
        """The dataset of each pointer of the chunk at ``state``, and the next state.

        Returns ``(None, state)`` when the stream has ended.
        """
        if self.changes and state.global_chunk >= self.changes[0][0]:
            return self._advance_mixture(state, self.regime(state.global_chunk))
        if self._mixture:
            return self._advance_mixture(state)
        return self._advance_single(state)

    def jump(self, state: ScheduleState, global_chunk: int) -> ScheduleState | None:
        """The state at ``global_chunk`` (at or after ``state``'s), or None when the stream
        ends before it: computed at once for a single dataset's whole chunks, walked
        chunk by chunk otherwise (a mixture's round-robin has no shortcut)."""
        k = global_chunk - state.global_chunk
        if k > 0 and not self._mixture and not self.changes and self._active:
            d = self._active[0]
            total = state.counts[d] + k * self.chunk_size
            if total <= self.limits[d]:  # every chunk before it whole: no end in between
                counts = list(state.counts)
                counts[d] = total
                return ScheduleState(global_chunk, tuple(counts))
        at: ScheduleState | None = state
        while at is not None and at.global_chunk < global_chunk:
            components, at = self.advance(at)
            if components is None:
                return None
        return at

    def regime(self, global_chunk: int) -> tuple[int, tuple[int, ...], list[float], list[int]]:
        """``(positions, counts, weights, active)`` the deficits at ``global_chunk``
        count from: the last weight change at or before it, else the start."""
        for at, base, counts, weights, active in reversed(self.changes):
            if at <= global_chunk:
                return base, counts, weights, active
        return 0, (0,) * len(self.streams), self.weights, self._active

    def _advance_single(self, state: ScheduleState) -> tuple[np.ndarray | None, ScheduleState]:
        if not self._active:
            return None, state
        d = self._active[0]
        take = min(self.chunk_size, self.limits[d] - state.counts[d])
        if take <= 0:
            return None, state
        take = int(take)
        counts = list(state.counts)
        counts[d] += take
        components = np.full(take, d, dtype=np.int64)
        return components, ScheduleState(state.global_chunk + 1, tuple(counts))

    def _advance_mixture(self, state: ScheduleState,
                         regime: tuple[int, tuple[int, ...], list[float], list[int]] | None = None
                         ) -> tuple[np.ndarray | None, ScheduleState]:
        counts = list(state.counts)
        limits = self.limits
        stop = self.exhausted == "stop"
        if regime is None:
            weights, active = self.weights, self._active
        else:  # after a weight change: deficits (and "stop"'s limits) count from its point
            _, start, weights, active = regime
            counts = [n - s for n, s in zip(counts, start)]
            limits = [lim - s for lim, s in zip(limits, start)]
        position = sum(counts)
        picks: list[int] = []
        for _ in range(self.chunk_size):
            if all(counts[c] >= limits[c] for c in active):
                break
            best, best_deficit = -1, -1.0e300
            step = position + 1
            for c in active:
                deficit = step * weights[c] - counts[c]
                if deficit > best_deficit:
                    best, best_deficit = c, deficit
            if stop and counts[best] >= limits[best]:
                break
            picks.append(best)
            counts[best] += 1
            position += 1
        if not picks:
            return None, state
        if regime is not None:
            counts = [n + s for n, s in zip(counts, regime[1])]
        return np.array(picks, dtype=np.int64), ScheduleState(state.global_chunk + 1,
                                                             tuple(counts))

    def chunk(self, state: ScheduleState) -> tuple[Chunk | None, ScheduleState]:
        """Generate the chunk at ``state`` (with its pointers) and the next state."""
        components, nxt = self.advance(state)
        if components is None:
            return None, state
        if not (self._mixture or self.changes) or (components[0] == components[-1]
                                 and bool((components == components[0]).all())):
            d = int(components[0])  # one dataset (the usual chunk): no masks
            first = state.counts[d]
            shard_ids, local_ids = self.streams[d].locate(
                np.arange(first, first + len(components), dtype=np.int64))
        else:
            shard_ids = np.empty(len(components), dtype=np.int64)
            local_ids = np.empty(len(components), dtype=np.int64)
            for d in np.unique(components).tolist():
                sel = components == d
                first = state.counts[d]
                positions = np.arange(first, first + int(sel.sum()), dtype=np.int64)
                shard_ids[sel], local_ids[sel] = self.streams[d].locate(positions)
        lane_id, chunk_id = self.lane_of(state.global_chunk)
        return Chunk(state, lane_id, chunk_id, components, shard_ids, local_ids), nxt
