"""Tests for the process runner: ``runners/process.py`` and its transport ``runners/shm.py``.

Everything here starts real worker processes (spawned, so each costs an
interpreter start): pipelines and pools are kept few and small.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
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

    def process_many(self, elems):
        time.sleep(0.3)
        return list(elems)


class Sleepy(Operator):
    name = "sleepy"

    def process_many(self, elems):
        time.sleep(30)
        return list(elems)


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
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert type(a) is type(b)
        assert a == b  # metas equal, payload arrays equal by dtype, shape and value
        records = zip(a.records, b.records) if isinstance(a, SampleBatch) else [(a, b)]
        for x, y in records:
            assert not isinstance(x.payload, shm.LazyPayload)
            assert x.payload.dtype == y.payload.dtype


_SHARED: list[ProcessPool] = []  # the module's pool: its workers outlive single tests


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    gc.collect()  # blocks caught in reference cycles release their segments at collection
    shared = {pid for p in _SHARED for pid in p.worker_pids()}
    assert [c for c in multiprocessing.active_children() if c.pid not in shared] == []
    assert _ours() == []
    if not _SHARED:  # supervisor and feeder threads are joined too
        assert [t.name for t in threading.enumerate() if t.name.startswith("zephon-")] == []


@pytest.fixture(scope="module")
def pool():
    """One pool for the unit tests (stages: identity, raising, picky, where_am_i, ..., nap)."""
    ops = [Identity(), Raising(bad=3), Raising(bad=3, picky=True), WhereAmI(), InlineProbe(),
           Nap()]
    ctxs = [OpContext(stage_index=i, stage_name=op.name if i != 2 else "picky")
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


@pytest.mark.timeout(60)
def test_consecutive_process_stages_pass_handles_without_reading_them():
    pipe = _pipeline().apply(ToArray(repeat=40)).apply(MapWith(lambda a: a - 1))
    sizes = {"to_array": 3, "map_with": 4}  # regrouping: a micro-batch spans two blocks
    before = shm.decode_counts()
    it = pipe.iter(runner="process", num_workers=2, microbatch_sizes=sizes)
    got = []
    seen_segments = 0
    for item in it:
        got.append(item)
        seen_segments = max(seen_segments, len(_ours()))
    it.close()
    after = shm.decode_counts()
    read_here = {tag: after.get(tag, 0) - before.get(tag, 0) for tag in after}
    assert read_here.get(0, 0) == 0  # to_array's output went to map_with as handles
    assert read_here.get(1, 0) > 0  # map_with's output was resolved for the consumer
    assert seen_segments > 0  # payloads really went through shared memory
    _assert_same(got, _run(pipe, runner="inline", microbatch_sizes=sizes))


def _assert_same_rows(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a == b  # metas (with their contributors) and payload arrays
        records = a.records if isinstance(a, SampleBatch) else [a]
        assert not any(isinstance(r.payload, shm.LazyPayload) for r in records)


@pytest.mark.timeout(60)
def test_a_packer_places_handles_by_their_lengths_without_reading_the_documents():
    """Tokenized documents reach pack_flat as shared-memory handles; it places them by
    the lengths their worker recorded, and the bin plans carry the handles on to
    the workers that assemble the rows: the main process never reads them, not
    even to split the documents longer than a row."""
    pipe = _pipeline(80).apply(ToIds()).pack_flat(24, num_bins=3).batch(2)
    before = shm.decode_counts()
    got = _run(pipe, runner="process", num_workers=2)
    after = shm.decode_counts()
    assert after.get(0, 0) - before.get(0, 0) == 0  # to_ids' blocks: never read here
    assert after.get(1, 0) - before.get(1, 0) > 0  # the rows are, for the consumer
    _assert_same_rows(got, _run(pipe, runner="inline"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["first_fit", "best_fit", "wrap"])
def test_a_packer_given_handles_decides_as_inline_when_some_must_be_read(algorithm):
    """Handles of split documents, of loss masks and under wrap placement; those with a
    float mask (not described as an id array) are read. The output is still the
    inline runner's."""
    pipe = (_pipeline(80).apply(ToIds(mask=True))
            .pack_flat(24, num_bins=2, algorithm=algorithm).batch(3))
    sizes = {"to_ids": 5}
    got = _run(pipe, runner="process", num_workers=2, microbatch_sizes=sizes)
    _assert_same_rows(got, _run(pipe, runner="inline", microbatch_sizes=sizes))
    seq = _pipeline(40).apply(ToIds(mask=True)).pack_sequences(24, num_bins=2)
    got = _run(seq, runner="process", num_workers=2)
    want = _run(seq, runner="inline")
    assert [r.meta for r in got] == [r.meta for r in want]
    for a, b in zip(got, want):
        assert [{k: v.tolist() for k, v in p.items()} for p in a.payload["packed_samples"]] == [
            {k: v.tolist() for k, v in p.items()} for p in b.payload["packed_samples"]]


@pytest.mark.timeout(60)
def test_worker_killed_mid_run_is_replaced_and_output_is_identical(tmp_path):
    flag = tmp_path / "killed"
    base = _pipeline().apply(ToArray(repeat=20))
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
def test_early_break_leaves_no_segments_and_no_children():
    pipe = _pipeline(200).apply(ToArray(repeat=50))
    it = pipe.iter(runner="process", num_workers=2, microbatch_sizes={"to_array": 4})
    first = next(it)
    deadline = time.monotonic() + 10
    while not _ours() and time.monotonic() < deadline:  # prefetched results wait in /dev/shm
        time.sleep(0.02)
    assert _ours(), "expected unresolved results in shared memory"
    for _ in range(3):
        next(it)
    it.close()
    assert _ours() == []
    assert multiprocessing.active_children() == []
    assert first.payload.dtype == np.int32


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
    first = pool.submit(0, _records(payloads)).result(timeout=30)
    assert [isinstance(r.payload, shm.LazyPayload) for r in first] == [
        p is not None for p in payloads]  # no payload, no handle
    before = shm.decode_counts().get(0, 0)
    second = pool.submit(0, first).result(timeout=30)  # handles forwarded, nothing read here
    assert shm.decode_counts().get(0, 0) == before
    got = pool.resolve(second)
    assert shm.decode_counts().get(0, 0) == before + 1
    for record, want in zip(got, payloads):
        assert record == SampleRecord(record.meta, want)
        if isinstance(want, np.ndarray):
            assert record.payload.dtype == want.dtype
            assert record.payload.flags.f_contiguous == want.flags.f_contiguous
            assert record.payload.flags.writeable == want.flags.writeable
    assert [r.meta for r in got] == [_meta(i) for i in range(len(payloads))]


@pytest.mark.timeout(60)
def test_batches_and_records_keep_their_shape(pool):
    records = _records([np.full(100, i) for i in range(7)])
    elems = [SampleBatch(records[:3]), records[3], SampleBatch(records[4:])]
    got = pool.resolve(pool.submit(0, elems).result(timeout=30))
    assert got == elems
    assert [type(e) for e in got] == [SampleBatch, SampleRecord, SampleBatch]


@pytest.mark.timeout(60)
def test_unpicklable_exception_becomes_runtime_error_with_details(pool):
    with pytest.raises(RuntimeError, match=r"PickyError: left and right") as info:
        pool.submit(2, _records(range(5))).result(timeout=30)
    assert "stage 'picky'" in str(info.value)
    assert isinstance(info.value.__cause__, WorkerTraceback)
    with pytest.raises(ValueError, match="bad item 3"):  # and the pool keeps working
        pool.submit(1, _records(range(5))).result(timeout=30)
    assert len(pool.submit(0, _records(range(5))).result(timeout=30)) == 5


@pytest.mark.timeout(60)
def test_workers_are_separate_processes_without_torch_and_set_up_once(pool):
    futures = [pool.submit(3, _records(range(4))) for _ in range(6)]
    infos = [r.payload for f in futures for r in pool.resolve(f.result(timeout=30))]
    assert {info["pid"] for info in infos} <= set(pool.worker_pids())
    assert os.getpid() not in {info["pid"] for info in infos}
    assert not any(info["torch"] for info in infos)
    assert {info["setups"] for info in infos} == {1}


@pytest.mark.timeout(60)
def test_micro_batch_mixing_handles_read_blocks_and_real_payloads(pool):
    arrays = [np.full(64, i, dtype=np.int16) for i in range(6)]
    first = pool.submit(0, _records(arrays)).result(timeout=30)
    (read,) = pool.resolve([first[0]])  # reads the block here
    other = pool.submit(0, _records(arrays)).result(timeout=30)  # still in shared memory
    fresh = SampleRecord(_meta(9), np.arange(70))
    elems = [other[2], first[1], fresh, other[0], read]
    got = pool.resolve(pool.submit(0, elems).result(timeout=30))
    assert got == pool.resolve(elems)
    assert [r.meta for r in got] == [e.meta for e in elems]


@pytest.mark.timeout(60)
def test_reading_a_block_here_does_not_pull_it_from_under_a_queued_task(pool):
    # A tombstone may overtake its siblings and be resolved at a later stage while
    # they still wait, as handles to the same block, in a worker's queue.
    first = pool.submit(0, _records([np.arange(100) + i for i in range(4)])).result(timeout=30)
    naps = [pool.submit(5, _records([1])) for _ in range(2)]  # both workers busy
    queued = pool.submit(0, first[1:])
    pool.resolve(first[:1])
    assert pool.resolve(queued.result(timeout=30)) == pool.resolve(first[1:])
    for nap in naps:
        nap.result(timeout=30)


def test_blocks_unlink_their_segment_when_dropped_or_when_the_ledger_closes():
    directory = shm.segment_dir()
    prefix = f"{shm.new_prefix()}-{os.getpid()}"
    writer = shm.Writer(directory, prefix, inline_limit=0)
    ledger = shm.Ledger(directory)
    block = shm.Block(writer.dump([np.arange(10)]), ledger)
    path = os.path.join(directory, block.ref.name)
    assert os.path.exists(path)
    del block
    assert not os.path.exists(path)  # the last reference died
    block = shm.Block(writer.dump([np.arange(10)]), ledger)
    ledger.release_all()  # what ProcessPool.close() does
    assert _ours() == []
    with pytest.raises(RuntimeError, match="closed before it was resolved"):
        shm.LazyPayload(block, 0).load()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_unlinks_its_parents_segments():
    directory = shm.segment_dir()
    writer = shm.Writer(directory, f"{shm.new_prefix()}-{os.getpid()}", inline_limit=0)
    ledger = shm.Ledger(directory)
    block = shm.Block(writer.dump([np.arange(10)]), ledger)
    path = os.path.join(directory, block.ref.name)
    pid = os.fork()
    if pid == 0:  # the child drops the block, then closes the ledger: both must be no-ops
        try:
            del block
            ledger.release_all()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists(path)
    del block
    assert not os.path.exists(path)


def test_full_segment_directory_falls_back_to_inline_bytes(tmp_path):
    writer = shm.Writer(str(tmp_path / "missing"), "zephon-x", inline_limit=0)
    with pytest.warns(RuntimeWarning, match="through the pipe"):
        ref = writer.dump([np.arange(1000), "text"])
    assert ref.name is None and ref.data is not None
    got = shm.load(ref, str(tmp_path / "missing"), copy=True)
    assert np.array_equal(got[0], np.arange(1000)) and got[1] == "text"


def test_lazy_payload_refuses_to_be_pickled():
    ledger = shm.Ledger(shm.segment_dir())
    ref = shm.Writer(shm.segment_dir(), "unused", inline_limit=10_000).dump([1, 2])
    with pytest.raises(TypeError, match="resolve it first"):
        pickle.dumps(shm.LazyPayload(shm.Block(ref, ledger), 0))


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
