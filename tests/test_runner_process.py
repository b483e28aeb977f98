"""Tests for the process runner: ``runners/process.py`` and its transport ``runners/shm.py``.

Everything here starts real worker processes (spawned, so each costs an
interpreter start): pipelines and pools are kept few and small.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from zephon_torch.block import Block
from zephon_torch.block_columns import Ragged
from zephon_torch.ops.base import OpContext, Operator, OpTraits
from zephon_torch.pipeline import Pipeline
from zephon_torch.runners import shm
from zephon_torch.runners.process import ProcessPool, WorkerTraceback
from zephon_torch.sources.base import Dataset, Shard
from zephon_torch.types import SampleBatch, SampleMeta, SampleRecord

# --------------------------------------------------------------------------- helpers
# Module level, so that worker processes import them by reference.


class Items(Dataset):
    """An in-memory dataset with one inline shard."""

    kind = "items"
    raw_format = "dict"

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)
        self.name = "items"

    def shards(self) -> list[Shard]:
        return [Shard(shard_id=0, num_samples=len(self.items), name="items", access="inline")]

    def read(self, shard_id: int, local_ids: Sequence[int]) -> list[Any]:
        return [self.items[i] for i in local_ids]


class ToArray(Operator):
    """Text to an int32 array of its byte values, repeated ``repeat`` times."""

    name = "to_array"

    def __init__(self, repeat: int = 1) -> None:
        self.repeat = repeat

    def process_many(self, elems):
        out = []
        for elem in elems:
            data = np.frombuffer(elem.payload["text"].encode() * self.repeat, dtype=np.uint8)
            out.append(SampleRecord(elem.meta, data.astype(np.int32)))
        return out


class ToIds(Operator):
    """Text to ``{"input_ids": its bytes as int32}``, like a tokenizer; with ``mask``,
    a third of the documents also get an int32 ``loss_mask`` and a third a float32 one."""

    name = "to_ids"

    def __init__(self, mask: bool = False) -> None:
        self.mask = mask

    def process_many(self, elems):
        out = []
        for elem in elems:
            ids = np.frombuffer(elem.payload["text"].encode(), dtype=np.uint8).astype(np.int32)
            payload = {"input_ids": ids}
            if self.mask and elem.meta.sample_id[2] % 3 < 2:
                dtype = np.int32 if elem.meta.sample_id[2] % 3 else np.float32
                payload["loss_mask"] = (ids % 2).astype(dtype)
            out.append(SampleRecord(elem.meta, payload))
        return out


class MapWith(Operator):
    """Applies ``fn`` (a lambda, given to the constructor) to every payload."""

    name = "map_with"

    def __init__(self, fn) -> None:
        self.fn = fn

    def process_many(self, elems):
        out = []
        for elem in elems:
            if isinstance(elem, SampleBatch):
                out.append(SampleBatch([SampleRecord(r.meta, self.fn(r.payload)) for r in elem]))
            else:
                out.append(SampleRecord(elem.meta, self.fn(elem.payload)))
        return out


class Identity(Operator):
    name = "identity"

    def process_many(self, elems):
        return list(elems)


class Raising(Operator):
    """Raises ``ValueError`` on the record whose local id is ``bad`` (or a picky one)."""

    name = "raising"

    def __init__(self, bad: int, picky: bool = False) -> None:
        self.bad = bad
        self.picky = picky

    def process_many(self, elems):
        for elem in elems:
            if elem.meta.sample_id[2] == self.bad:
                if self.picky:
                    raise PickyError("left", "right")
                raise ValueError(f"bad item {self.bad}")
        return list(elems)


class PickyError(Exception):
    """An exception that cannot be unpickled (its __init__ takes two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a} and {b}")


class KillOnce(Operator):
    """SIGKILLs its own worker when it meets item ``marker`` (once, or ``always``)."""

    name = "kill_once"

    def __init__(self, marker: int, flag: str, always: bool = False) -> None:
        self.marker = marker
        self.flag = flag
        self.always = always

    def process_many(self, elems):
        if any(e.meta.sample_id[2] == self.marker for e in elems):
            if self.always or not os.path.exists(self.flag):
                with open(self.flag, "w") as f:
                    f.write("killed")
                os.kill(os.getpid(), signal.SIGKILL)
        return list(elems)


class WhereAmI(Operator):
    """Reports the process it ran in, whether torch is loaded, and its setup calls."""

    name = "where_am_i"

    def __init__(self) -> None:
        self.setups = 0

    def setup(self, ctx: OpContext) -> None:
        self.setups += 1

    def process_many(self, elems):
        info = {"pid": os.getpid(), "torch": "torch" in sys.modules, "setups": self.setups}
        return [SampleRecord(e.meta, info) for e in elems]


class InlineProbe(Operator):
    """An inline-trait operator: its setup must never run in a worker."""

    name = "inline_probe"

    def setup(self, ctx: OpContext) -> None:
        if multiprocessing.current_process().name.startswith("zephon-worker"):
            raise AssertionError("setup of an inline operator ran in a worker")

    def traits(self) -> OpTraits:
        return OpTraits(inline=True)


class FailingSetup(Operator):
    name = "failing_setup"

    def setup(self, ctx: OpContext) -> None:
        raise OSError("model file missing")


class Nap(Operator):
    name = "nap"

    def __init__(self, seconds: float = 0.3) -> None:
        self.seconds = seconds

    def process_many(self, elems):
        time.sleep(self.seconds)
        return list(elems)


class Sleepy(Operator):
    name = "sleepy"

    def process_many(self, elems):
        time.sleep(30)
        return list(elems)


class BlockIdentity(Operator):
    """Returns what it gets: a block stays a block (it has a block path)."""

    name = "block_identity"

    def process_block(self, block: Block) -> Block:
        return block


class MutateThenDie(Operator):
    """Adds 1 in place to every payload array, then SIGKILLs its worker (once, by ``flag``)."""

    name = "mutate_then_die"

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def process_many(self, elems):
        for elem in elems:
            np.add(elem.payload, 1, out=elem.payload)  # into its mapping of the input segment
        if not os.path.exists(self.flag):
            with open(self.flag, "w") as f:
                f.write("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return list(elems)


class InputOwner(Operator):
    """Reports what owns the memory of each input payload array, as seen in the worker."""

    name = "input_owner"

    def process_many(self, elems):
        return [SampleRecord(e.meta, type(_owner(e.payload)).__name__) for e in elems]


class Gate(Operator):
    """Holds the micro-batches of chunks ``from_chunk`` and later until ``path`` exists."""

    name = "gate"

    def __init__(self, path: str, from_chunk: int) -> None:
        self.path = path
        self.from_chunk = from_chunk

    def process_many(self, elems):
        if any(e.meta.chunk_id >= self.from_chunk for e in elems):
            deadline = time.monotonic() + 50
            while not os.path.exists(self.path) and time.monotonic() < deadline:
                time.sleep(0.05)
        return list(elems)


def _owner(array: np.ndarray) -> Any:
    """The object that finally owns an array's memory (through views and memoryviews)."""
    obj: Any = array
    while True:
        if isinstance(obj, np.ndarray) and obj.base is not None:
            obj = obj.base
        elif isinstance(obj, memoryview):
            obj = obj.obj
        else:
            return obj


def _arrays(value: Any) -> list[np.ndarray]:
    """Every numpy array inside a payload (dicts, lists, tuples)."""
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


def _assert_plain(value: Any) -> None:
    """A payload holds only builtins and numpy arrays, none of them a view of a mapping."""
    if isinstance(value, dict):
        for k, v in value.items():
            assert type(k) is str
            _assert_plain(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _assert_plain(v)
    elif isinstance(value, np.ndarray):
        assert not isinstance(_owner(value), mmap.mmap)  # its own memory, not a segment's
    else:
        assert value is None or isinstance(value, (str, bytes, int, float, np.generic)), (
            f"foreign object in a payload: {value!r}")


def _items(n: int) -> list[dict[str, str]]:
    return [{"text": f"item {i} " * (1 + (i * 7) % 5)} for i in range(n)]


def _pipeline(n: int = 60) -> Pipeline:
    return Pipeline.from_sources([Items(_items(n))], num_lanes=2, chunk_size=8, seed=3)


def _run(pipe: Pipeline, **kwargs: Any) -> list[Any]:
    # Closed explicitly: an exhausted PipelineIterator keeps its pool until collected.
    with pipe.iter(**kwargs) as it:
        return list(it)


def _ours() -> list[str]:
    """Segments of pools created by this test process."""
    mine = f"{shm.SEGMENT_PREFIX}{os.getpid()}-"
    return [name for name in os.listdir(shm.segment_dir()) if name.startswith(mine)]


def _meta(i: int) -> SampleMeta:
    return SampleMeta(sample_id=(0, 0, i), lane_id=i % 2, chunk_id=0, chunk_offset=i)


def _assert_same(got: list[Any], want: list[Any]) -> None:
    """Equal output: types, metas, payloads (arrays by dtype, shape and value), nothing foreign."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert type(a) is type(b)
        assert a == b  # metas equal, payload arrays equal by dtype, shape and value
        records = zip(a.records, b.records) if isinstance(a, SampleBatch) else [(a, b)]
        for x, y in records:
            _assert_plain(x.payload)
            assert [(v.dtype, v.shape) for v in _arrays(x.payload)] == [
                (v.dtype, v.shape) for v in _arrays(y.payload)]


_SHARED: list[ProcessPool] = []  # the module's pool: its workers outlive single tests


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    gc.collect()  # pools caught in reference cycles are closed by their finalizers
    shared = {pid for p in _SHARED for pid in p.worker_pids()}
    assert [c for c in multiprocessing.active_children() if c.pid not in shared] == []
    assert _ours() == []
    if not _SHARED:  # supervisor and feeder threads are joined too
        assert [t.name for t in threading.enumerate() if t.name.startswith("zephon-")] == []


# Stages of the module's pool.
(IDENTITY, RAISING, PICKY, WHERE_AM_I, INLINE_PROBE, NAP, BLOCK_IDENTITY, LONG_NAP, MUTATE,
 INPUT_OWNER) = range(10)


@pytest.fixture(scope="module")
def mutate_flag(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The file ``MutateThenDie`` writes before it kills its worker (the first time only)."""
    return tmp_path_factory.mktemp("flags") / "mutated"


@pytest.fixture(scope="module")
def pool(mutate_flag):
    """One pool for the unit tests (its stages: the constants above)."""
    ops = [Identity(), Raising(bad=3), Raising(bad=3, picky=True), WhereAmI(), InlineProbe(),
           Nap(), BlockIdentity(), Nap(2.0), MutateThenDie(str(mutate_flag)), InputOwner()]
    names = {PICKY: "picky", LONG_NAP: "long_nap"}
    ctxs = [OpContext(stage_index=i, stage_name=names.get(i, op.name))
            for i, op in enumerate(ops)]
    with ProcessPool(ops, ctxs, 2, inline_limit=256) as p:
        _SHARED.append(p)
        yield p
        _SHARED.remove(p)
    assert p.worker_pids() == []
    assert multiprocessing.active_children() == []


# --------------------------------------------------------------------------- pipelines


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("workers", "sizes", "batched"), [
    (1, {"to_array": 1, "map_with": 3}, False),
    (2, {"to_array": 5, "map_with": 2}, False),
    (2, {"to_array": 3}, True),
])
def test_process_output_equals_inline_exactly(workers, sizes, batched):
    pipe = _pipeline().apply(ToArray(repeat=20))
    if batched:  # batches built on the driver, then processed in workers
        pipe = pipe.batch(4, drop_last=False)
    pipe = pipe.apply(MapWith(lambda a: (a * 3 + 1).astype(np.int64)))
    want = _run(pipe, runner="inline", microbatch_sizes=sizes)
    got = _run(pipe, runner="process", num_workers=workers, microbatch_sizes=sizes)
    _assert_same(got, want)
    assert isinstance(got[0], SampleBatch) == batched


def _block_pipeline(kind: str, corpus_dir: Any, tokenizer: Any) -> tuple[Pipeline, dict]:
    """Built-in stages only (they run on blocks), with their micro-batch sizes."""
    if kind == "items":
        texts = [f"item {i} " * (i % 6) for i in range(70)]  # i % 6 == 0: empty, a tombstone
        pipe = (Pipeline.from_items(texts, num_lanes=2, chunk_size=16)
                .tokenize(tokenizer)
                .map_transform(lambda p: {**p, "n": len(p["input_ids"])})
                .filter(lambda p: p["n"] % 4 != 1)
                .batch(4, drop_last=False))
        return pipe, {"tokenize": 5}
    if kind == "jsonl":  # with empty documents and a gzipped (streamed) file
        pipe = (Pipeline.from_jsonl(str(corpus_dir / "web" / "*.jsonl*"), num_lanes=2,
                                    chunk_size=16)
                .fetch().decode_text().tokenize(tokenizer, special_tokens="bos_eos")
                .pack_flat(64, num_bins=2).batch(2))
        return pipe, {}
    tokens = str(corpus_dir / "tokens" / "*.parquet")
    if kind == "parquet":  # a ragged token column sliced from Arrow's offsets
        pipe = (Pipeline.from_parquet(tokens, num_lanes=2, chunk_size=16)
                .fetch().filter(lambda p: len(p["input_ids"]) > 20))
        return pipe, {}
    pipe = (Pipeline.from_parquet(tokens, num_lanes=2, chunk_size=16)
            .fetch().pack_flat(48, num_bins=3, algorithm="best_fit").batch(2))
    return pipe, {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["items", "jsonl", "parquet", "parquet_packed"])
def test_block_stages_in_workers_give_inline_output_exactly(kind, corpus_dir, tokenizer):
    pipe, sizes = _block_pipeline(kind, corpus_dir, tokenizer)
    want = _run(pipe, runner="inline", microbatch_sizes=sizes)
    with pipe.iter(runner="process", num_workers=2, microbatch_sizes=sizes) as it:
        remote = [s for s in it.stages if not s.local]
        got = list(it)
    # The built-in stages really ran in the workers, on blocks.
    assert remote and all(s.blocks for s in remote)
    assert all(s.counters["microbatches"] > 0 for s in remote)
    assert len(want) > 5
    _assert_same(got, want)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("algorithm", ["first_fit", "best_fit", "wrap"])
def test_packed_rows_under_the_process_runner_equal_inline(algorithm):
    """Token arrays from a user operator (lists), int32 and float32 loss masks among them,
    are packed on the driver and the assembled rows travel to a worker and back: rows,
    metas (contributors, packing metadata) and dtypes are inline's."""
    pipe = (_pipeline(80).apply(ToIds(mask=True))
            .pack_flat(24, num_bins=2, algorithm=algorithm).batch(3))
    sizes = {"to_ids": 5}
    got = _run(pipe, runner="process", num_workers=2, microbatch_sizes=sizes)
    _assert_same(got, _run(pipe, runner="inline", microbatch_sizes=sizes))
    seq = _pipeline(40).apply(ToIds(mask=True)).pack_sequences(24, num_bins=2,
                                                               algorithm=algorithm)
    _assert_same(_run(seq, runner="process", num_workers=2), _run(seq, runner="inline"))


@pytest.mark.timeout(60)
def test_worker_killed_mid_run_is_replaced_and_output_is_identical(tmp_path):
    flag = tmp_path / "killed"
    # repeat=200: a micro-batch of kill_once holds tens of KB, so it travels in a
    # segment, which the retry after the death must still find.
    base = _pipeline().apply(ToArray(repeat=200))
    want = _run(base, runner="inline")
    pipe = base.apply(KillOnce(marker=7, flag=str(flag)))
    got = _run(pipe, runner="process", num_workers=2,
               microbatch_sizes={"to_array": 4, "kill_once": 3})
    assert flag.exists()  # a worker really died
    _assert_same(got, want)


@pytest.mark.timeout(60)
def test_operator_killing_its_worker_every_time_fails_clearly(tmp_path):
    pipe = _pipeline(30).apply(KillOnce(marker=5, flag=str(tmp_path / "k"), always=True))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"died while running stage 'kill_once'") as info:
        _run(pipe, runner="process", num_workers=2, microbatch_sizes={"kill_once": 2})
    assert "SIGKILL" in str(info.value)
    assert time.monotonic() - start < 45


@pytest.mark.timeout(60)
def test_operator_exception_keeps_type_message_and_worker_traceback():
    pipe = _pipeline(30).apply(ToArray()).apply(Raising(bad=11))
    with pytest.raises(ValueError, match=r"^bad item 11$") as info:
        _run(pipe, runner="process", num_workers=2)
    cause = info.value.__cause__
    assert isinstance(cause, WorkerTraceback)
    assert "stage 'raising'" in cause.text
    assert 'raise ValueError(f"bad item {self.bad}")' in cause.text
    assert "in process_many" in cause.text


@pytest.mark.timeout(60)
def test_early_break_with_work_in_flight_leaves_no_segments_and_no_children(tmp_path):
    base = _pipeline(200).apply(ToArray(repeat=200))
    want = _run(base, runner="inline", microbatch_sizes={"to_array": 4})
    # Chunks 0..2 of both lanes (48 records) pass the gate; later micro-batches wait
    # in the workers, their inputs (tens of KB each) in shared memory.
    pipe = base.apply(Gate(str(tmp_path / "never"), from_chunk=3))
    it = pipe.iter(runner="process", num_workers=2,
                   microbatch_sizes={"to_array": 4, "gate": 4})
    got = [next(it)]
    while not _ours() and len(got) < 48:
        got.append(next(it))
    assert _ours(), "expected the inputs of unfinished micro-batches in shared memory"
    it.close()
    assert _ours() == []
    assert multiprocessing.active_children() == []
    _assert_same(got, want[:len(got)])  # what the consumer holds outlives the segments


def _run_in_daemon(out: Any) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = len(list(_pipeline(10).apply(ToArray()).iter(runner="process", num_workers=2)))
    out.put((n, [str(w.message) for w in caught]))


@pytest.mark.timeout(60)
def test_process_runner_in_daemonic_process_falls_back_to_inline():
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_run_in_daemon, args=(out,), daemon=True)
    child.start()
    n, messages = out.get(timeout=45)
    child.join(timeout=10)
    assert n == 10
    assert any("falling back to runner='inline'" in m for m in messages)


# --------------------------------------------------------------------------- the pool itself


def _records(payloads: Sequence[Any]) -> list[SampleRecord]:
    return [SampleRecord(_meta(i), p) for i, p in enumerate(payloads)]


@pytest.mark.timeout(60)
def test_numpy_payloads_survive_exactly_through_two_hops(pool):
    rng = np.random.default_rng(0)
    payloads = [
        np.arange(5, dtype=np.int32),
        rng.standard_normal((3, 4)),
        np.asfortranarray(rng.integers(0, 60000, (50, 7)).astype(np.uint16)),
        np.zeros(0, dtype=np.float32),
        np.array([True, False, True]),
        {"input_ids": np.arange(300_000, dtype=np.int64), "text": "héllo", "n": 3},
        None,
        b"raw bytes",
        np.frombuffer(b"read-only bytes!", dtype=np.uint8),
    ]
    first = pool.submit(IDENTITY, _records(payloads)).result(timeout=30)
    second = pool.submit(IDENTITY, first).result(timeout=30)  # what came back goes out again
    for got in (first, second):
        assert [r.meta for r in got] == [_meta(i) for i in range(len(payloads))]
        for record, want in zip(got, payloads):
            assert record == SampleRecord(record.meta, want)
            _assert_plain(record.payload)
            if isinstance(want, np.ndarray):
                assert record.payload.dtype == want.dtype
                assert record.payload.flags.f_contiguous == want.flags.f_contiguous
                assert record.payload.flags.writeable == want.flags.writeable


@pytest.mark.timeout(60)
def test_batches_and_records_keep_their_shape(pool):
    records = _records([np.full(100, i) for i in range(7)])
    elems = [SampleBatch(records[:3]), records[3], SampleBatch(records[4:])]
    got = pool.submit(IDENTITY, elems).result(timeout=30)
    assert got == elems
    assert [type(e) for e in got] == [SampleBatch, SampleRecord, SampleBatch]


def _block() -> Block:
    """A block of token rows (some empty, some long), a text column and a tombstone row,
    sliced so that its ragged column's offsets do not start at 0."""
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 50_000, n).astype(np.int32) for n in (4, 0, 700, 5, 1200, 9)]
    n = len(rows)
    ids = np.array([(0, 2, 40 + i, 7, i) for i in range(n)], dtype=np.int64)
    tomb = np.zeros(n, dtype=bool)
    tomb[3] = True
    block = Block(1, ids,
                  fields={"input_ids": Ragged.from_rows(rows, np.int32),
                          "text": [f"doc {i}" for i in range(n)]},
                  component=np.zeros(n, dtype=np.int64), tomb=tomb,
                  reason=[None, None, None, "empty", None, None], detail=[None] * n)
    return block.slice(1, n)


@pytest.mark.timeout(60)
def test_a_block_sent_to_a_worker_comes_back_with_its_columns(pool):
    block = _block()
    assert block.fields["input_ids"].offsets[0] > 0
    got = pool.submit(BLOCK_IDENTITY, block).result(timeout=30)
    assert type(got) is Block
    assert got.lane == block.lane
    assert got.ids.dtype == np.int64 and got.ids.shape == block.ids.shape
    assert np.array_equal(got.ids, block.ids)
    tokens = got.fields["input_ids"]
    assert isinstance(tokens, Ragged)  # still one column, not a list of arrays
    assert tokens.values.dtype == np.int32 and tokens.offsets.dtype == np.int64
    assert tokens == block.fields["input_ids"]
    assert got.fields["text"] == block.fields["text"]
    assert np.array_equal(got.tomb, block.tomb) and got.reason == block.reason
    assert np.array_equal(got.component, block.component)
    assert got.records() == block.records()
    for array in (got.ids, tokens.values, tokens.offsets, got.tomb, got.component):
        assert not isinstance(_owner(array), mmap.mmap)
    # An operator without a block path gets the block's records.
    assert pool.submit(IDENTITY, block).result(timeout=30) == block.records()


@pytest.mark.timeout(60)
def test_results_are_the_main_process_own_memory_and_leave_no_segment(pool):
    payloads = [{"input_ids": np.arange(300_000, dtype=np.int64),
                 "mask": np.ones(300_000, dtype=np.int8)},
                np.arange(5000.0)]
    got = pool.submit(IDENTITY, _records(payloads)).result(timeout=30)
    # Input and result went through segments, and both are gone once the result is here.
    assert _ours() == []
    arrays = [a for r in got for a in _arrays(r.payload)]
    assert len(arrays) == 3
    for array in arrays:
        assert array.flags.writeable
        assert not isinstance(_owner(array), mmap.mmap)  # a copy, not a view of the segment
    assert got == _records(payloads)  # and readable with the segments unlinked
    got[1].payload[:] = -1


@pytest.mark.timeout(60)
def test_a_worker_maps_its_input_arrays_from_the_segment_without_a_copy(pool):
    got = pool.submit(INPUT_OWNER, _records([np.arange(10_000), np.zeros((3, 3))])).result(
        timeout=30)
    assert [r.payload for r in got] == ["mmap", "mmap"]


@pytest.mark.timeout(60)
def test_a_queued_task_reads_its_input_segment_after_waiting(pool):
    naps = [pool.submit(NAP, _records([1])) for _ in range(2)]  # both workers busy
    before = set(_ours())
    arrays = [np.arange(1000) + i for i in range(4)]
    queued = pool.submit(IDENTITY, _records(arrays))
    assert len(set(_ours()) - before) == 1  # its input, written at submit
    assert queued.result(timeout=30) == _records(arrays)
    for nap in naps:
        nap.result(timeout=30)
    assert _ours() == []


@pytest.mark.timeout(60)
def test_a_task_retried_after_its_worker_died_reads_its_input_as_written(pool, mutate_flag):
    """The dying worker wrote into its mapping of the input first: copy-on-write keeps
    that private, so the retry (in another worker) reads the input as submitted."""
    arrays = [np.arange(5000, dtype=np.int64) * i for i in range(3)]
    workers = set(pool.worker_pids())
    got = pool.submit(MUTATE, _records(arrays)).result(timeout=60)
    assert mutate_flag.exists()  # a worker wrote into its input, then died
    assert set(pool.worker_pids()) != workers  # and was replaced
    for record, array in zip(got, arrays):
        assert record.payload.dtype == np.int64
        assert np.array_equal(record.payload, array + 1)  # +1 once, not twice
    assert _ours() == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_forked_child_closing_the_pool_leaves_the_parents_workers_and_segments(pool):
    workers = pool.worker_pids()
    before = set(_ours())
    arrays = [np.arange(1000)]
    future = pool.submit(LONG_NAP, _records(arrays))  # in flight for 2 s
    (held,) = set(_ours()) - before  # its input segment
    pid = os.fork()
    if pid == 0:  # the child's copy of the pool is its parent's: closing it must do nothing,
        try:  # and so must a SIGTERM (a scheduler stopping the child) while it is alive
            with contextlib.suppress(BaseException):
                pool.close()
            signal.raise_signal(signal.SIGTERM)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists(os.path.join(shm.segment_dir(), held))
    assert future.result(timeout=30) == _records(arrays)
    assert pool.worker_pids() == workers  # none was stopped or killed


@pytest.mark.timeout(60)
def test_unpicklable_exception_becomes_runtime_error_with_details(pool):
    with pytest.raises(RuntimeError, match=r"PickyError: left and right") as info:
        pool.submit(PICKY, _records(range(5))).result(timeout=30)
    assert "stage 'picky'" in str(info.value)
    assert isinstance(info.value.__cause__, WorkerTraceback)
    with pytest.raises(ValueError, match="bad item 3"):  # and the pool keeps working
        pool.submit(RAISING, _records(range(5))).result(timeout=30)
    assert len(pool.submit(IDENTITY, _records(range(5))).result(timeout=30)) == 5


@pytest.mark.timeout(60)
def test_workers_are_separate_processes_without_torch_and_set_up_once(pool):
    futures = [pool.submit(WHERE_AM_I, _records(range(4))) for _ in range(6)]
    infos = [r.payload for f in futures for r in f.result(timeout=30)]
    assert {info["pid"] for info in infos} <= set(pool.worker_pids())
    assert os.getpid() not in {info["pid"] for info in infos}
    assert not any(info["torch"] for info in infos)
    assert {info["setups"] for info in infos} == {1}


def test_full_segment_directory_falls_back_to_inline_bytes(tmp_path):
    writer = shm.Writer(str(tmp_path / "missing"), "zephon-x", inline_limit=0)
    with pytest.warns(RuntimeWarning, match="through the pipe"):
        ref = writer.dump([np.arange(1000), "text"])
    assert ref.name is None and ref.data is not None
    got = shm.load(ref, str(tmp_path / "missing"), copy=True)
    assert np.array_equal(got[0], np.arange(1000)) and got[1] == "text"


def test_unpicklable_operator_is_a_clear_error_before_any_process_starts():
    class Locked(Operator):
        def __init__(self) -> None:
            self.lock = threading.Lock()

    with pytest.raises(TypeError, match="cloudpickle"):
        ProcessPool([Locked()], [OpContext()], 1)


@pytest.mark.timeout(60)
def test_setup_failure_fails_futures_with_the_setup_error():
    with ProcessPool([FailingSetup()], [OpContext(stage_name="failing_setup")], 1) as p:
        with pytest.raises(OSError, match="model file missing") as info:
            p.submit(0, _records([1])).result(timeout=30)
        assert "op.setup" in info.value.__cause__.text


@pytest.mark.timeout(60)
def test_close_with_work_in_flight_fails_futures_and_does_not_hang():
    p = ProcessPool([Sleepy()], [OpContext(stage_name="sleepy")], 2, shutdown_timeout=0.2)
    futures = [p.submit(0, _records([np.arange(1000)])) for _ in range(3)]
    time.sleep(0.5)
    start = time.monotonic()
    p.close()
    p.close()  # idempotent
    assert time.monotonic() - start < 10
    for future in futures:
        with pytest.raises(RuntimeError, match="closed"):
            future.result(timeout=1)
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(0, _records([1])).result(timeout=1)


@pytest.mark.timeout(60)
def test_stale_segments_of_dead_owners_are_removed_at_pool_start():
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)
    namespace = shm.new_prefix().split("-")[2]
    directory = shm.segment_dir()
    stale = os.path.join(directory, f"{shm.SEGMENT_PREFIX}{dead}-{namespace}-0123abcd-{dead}-0")
    live = os.path.join(directory, f"{shm.SEGMENT_PREFIX}{os.getpid()}-{namespace}-fffe-1-0")
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        ProcessPool([Identity()], [OpContext()], 1).close()
        assert not os.path.exists(stale)
        assert os.path.exists(live)  # its owner (this process) is alive
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)
