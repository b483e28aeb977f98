"""``shuffle``: shuffles whose randomness comes from the data itself.

An RNG advanced once per call would tie the order to micro-batch boundaries,
and those move on a restart (replay starts at a different point). Every
random choice here is instead a hash of an element's cursor key with the
seed, so the same elements in the same lane come out in the same order however
the stream was cut into ``push_many`` calls and on whichever restart they
arrive. Each element gets a 64-bit *salt*::

    salt(e) = seed_key(DOMAIN, seed, chunk_id, chunk_offset, len(lineage), *lineage, *sample_id)

(:func:`~zephon_torch.sources.permute.seed_key`, the splitmix64 fold; the
lineage length keeps keys of different depths apart). The hashing lives in
:mod:`zephon_torch.ops.shuffle_salt`; this module has the accumulators and the
operator that use it.

**One buffer, split over the lanes.** ``buffer_size`` is the pipeline's
buffer: every lane shuffles on its own (a lane's order must not depend on
which rank or worker runs it), and each lane gets the share
:func:`lane_buffer_size` gives, ``size = ceil(buffer_size / num_lanes)`` with
``num_lanes`` the source's (fixed for a run), so the lanes together hold about
``buffer_size`` rows, whatever the world size or the worker count. Below, the
"size" of a lane's reservoir or block is that share. (Until this rule, each
lane held ``buffer_size`` rows, ``num_lanes`` times what was asked, and the
first output waited for all of them; ``buffer_size * num_lanes`` gives that
order again, but a state saved then is refused: see :data:`BUFFER_SPLIT`.)

Three algorithms use the salts:

``"streaming"`` (default): a reservoir per lane. Until the lane holds
``size`` elements, arrivals are kept. After that each arrival evicts the
element at slot ``j = hash(salt(arrival), lane, n, size) mod size``,
where ``n`` counts the lane's evictions since its last flush, and takes its
place. A flush drains the reservoir sorted by salt. With ``size=2``
(slot numbers are whatever the hash gives; these are for illustration)::

    step  arrival  reservoir before  slot j  emitted  reservoir after
    1     a        []                -       -        [a]
    2     b        [a]               -       -        [a, b]
    3     c        [a, b]            1       b        [a, c]
    4     d        [a, c]            0       a        [d, c]
    flush          [d, c]                    c, d     []      (salt(c) < salt(d))

``"block"``: a plain :class:`~zephon_torch.ops.accumulators.CountingAccumulator`
cuts each lane into blocks of ``size``; the workers sort each block by
``(salt, cursor key)``, so a block's order is a pure function of its set of
elements.

``"block_warmup"``: like ``"block"``, but a lane's blocks start small and
double (``first, 2 * first, ... size`` with ``first = min(64, size // 16)``,
at least 1) so the first outputs arrive quickly; the schedule restarts after
every flush of the lane.

All state is per lane: a flush sentinel of one lane drains and resets that
lane alone, and other lanes never see its elements.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.block import Block
from zephon_torch.epochs import epoch_seed
from zephon_torch.ops.accumulators import Accumulator, CountingAccumulator, lane_of
from zephon_torch.ops.base import Element, OpContext, Operator, OpTraits
from zephon_torch.ops.epoch_switch import switching_accumulator
from zephon_torch.ops.shuffle_buffer import (
    BUFFER_SPLIT,
    lane_buffer_size,
    refuse_unsplit,
    unsplit_config,
)
from zephon_torch.ops.shuffle_salt import (
    block_salts,
    cursor_key_of,
    eviction_slots,
    fold,
    order_block,
    order_by_salt,
    salt_of,
    shuffle_prefix,
)

# The salts live in shuffle_salt.py; the public ones stay importable from here.
__all__ = [
    "BUFFER_SPLIT",
    "SHUFFLE_ALGORITHMS",
    "ReservoirShuffleAccumulator",
    "Shuffle",
    "WarmupBlockAccumulator",
    "lane_buffer_size",
    "order_by_salt",
    "salt_of",
    "shuffle_prefix",
]

#: The accepted values of ``Shuffle(algorithm=...)``.
SHUFFLE_ALGORITHMS = ("streaming", "block", "block_warmup")


# Smallest first block of "block_warmup": small enough for a quick first
# output, large enough that it is still a real shuffle.
_WARMUP_START = 64


class _Reservoir:
    """One lane's reservoir: elements, their salts, and the eviction count."""

    __slots__ = ("evictions", "items", "salts")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.salts: list[int] = []
        self.evictions = 0


class _BlockReservoir:
    """One lane's reservoir of rows: where each slot's row lives, and the salts.

    Rows stay in the blocks they arrived in (``pool``); slot ``j`` holds row
    ``rows[j]`` of block ``owners[j]``. ``counts[b]`` is how many slots still
    hold a row of ``pool[b]``: once none does, the block is let go at once
    (its place in the pool is kept, as ``None``, so owners keep their
    numbers). ``live_rows`` is the rows of the blocks not let go. A block
    with one lingering row still holds all of its rows, so once those blocks
    hold more than twice the reservoir's size in rows, or the pool has many
    entries, the held rows are compacted into one block of their own and
    the blocks they came from are released: what the reservoir keeps alive
    stays within about twice its size, whatever the size of the blocks that
    arrive (blocks of a few dozen packed rows into a lane's share of 128
    rows would otherwise keep a dozen times the share alive).
    """

    __slots__ = ("counts", "evictions", "live_rows", "owners", "pool", "rows", "salts")

    def __init__(self) -> None:
        self.pool: list[Block | None] = []
        self.counts: list[int] = []
        self.live_rows = 0
        self.owners: list[int] = []
        self.rows: list[int] = []
        self.salts: list[int] = []
        self.evictions = 0

    def add(self, block: Block) -> int:
        """Put ``block`` in the pool (every row of it is about to take a slot); its owner
        number."""
        self.pool.append(block)
        self.counts.append(len(block))
        self.live_rows += len(block)
        return len(self.pool) - 1

    def release(self, owners: Sequence[int]) -> None:
        """One slot's row of each of ``owners`` left the reservoir; let go of the blocks
        no slot refers to any more."""
        counts = self.counts
        for owner in owners:
            counts[owner] -= 1
            if not counts[owner]:
                block = self.pool[owner]
                self.live_rows -= len(block)  # type: ignore[arg-type]
                self.pool[owner] = None

    def gather(self, owners: Sequence[int], rows: Sequence[int]) -> Block:
        """The rows ``(owners[i], rows[i])`` as one block, in that order."""
        return Block.gather(self.pool, owners, rows)  # type: ignore[arg-type]

    def drain(self) -> list[Block]:
        """Every held row sorted by salt (ties by cursor key), emptying the reservoir:
        blocks of at most :data:`_DRAIN_ROWS` rows, in order.

        The order is decided over ``(owners, rows, salts)`` before any row is
        copied, so the rows are gathered once, straight into their final
        order: gathering them in slot order and then taking the order would
        hold a second copy of every row at the flush, on top of the pool.
        They are gathered in pieces because what comes downstream keeps views
        of a block: a batch of 8 rows cut from one block of a whole drain (a
        flush window's rows, often hundreds) would keep all of them alive until
        that batch is dropped, which is after the next window is read.
        """
        salts = np.array(self.salts, dtype=np.uint64)
        order = np.argsort(salts, kind="stable")
        ranked = salts[order]
        if len(ranked) > 1 and bool((ranked[1:] == ranked[:-1]).any()):
            keyed = sorted((salt, self.pool[owner].cursor_key(row), i)  # type: ignore[union-attr]
                           for i, (salt, owner, row)
                           in enumerate(zip(self.salts, self.owners, self.rows)))
            order = np.array([i for _, _, i in keyed], dtype=np.int64)
        owners = np.asarray(self.owners, dtype=np.int64)[order]
        rows = np.asarray(self.rows, dtype=np.int64)[order]
        pool = self.pool
        self.pool, self.counts, self.live_rows = [], [], 0
        self.owners, self.rows, self.salts = [], [], []
        return [Block.gather(pool, owners[i:i + _DRAIN_ROWS],  # type: ignore[arg-type]
                             rows[i:i + _DRAIN_ROWS])
                for i in range(0, len(owners), _DRAIN_ROWS)]

    def needs_compacting(self, size: int) -> bool:
        """Whether the pool holds enough rows no slot needs to be worth a compaction."""
        return len(self.pool) > _POOL_LIMIT or self.live_rows > _LIVE_FACTOR * size

    def compact(self) -> None:
        """Rewrite the held rows as one block, releasing the blocks they came from."""
        if not self.owners:
            self.pool, self.counts, self.live_rows = [], [], 0
            return
        held = self.gather(self.owners, self.rows)
        self.pool = [held]
        self.counts = [len(held)]
        self.live_rows = len(held)
        self.owners = [0] * len(held)
        self.rows = list(range(len(held)))


# Blocks a reservoir may refer to before it is compacted.
_POOL_LIMIT = 32
# Rows (of the blocks it still refers to) a reservoir may keep alive, in multiples of
# its size, before it is compacted.
_LIVE_FACTOR = 2
# Rows per block of a drain (see _BlockReservoir.drain): a multiple of the usual
# batch sizes, so that batches cut downstream rarely straddle two blocks.
_DRAIN_ROWS = 64


class ReservoirShuffleAccumulator(Accumulator):
    """The accumulator of ``shuffle(algorithm="streaming")``: a reservoir per lane.

    Args:
        buffer_size: Elements each lane holds before arrivals start evicting:
            the lane's share of the shuffle's buffer (``Shuffle`` passes
            :func:`lane_buffer_size`).
        seed: The shuffle seed.

    ``push_many`` returns, per lane that evicted anything during the call,
    one micro-batch of that lane's evicted elements in eviction order. A
    flush (any form) drains the flushed lanes sorted by salt and forgets
    their state, so a flushed lane is exactly a fresh one.
    """

    takes_blocks = True

    def __init__(self, buffer_size: int, *, seed: int = 0) -> None:
        _check_buffer_size(buffer_size)
        self.buffer_size = buffer_size
        self.seed = seed
        self._prefix = shuffle_prefix(seed)
        self._lanes: dict[int, _Reservoir] = {}
        self._blocks: dict[int, _BlockReservoir] = {}

    def push_block(self, block: Block) -> list[Block]:
        """:meth:`push_many` for a block: the same evictions, decided over arrays."""
        n = len(block)
        if not n:
            return []
        lane = block.lane
        res = self._blocks.get(lane)
        if res is None:
            res = self._blocks[lane] = _BlockReservoir()
        size = self.buffer_size
        salts = block_salts(self._prefix, block)
        owner = res.add(block)
        fill = max(0, min(n, size - len(res.owners)))
        if fill:
            res.owners.extend([owner] * fill)
            res.rows.extend(range(fill))
            res.salts.extend(salts[:fill].tolist())
        out: list[Block] = []
        if fill < n:
            slots = eviction_slots(salts[fill:], lane, res.evictions, size).tolist()
            late = salts[fill:].tolist()
            owners, rows, held_salts = res.owners, res.rows, res.salts
            out_owners: list[int] = []
            out_rows: list[int] = []
            for i, slot in enumerate(slots):
                out_owners.append(owners[slot])
                out_rows.append(rows[slot])
                owners[slot] = owner
                rows[slot] = fill + i
                held_salts[slot] = late[i]
            res.evictions += len(slots)
            out.append(res.gather(out_owners, out_rows))
            res.release(out_owners)
        if res.needs_compacting(size):
            res.compact()
        return out

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        out: dict[int, list[Any]] = {}
        size = self.buffer_size
        prefix = self._prefix
        lanes = self._lanes
        for elem in elems:
            lane = lane_of(elem)
            res = lanes.get(lane)
            if res is None:
                res = lanes[lane] = _Reservoir()
            salt = salt_of(prefix, elem)
            if len(res.items) < size:
                res.items.append(elem)
                res.salts.append(salt)
                continue
            # Multiply-shift maps the 64-bit hash onto [0, size) without the
            # bias of a modulo.
            slot = (fold(salt, (lane, res.evictions, size)) * size) >> 64
            out.setdefault(lane, []).append(res.items[slot])
            res.items[slot] = elem
            res.salts[slot] = salt
            res.evictions += 1
        return list(out.values())

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        lanes = sorted({*self._lanes, *self._blocks}) if lane_id is None else [lane_id]
        out: list[Any] = []
        for lane in lanes:
            held = self._blocks.pop(lane, None)
            if held is not None and held.owners:
                out.extend(held.drain())
            res = self._lanes.pop(lane, None)
            if res is None or not res.items:
                continue
            keyed = sorted(
                (salt, cursor_key_of(item), i)
                for i, (salt, item) in enumerate(zip(res.salts, res.items))
            )
            out.append([res.items[i] for _, _, i in keyed])
        return out

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        if lane_id is None:
            return (any(res.items for res in self._lanes.values())
                    or any(res.owners for res in self._blocks.values()))
        res = self._lanes.get(lane_id)
        held = self._blocks.get(lane_id)
        return (res is not None and bool(res.items)) or (held is not None and bool(held.owners))


class WarmupBlockAccumulator(Accumulator):
    """The accumulator of ``shuffle(algorithm="block_warmup")``: growing blocks per lane.

    A lane's ``k``-th block (counted from its last flush) holds
    ``min(buffer_size, first_block * 2**k)`` elements; the workers shuffle
    each block (see :func:`order_by_salt`).

    Args:
        buffer_size: Size of a lane's full blocks: the lane's share of the
            shuffle's buffer (``Shuffle`` passes :func:`lane_buffer_size`).
        first_block: Size of a lane's first block; by default
            ``min(64, buffer_size // 16)``, at least 1.
    """

    def __init__(self, buffer_size: int, *, first_block: int | None = None) -> None:
        _check_buffer_size(buffer_size)
        if first_block is None:
            first_block = max(1, min(_WARMUP_START, buffer_size // 16))
        if not isinstance(first_block, int) or isinstance(first_block, bool) or first_block < 1:
            raise ValueError(f"first_block must be a positive integer, got {first_block!r}")
        self.buffer_size = buffer_size
        self.first_block = min(first_block, buffer_size)
        self._buffers: dict[int, list[Any]] = {}
        self._blocks: dict[int, int] = {}
        self._held: dict[int, list[Block]] = {}

    takes_blocks = True

    def push_block(self, block: Block) -> list[Block]:
        """:meth:`push_many` for a block: cut at the same (growing) block sizes."""
        lane = block.lane
        held = self._held.setdefault(lane, [])
        ready: list[Block] = []
        rest = block
        while len(rest):
            index = self._blocks.get(lane, 0)
            need = self.block_size(index) - sum(len(b) for b in held)
            if len(rest) < need:
                held.append(rest)
                break
            head, rest = rest.split_at(need)
            ready.append(Block.concat([*held, head]))
            held = self._held[lane] = []
            self._blocks[lane] = index + 1
        return ready

    def block_size(self, index: int) -> int:
        """Size of a lane's ``index``-th block since its last flush."""
        if index >= self.buffer_size.bit_length():
            return self.buffer_size  # doubling has long since reached the cap
        return min(self.buffer_size, self.first_block << index)

    def push_many(self, elems: Sequence[Any]) -> list[list[Any]]:
        ready = []
        for elem in elems:
            lane = lane_of(elem)
            buf = self._buffers.get(lane)
            if buf is None:
                buf = self._buffers[lane] = []
            buf.append(elem)
            index = self._blocks.get(lane, 0)
            if len(buf) >= self.block_size(index):
                ready.append(buf)
                self._buffers[lane] = []
                self._blocks[lane] = index + 1
        return ready

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        lanes = (sorted(set(self._buffers) | set(self._blocks) | set(self._held))
                 if lane_id is None else [lane_id])
        out: list[Any] = []
        for lane in lanes:
            buf = self._buffers.pop(lane, None)
            held = self._held.pop(lane, None)
            self._blocks.pop(lane, None)
            if buf:
                out.append(buf)
            if held:
                out.append(Block.concat(held))
        return out

    def has_pending_data(self, lane_id: int | None = None) -> bool:
        if lane_id is None:
            return any(self._buffers.values()) or any(self._held.values())
        return bool(self._buffers.get(lane_id)) or bool(self._held.get(lane_id))


class Shuffle(Operator):
    """Shuffle each lane with randomness derived from cursor keys and the seed.

    Args:
        buffer_size: The pipeline's shuffle buffer, in rows (elements), over
            all lanes: each lane's reservoir (``"streaming"``) or block
            (``"block"``, ``"block_warmup"``) holds ``ceil(buffer_size /
            num_lanes)`` of them (:func:`lane_buffer_size`; ``num_lanes`` is
            the source's). Larger mixes further and holds more in memory:
            about ``buffer_size`` rows in all, each rank holding its lanes'
            shares. It defines the output, so it is a parameter and not a
            micro-batch knob. (Changed meaning: it was the size of *each*
            lane's buffer; ``buffer_size * num_lanes`` gives that order
            again, and states saved before are refused.)
        seed: Shuffle seed; different seeds give different orders. It is the
            operator's own: the pipeline seed does not enter the shuffle.
        algorithm: ``"streaming"``, ``"block"`` or ``"block_warmup"`` (see the
            module docstring).

    Raises:
        ValueError: ``buffer_size`` is not a positive integer, ``seed`` is not
            an integer, or ``algorithm`` is unknown; ``buffer_size <=
            num_lanes`` (one row per lane does not shuffle), when the run
            starts (``Pipeline.shuffle`` checks it at once).
    """

    name = "shuffle"
    #: A resume may change the buffer size: each lane's replayed epochs are shuffled
    #: with the saved size, and the new one applies from the lane's next epoch on.
    resume_may_change_at_epoch = frozenset({"buffer_size"})

    def __init__(self, buffer_size: int = 8192, *, seed: int = 0,
                 algorithm: str = "streaming") -> None:
        _check_buffer_size(buffer_size)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"shuffle seed must be an integer, got {seed!r}")
        if algorithm not in SHUFFLE_ALGORITHMS:
            raise ValueError(
                f"unknown shuffle algorithm {algorithm!r}; choose one of "
                + ", ".join(repr(a) for a in SHUFFLE_ALGORITHMS)
            )
        self.buffer_size = buffer_size
        self.seed = seed
        self.algorithm = algorithm
        # The seed this copy shuffles with: ``seed`` in epoch 0, else derived (for_epoch).
        self._run_seed = seed
        self._prefix = shuffle_prefix(seed)

    def for_epoch(self, epoch: int) -> Shuffle:
        """A copy that shuffles with :func:`~zephon_torch.epochs.epoch_seed` of the seed.

        Its config (and so the fingerprint) is the same: the epoch travels in
        states on its own. Epoch 0 returns the operator itself.
        """
        run_seed = epoch_seed(self.seed, epoch)
        if run_seed == self._run_seed:
            return self
        copy = _copy.copy(self)
        copy._run_seed = run_seed
        copy._prefix = shuffle_prefix(run_seed)
        return copy

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> Accumulator:
        """Return the algorithm's accumulator, sized by :meth:`lane_buffer_size`.

        ``ctx.microbatch_size`` is ignored: the buffer size defines the output.
        No accumulator here has a latency bound, whatever ``deterministic``.
        On a resume under another ``buffer_size`` (``ctx.earlier_params``), each
        lane's epochs before its switch are shuffled with the saved size (see
        :mod:`zephon_torch.ops.epoch_switch`).

        Raises:
            ValueError: ``buffer_size <= ctx.num_lanes`` (see :func:`lane_buffer_size`).
        """
        if ctx.earlier_params:  # resumed under another buffer_size (resume_may_change_at_epoch)
            return switching_accumulator(self, deterministic=deterministic, ctx=ctx)
        size = self.lane_buffer_size(ctx.num_lanes)
        if self.algorithm == "streaming":
            return ReservoirShuffleAccumulator(size, seed=self._run_seed)
        if self.algorithm == "block":
            return CountingAccumulator(size)
        return WarmupBlockAccumulator(size)

    def with_params(self, params: Mapping[str, Any]) -> Shuffle:
        """This shuffle (of this epoch) with another ``buffer_size``: the saved one, for
        the epochs a resume replays.

        Raises:
            ValueError: Another parameter than ``buffer_size``, or a size that is
                not a positive integer.
        """
        other = set(params) - {"buffer_size"}
        if other:
            raise ValueError(f"shuffle may run with another buffer_size on resume, not with "
                             f"other {sorted(other)}")
        _check_buffer_size(params["buffer_size"])
        copy = _copy.copy(self)
        copy.buffer_size = params["buffer_size"]
        return copy

    def lane_buffer_size(self, num_lanes: int) -> int:
        """Rows each lane holds over a source of ``num_lanes`` lanes (:func:`lane_buffer_size`)."""
        return lane_buffer_size(self.buffer_size, num_lanes)

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        """Shuffle one block (block algorithms); pass through for ``"streaming"``."""
        if self.algorithm == "streaming":
            return list(elems)
        return order_by_salt(elems, self._prefix)

    def process_block(self, block: Block) -> Block:
        """:meth:`process_many` for rows held as a block."""
        if self.algorithm == "streaming":
            return block
        return block.take(order_block(block, self._prefix))

    def traits(self) -> OpTraits:
        """Shuffling reorders, so plans with it use flush sentinels.

        The streaming reservoir does all its work in the accumulator, so its
        passthrough ``process_many`` runs on the driver thread; the block
        algorithms sort on the workers.
        """
        return OpTraits(preserves_cursor_order=False, inline=self.algorithm == "streaming")

    def config(self) -> dict[str, Any]:
        """The parameters that define the output, and the rule that splits the buffer.

        ``buffer_split`` (:data:`BUFFER_SPLIT`) is no parameter: it records
        what ``buffer_size`` means, so that a state saved while it meant
        something else fails the fingerprint check.
        """
        return {**super().config(), "buffer_size": self.buffer_size, "seed": self.seed,
                "algorithm": self.algorithm, "buffer_split": BUFFER_SPLIT}

    @classmethod
    def earlier_config(cls, config: Mapping[str, Any], saved: Mapping[str, str], *,
                       num_lanes: int) -> dict[str, Any] | None:
        """A state saved unsplit resumes where this shuffle gives its order (see
        :func:`~zephon_torch.ops.shuffle_buffer.unsplit_config`)."""
        return unsplit_config(config, saved, num_lanes)

    @classmethod
    def refuse_earlier_state(cls, differ: Sequence[str], mine: Mapping[str, Any],
                             theirs: Mapping[str, Any], *, num_lanes: int) -> str | None:
        """Why a state saved unsplit cannot resume (see
        :func:`~zephon_torch.ops.shuffle_buffer.refuse_unsplit`)."""
        return refuse_unsplit(differ, mine, theirs, num_lanes)

    def __repr__(self) -> str:
        # The constructor's arguments only: buffer_split is no argument.
        return (f"Shuffle(buffer_size={self.buffer_size!r}, seed={self.seed!r}, "
                f"algorithm={self.algorithm!r})")


def _check_buffer_size(buffer_size: Any) -> None:
    if not isinstance(buffer_size, int) or isinstance(buffer_size, bool) or buffer_size < 1:
        raise ValueError(f"shuffle buffer_size must be a positive integer, got {buffer_size!r}")
