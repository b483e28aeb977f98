"""Accounting you can check, and checkpoint integrity.

``stats()`` reports per lane what was read, delivered, tombstoned (by
reason), replayed and how many bytes were read; ``verify=True`` and
:func:`zephon_torch.checks.assert_conserved` check conservation at the end of
a pass. A truncated or edited state is rejected with a clear error and the
iterator is left untouched (never half-loaded).
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from harness import assert_same, collect
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.checkpoint import state_checksum
from zephon_torch.checks import ConservationError, assert_conserved
from zephon_torch.ops.base import Operator
from zephon_torch.pipeline import Pipeline


def _corpus_pipe(corpus_dir: Path, tokenizer: Any, **source: Any) -> Pipeline:
    return (Pipeline.from_jsonl(str(corpus_dir / "web" / "*"), num_lanes=4, chunk_size=16,
                                **source)
            .fetch().decode_text().tokenize(tokenizer).pack_flat(96, pad_token_id=0)
            .shuffle(8, seed=4).batch(2))


def test_stats_report_every_lane_and_add_up(corpus_dir: Path, tokenizer: Any) -> None:
    it = _corpus_pipe(corpus_dir, tokenizer).iter(runner="threads", num_workers=2,
                                                  verify=True)
    list(it)
    stats = assert_conserved(it)
    assert sorted(stats["lanes"]) == [0, 1, 2, 3]
    for counts in stats["lanes"].values():
        assert set(counts) == {"read", "delivered", "tombstoned", "replayed",
                               "replay_dropped", "sample_bytes"}
        assert counts["read"] > 0 and counts["replayed"] == counts["replay_dropped"] == 0
        assert set(counts["tombstoned"]) <= {"empty", "drop_last"}
    total = sum(len(p.read_text().splitlines()) for p in (corpus_dir / "web").glob("*.jsonl"))
    assert stats["read"] == total + 30  # the plain files' lines and the gzipped file's 30
    # Every 25th document of the plain files is empty.
    assert sum(c["tombstoned"].get("empty", 0) for c in stats["lanes"].values()) == 6
    for key in ("read", "delivered", "tombstoned", "sample_bytes"):
        per_lane = [c[key] if key != "tombstoned" else sum(c[key].values())
                    for c in stats["lanes"].values()]
        assert stats[key] == sum(per_lane)


def test_sample_bytes_is_the_size_of_the_files_over_a_whole_pass(corpus_dir: Path,
                                                                 tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    web = sorted((corpus_dir / "web").iterdir())
    jsonl = Pipeline.from_jsonl([str(p) for p in web], num_lanes=3, chunk_size=7).fetch()
    it = jsonl.iter(runner="inline")
    list(it)
    assert it.stats()["sample_bytes"] == sum(p.stat().st_size for p in web)  # .gz: compressed

    tokens = sorted((corpus_dir / "tokens").iterdir())
    it = Pipeline.from_parquet([str(p) for p in tokens], num_lanes=2, chunk_size=9).fetch().iter(
        runner="inline")
    list(it)
    compressed = 0
    for path in tokens:
        meta = pq.ParquetFile(path).metadata
        compressed += sum(meta.row_group(g).column(c).total_compressed_size
                          for g in range(meta.num_row_groups)
                          for c in range(meta.row_group(g).num_columns))
    assert it.stats()["sample_bytes"] == compressed

    for i, text in enumerate(["one", "two two", ""]):
        (tmp_path / f"{i}.txt").write_text(text)
    it = Pipeline.from_text_files(str(tmp_path / "*.txt"), num_lanes=2).fetch().iter(
        runner="inline")
    list(it)
    assert it.stats()["sample_bytes"] == 10
    it = Pipeline.from_items(["in memory"]).iter(runner="inline")
    list(it)
    assert it.stats()["sample_bytes"] == 0


def test_a_resumed_pass_accounts_for_replayed_samples(corpus_dir: Path, tokenizer: Any) -> None:
    pipe = _corpus_pipe(corpus_dir, tokenizer)
    reference = collect(pipe, runner="inline")
    dropped = []
    for cut in (1, 9, len(reference) // 2):
        it = pipe.iter(runner="inline")
        head = [next(it) for _ in range(cut)]
        state = json.loads(json.dumps(it.state_dict()))
        it.close()
        resumed = pipe.iter(runner="threads", num_workers=2, verify=True)
        resumed.load_state_dict(state)
        rest = list(resumed)  # verify=True: no ConservationError
        stats = assert_conserved(resumed)
        assert_same(reference, head + rest, label=f"cut {cut}")
        assert stats["replayed"] > 0 and stats["replayed"] == stats["replayed_samples"]
        for counts in stats["lanes"].values():
            assert counts["replay_dropped"] <= counts["replayed"]
        dropped.append(stats["replay_dropped"])
    # A packed row closes only the documents that end in it: a cut after one batch
    # may drop rows that close nothing yet; later cuts drop whole documents.
    assert dropped[-1] > 0, dropped


class LosesOne(Operator):
    """A broken user operator: silently drops one record instead of tombstoning it."""

    name = "loses_one"

    def process_many(self, elems: list[Any]) -> list[Any]:
        return [e for e in elems if e.meta.sample_id[2] != 5]


class Duplicates(Operator):
    """A broken user operator: emits one record twice."""

    name = "duplicates"

    def process_many(self, elems: list[Any]) -> list[Any]:
        out = []
        for e in elems:
            out.append(e)
            if e.meta.sample_id[2] == 5:
                out.append(e)
        return out


@pytest.mark.parametrize(("op", "message"), [
    (LosesOne(), r"lane 1: read 8 samples but accounted for 7 .*: 1 sample\(s\) lost"),
    (Duplicates(), r"closed twice, first \(lane, chunk, offset\) \[\(1, 0, 1\)\]"),
])
def test_verify_catches_an_operator_that_loses_or_duplicates(op: Operator,
                                                             message: str) -> None:
    pipe = Pipeline.from_items([f"d{i}" for i in range(20)], num_lanes=2, chunk_size=4).apply(op)
    it = pipe.iter(runner="inline", verify=True)
    with pytest.raises(ConservationError, match=message):
        list(it)
    assert len(collect(pipe, runner="inline")) in (19, 21)  # without verify nobody notices


def test_assert_conserved_needs_a_finished_pass() -> None:
    it = Pipeline.from_items([f"d{i}" for i in range(20)], num_lanes=2).iter(runner="inline")
    next(it)
    with pytest.raises(ValueError, match="whose pass has ended"):
        assert_conserved(it)
    it.close()


# ---------------------------------------------------------------- checkpoint integrity


def _saved(pipe: Pipeline, steps: int = 7) -> dict[str, Any]:
    it = pipe.iter(runner="inline")
    for _ in range(steps):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    return state


def _pipe() -> Pipeline:
    return Pipeline.from_items([f"doc {i}" for i in range(120)], num_lanes=4,
                               chunk_size=4).shuffle(8, seed=2).batch(2)


def _prefixes(mapping: dict[str, Any]) -> list[dict[str, Any]]:
    """The mapping cut after each of its keys (what a writer that died mid-way leaves)."""
    keys = list(mapping)
    return [{k: mapping[k] for k in keys[:n]} for n in range(len(keys))]


def test_a_truncated_state_never_loads() -> None:
    pipe = _pipe()
    state = _saved(pipe)
    reference = collect(pipe, runner="inline")
    cuts = list(_prefixes(state))
    for lane in state["lanes"]:
        for entry in _prefixes(state["lanes"][lane]):
            cut = copy.deepcopy(state)
            cut["lanes"][lane] = entry
            cuts.append(cut)
    for cut in cuts:
        it = pipe.iter(runner="inline")
        with pytest.raises(ValueError, match=r"corrupted state|unknown state version None"):
            it.load_state_dict(cut)
        assert_same(reference, list(it), label="after a rejected state")
    with pytest.raises(ValueError, match="corrupted state: expected a dict, got str"):
        pipe.iter(runner="inline").load_state_dict(json.dumps(state)[:100])


EDITS = {
    "a counter": (lambda s: s["lanes"]["0"].__setitem__("outputs", 3), False),
    "a window row": (lambda s: s["lanes"]["1"]["window"][0].__setitem__(1, 999), False),
    "a dropped lane": (lambda s: s["lanes"].pop("2"), False),
    "the round robin": (
        lambda s: s["round_robin"].__setitem__("index", (s["round_robin"]["index"] + 1) % 4),
        False),
    "a truncated window, checksum redone": (
        lambda s: s["lanes"]["0"]["window"][0].__delitem__(slice(1, None)), True),
    "a text counter, checksum redone": (
        lambda s: s["lanes"]["3"].__setitem__("outputs", "many"), True),
    "a cursor cut short, checksum redone": (
        lambda s: s["lanes"]["1"].__setitem__("replay_cursor", [1, 2]), True),
    "a negative count, checksum redone": (
        lambda s: s["lanes"]["0"].__setitem__("replay_count", -5), True),
    "a lane beyond num_lanes, checksum redone": (
        lambda s: s["lanes"].__setitem__("9", s["lanes"]["0"]), True),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_state_is_rejected_and_nothing_is_loaded(edit: str) -> None:
    pipe = _pipe()
    state = _saved(pipe)
    change, redo_checksum = EDITS[edit]
    edited = copy.deepcopy(state)
    change(edited)
    if redo_checksum:
        edited["checksum"] = state_checksum(edited)
    it = pipe.iter(runner="inline")
    with pytest.raises(ValueError, match=r"corrupted state.*nothing was loaded") as info:
        it.load_state_dict(edited)
    if not redo_checksum:
        assert "checksum does not match" in str(info.value)
    # Not half-loaded: the same iterator runs from the beginning, and the good state loads.
    assert_same(collect(pipe, runner="inline"), list(it), label="after a rejected state")
    fresh = pipe.iter(runner="inline")
    fresh.load_state_dict(state)
    assert len(list(fresh)) == len(collect(pipe, runner="inline")) - 7


def test_the_dataloader_and_the_torch_dataset_take_verify() -> None:
    pytest.importorskip("torch")
    from zephon_torch import DataLoader

    pipe = Pipeline.from_items([f"d{i}" for i in range(20)], num_lanes=2, chunk_size=4)
    assert len(list(DataLoader(pipe.batch(2), verify=True, to_training=False))) == 10
    assert len(list(pipe.to_torch_dataset(verify=True))) == 20
    broken = pipe.apply(LosesOne()).batch(2, drop_last=False)
    with pytest.raises(ConservationError, match="1 sample\\(s\\) lost"):
        list(DataLoader(broken, verify=True, to_training=False))


# ---------------------------------------------------------------- rows counted as records


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_rows_of_a_block_are_counted_as_their_records_would_be(data: st.DataObject) -> None:
    # The consumer counts a run of plain rows with delivered_rows (the block's
    # columns) or delivered_plain (its records); the books must not tell them apart.
    import numpy as np

    from zephon_torch.accounting import Accounting
    from zephon_torch.block import Block
    from zephon_torch.block_views import PlainRows
    from zephon_torch.sources.schedule import Chunk, ScheduleState

    flush_every = data.draw(st.sampled_from([0, 1, 3]))
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    rows = [(0, 0, 10 * c + o, c, o) for c, size in enumerate(sizes) for o in range(size)]
    if data.draw(st.booleans()):  # rows of several chunks, not in chunk order
        rows = data.draw(st.permutations(rows))
    lineage = [data.draw(st.sampled_from([(), (0,), (1, 2)])) for _ in rows]
    block = Block(2, np.array(rows, dtype=np.int64).reshape(len(rows), 5),
                  payloads=[{"i": i} for i in range(len(rows))],
                  component=np.zeros(len(rows), dtype=np.int64),
                  lineage=lineage if any(lineage) else None)
    records = block.records()
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(rows)), max_size=4))))
    bounds = [0, *cuts, len(rows)]
    books = []
    for as_rows in (False, True):
        book = Accounting([2], flush_every, verify=True)
        for c, size in enumerate(sizes):
            book.register(Chunk(ScheduleState(c, (0,)), 2, c, np.zeros(size, dtype=np.int64),
                                np.zeros(size, dtype=np.int64),
                                np.arange(size, dtype=np.int64) + 10 * c))
        for a, b in itertools.pairwise(bounds):
            if as_rows:
                book.delivered_rows(2, PlainRows(block), a, b)
            elif b > a:
                book.delivered_plain(2, records[a:b])
        books.append(book)
    plain, by_rows = books
    assert by_rows.lanes == plain.lanes
    assert by_rows.samples.closed == plain.samples.closed
    assert by_rows.samples.duplicates == plain.samples.duplicates


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(-3, 12)),
    st.tuples(st.just("many"), st.lists(st.integers(-3, 12), max_size=6)),
    st.tuples(st.just("run"), st.integers(-3, 12), st.integers(0, 6))), max_size=12))
def test_a_chunks_closed_offsets_are_a_set_however_they_are_held(ops: list[Any]) -> None:
    # Runs closed in order move a prefix instead of filling a set; the offsets
    # closed, and how many, must be those of a plain set.
    from zephon_torch.lane_progress import _ChunkProgress
    from zephon_torch.sources.schedule import ScheduleState

    progress = _ChunkProgress(10, ScheduleState(0, (0,)))
    model: set[int] = set()
    for op in ops:
        if op[0] == "add":
            assert progress.add(op[1]) == (op[1] not in model)
            model.add(op[1])
        elif op[0] == "many":
            progress.add_many(list(op[1]))
            model.update(op[1])
        else:
            start, length = op[1], op[2]
            progress.add_run(start, start + length)
            model.update(range(start, start + length))
        assert progress.offsets() == model
        assert progress.count() == len(model)
        assert not set(range(progress.prefix)) & progress.closed
