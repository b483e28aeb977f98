"""Tests for the placement kernel (``zephon_torch.ops._binpack``): the compiled ``State``
and its pure-Python twin against a reference model of the packers' rules, and
against each other.

The reference model (:class:`Reference`) is the placement the packers made
before the kernel existed, written out plainly: bins as dicts, best fit and
"fullest" as ``min``/``max`` over the open bins, best-fit-decreasing by a
linear scan. The kernel's implementations must give the same rows, in the
same order, whatever way the documents are split into calls.
"""

from __future__ import annotations

import itertools
import os
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.ops import _binpack
from zephon_torch.ops._binpack import (
    ALGORITHMS,
    BinPlacer,
    NativeKernelWarning,
    Placement,
    TwinState,
    copy_runs,
    native_available,
    native_enabled,
    ramps,
)

Row = tuple[tuple[tuple[int, int, int, int], ...], int, int]  # pieces, used, after
# ZEPHON_NATIVE=0 stands for a machine without the compiled kernel: its tests skip.
DISABLED = os.environ.get("ZEPHON_NATIVE", "").strip().lower() in ("0", "false", "no", "off")
NATIVE = native_available() and not DISABLED
WHY_NOT = ("the compiled placement kernel is disabled by ZEPHON_NATIVE" if DISABLED else
           "the compiled placement kernel is not built (no C compiler?)")


@pytest.fixture(scope="module", params=["native", "twin"])
def native(request: pytest.FixtureRequest) -> bool:
    """Each test once on the compiled kernel and once on the twin (placers get it explicitly)."""
    if request.param == "native" and not NATIVE:
        pytest.skip(WHY_NOT)
    return request.param == "native"


# --------------------------------------------------------------------------- reference


class Reference:
    """The packers' placement rules, one document at a time (see ``ops/packing.py``)."""

    def __init__(self, max_length: int, algorithm: str, num_bins: int, min_room: int,
                 window: int) -> None:
        self.max, self.algorithm, self.num_bins = max_length, algorithm, num_bins
        self.min_room, self.window_size = min_room, window
        self.bins: list[dict[str, Any]] = []
        self.window: list[int] = []
        self.seq = 0

    def _out(self, rows: list[Row], b: dict[str, Any], after: int) -> None:
        rows.append((tuple(b["pieces"]), b["used"], after))

    def place(self, lengths: list[int]) -> list[Row]:
        rows: list[Row] = []
        for n in lengths:
            doc, self.seq = self.seq, self.seq + 1
            if self.algorithm == "wrap":
                start, child = 0, 0
                while start < n:
                    if not self.bins:
                        self.bins.append({"used": 0, "pieces": []})
                    row = self.bins[0]
                    stop = min(n, start + self.max - row["used"])
                    row["pieces"].append((doc, start, stop, child))
                    row["used"] += stop - start
                    if self.max - row["used"] < self.min_room:
                        self._out(rows, self.bins.pop(), doc)
                    start, child = stop, child + 1
            elif self.algorithm == "best_fit_decreasing":
                self.window.append(n)
                if len(self.window) == self.window_size:
                    self._decreasing(rows, doc)
            else:
                for child, start in enumerate(range(0, n, self.max)):
                    self._fit(rows, (doc, start, min(n, start + self.max), child), doc)
        return rows

    def _fit(self, rows: list[Row], piece: tuple[int, int, int, int], after: int) -> None:
        size = piece[2] - piece[1]
        fits = [(self.max - b["used"], i) for i, b in enumerate(self.bins)
                if self.max - b["used"] >= size]
        if fits:
            index = min(fits)[1] if self.algorithm == "best_fit" else fits[0][1]
        elif self.max - size < self.min_room:
            rows.append(((piece,), size, after))
            return
        else:
            if len(self.bins) == self.num_bins:
                fullest = max(range(len(self.bins)), key=lambda i: (self.bins[i]["used"], -i))
                self._out(rows, self.bins.pop(fullest), after)
            self.bins.append({"used": 0, "pieces": []})
            index = len(self.bins) - 1
        target = self.bins[index]
        target["pieces"].append(piece)
        target["used"] += size
        if self.max - target["used"] < self.min_room:
            self._out(rows, self.bins.pop(index), after)

    def _decreasing(self, rows: list[Row], after: int) -> None:
        first = self.seq - len(self.window)
        pieces = [(first + j, start, min(n, start + self.max), child)
                  for j, n in enumerate(self.window)
                  for child, start in enumerate(range(0, n, self.max))]
        order = sorted(range(len(pieces)), key=lambda k: (pieces[k][1] - pieces[k][2], k))
        bins: list[dict[str, Any]] = []
        for k in order:
            piece = pieces[k]
            size = piece[2] - piece[1]
            fits = [(self.max - b["used"], i) for i, b in enumerate(bins)
                    if b["open"] and self.max - b["used"] >= size]
            if fits:
                target = bins[min(fits)[1]]
            else:
                target = {"used": 0, "pieces": [], "open": True}
                bins.append(target)
            target["pieces"].append(piece)
            target["used"] += size
            target["open"] = self.max - target["used"] >= self.min_room
        for b in bins:
            self._out(rows, b, after)
        self.window = []

    def flush(self) -> list[Row]:
        rows: list[Row] = []
        if self.algorithm == "best_fit_decreasing":
            if self.window:
                self._decreasing(rows, -1)
        else:
            for b in self.bins:
                self._out(rows, b, -1)
            self.bins = []
        self.seq = 0
        return rows


def as_rows(out: Placement) -> list[Row]:
    return [(tuple(tuple(p) for p in out.row_pieces(r).tolist()), int(out.row_used[r]),
             int(out.row_after[r])) for r in range(out.rows)]


@st.composite
def scripts(draw: Any) -> dict[str, Any]:
    """A placer's configuration and a script of place/flush calls."""
    max_length = draw(st.integers(1, 16))
    steps = draw(st.lists(
        st.one_of(st.lists(st.integers(1, 3 * max_length), max_size=12), st.just("flush")),
        max_size=10))
    return {"config": {"max_length": max_length,
                       "algorithm": draw(st.sampled_from(ALGORITHMS)),
                       "num_bins": draw(st.integers(1, 5)),
                       "min_sequence_length": draw(st.integers(1, max_length)),
                       "window": draw(st.integers(1, 8))},
            "steps": steps}


def _reference(config: dict[str, Any]) -> Reference:
    return Reference(config["max_length"], config["algorithm"], config["num_bins"],
                     config["min_sequence_length"], config["window"])


# --------------------------------------------------------------------------- properties


@settings(max_examples=300, deadline=None)
@given(scripts())
def test_the_kernel_places_exactly_as_the_reference_rules(native, script):
    config = script["config"]
    placer, reference = BinPlacer(**config, native=native), _reference(config)
    assert placer.native is native
    for step in [*script["steps"], "flush"]:
        if step == "flush":
            assert as_rows(placer.flush()) == reference.flush()
            assert not placer.pending and placer.admitted == 0
        else:
            assert as_rows(placer.place(step)) == reference.place(step)


@settings(max_examples=200, deadline=None)
@given(scripts(), st.data())
def test_the_rows_do_not_depend_on_how_the_documents_are_split_into_calls(native, script, data):
    config = script["config"]
    lengths = [n for step in script["steps"] if step != "flush" for n in step]
    whole = BinPlacer(**config, native=native)
    expected = as_rows(whole.place(lengths)) + as_rows(whole.flush())
    pieces = BinPlacer(**config, native=native)
    got: list[Row] = []
    start = 0
    while start < len(lengths):
        stop = data.draw(st.integers(start + 1, len(lengths)))
        got += as_rows(pieces.place(lengths[start:stop]))
        start = stop
    assert got + as_rows(pieces.flush()) == expected


@pytest.mark.skipif(not NATIVE, reason=WHY_NOT)
@settings(max_examples=300, deadline=None)
@given(scripts(), st.data())
def test_the_compiled_kernel_and_the_twin_decide_identically(script, data):
    """Same rows, same arrays, same state after every call, copies and resets included."""
    config = script["config"]
    native, twin = BinPlacer(**config, native=True), BinPlacer(**config, native=False)
    for step in [*script["steps"], "flush"]:
        action = data.draw(st.sampled_from(["call", "call", "copy", "reset"]))
        if action == "copy":
            native, twin = native.copy(), twin.copy()
        elif action == "reset" and step == "flush":
            native.reset()
            twin.reset()
        if step == "flush":
            a, b = native.flush(), twin.flush()
        else:
            lengths = np.array(step, dtype=np.int64)
            a, b = native.place(lengths), twin.place(lengths)
        for x, y in zip(a, b):
            assert x.dtype == y.dtype == np.int64
            assert x.tolist() == y.tolist()
        assert native.snapshot() == twin.snapshot()
        assert (native.pending, native.admitted) == (twin.pending, twin.admitted)


@settings(max_examples=100, deadline=None)
@given(scripts())
def test_every_token_goes_out_once_in_rows_that_fit(native, script):
    config = script["config"]
    limit = config["max_length"]
    placer = BinPlacer(**config, native=native)
    lengths = [n for step in script["steps"] if step != "flush" for n in step]
    rows = as_rows(placer.place(lengths)) + as_rows(placer.flush())
    covered: dict[int, list[tuple[int, int, int]]] = {}
    for pieces, used, _ in rows:
        assert 0 < used <= limit and used == sum(stop - start for _, start, stop, _ in pieces)
        for doc, start, stop, child in pieces:
            covered.setdefault(doc, []).append((child, start, stop))
    for doc, n in enumerate(lengths):
        spans = sorted(covered[doc])
        assert [c for c, _, _ in spans] == list(range(len(spans)))
        assert spans[0][1] == 0 and spans[-1][2] == n
        assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))


# --------------------------------------------------------------------------- behaviour


def test_the_docstring_example_first_fit(native):
    placer = BinPlacer(8, num_bins=2, native=native)
    out = placer.place([5, 4, 3, 2, 6, 7])
    assert (out.rows, out.row_used.tolist(), out.row_after.tolist()) == (2, [8, 6], [2, 5])
    assert out.row_pieces(0).tolist() == [[0, 0, 5, 0], [2, 0, 3, 0]]
    assert out.row_pieces(1).tolist() == [[1, 0, 4, 0], [3, 0, 2, 0]]
    assert placer.pending and placer.admitted == 6
    flushed = placer.flush()
    assert flushed.row_used.tolist() == [6, 7] and flushed.row_after.tolist() == [-1, -1]
    assert not placer.pending and placer.admitted == 0


def test_best_fit_decreasing_sorts_the_window_longest_first_and_emits_bins_in_opening_order(
        native):
    placer = BinPlacer(8, algorithm="best_fit_decreasing", window=6, native=native)
    assert placer.place([3, 6, 2, 5, 2]).rows == 0 and placer.pending
    out = placer.place([4])  # the sixth document completes the window
    assert [r[0] for r in as_rows(out)] == [
        ((1, 0, 6, 0), (2, 0, 2, 0)),
        ((3, 0, 5, 0), (0, 0, 3, 0)),
        ((5, 0, 4, 0), (4, 0, 2, 0)),
    ]
    assert out.row_after.tolist() == [5, 5, 5] and out.row_used.tolist() == [8, 8, 6]
    assert not placer.pending and placer.admitted == 6  # numbering goes on until a reset


def test_best_fit_decreasing_ties_keep_stream_order_and_split_long_documents(native):
    placer = BinPlacer(4, algorithm="best_fit_decreasing", window=100, native=native)
    placer.place([2, 9, 2])
    rows = as_rows(placer.flush())
    # pieces 4, 4 (doc 1, children 0 and 1), then 2, 2, 1 in stream order: 0, 2, then 1's tail
    assert [r[0] for r in rows] == [
        ((1, 0, 4, 0),), ((1, 4, 8, 1),), ((0, 0, 2, 0), (2, 0, 2, 0)), ((1, 8, 9, 2),)]


def test_best_fit_decreasing_closes_a_bin_whose_room_drops_below_min_sequence_length(native):
    placer = BinPlacer(10, algorithm="best_fit_decreasing", min_sequence_length=3,
                       window=3, native=native)
    # 8 leaves room 2 < 3: its bin takes nothing more, so 2 and 1 share a new bin.
    out = placer.place([1, 8, 2])
    assert [r[0] for r in as_rows(out)] == [((1, 0, 8, 0),), ((2, 0, 2, 0), (0, 0, 1, 0))]


def test_wrap_cuts_documents_at_row_ends(native):
    placer = BinPlacer(4, algorithm="wrap", native=native)
    out = placer.place([3, 3, 2])
    assert [r[0] for r in as_rows(out)] == [((0, 0, 3, 0), (1, 0, 1, 0)),
                                           ((1, 1, 3, 1), (2, 0, 2, 0))]
    assert not placer.pending


def test_a_copy_is_independent_of_the_original(native):
    placer = BinPlacer(10, algorithm="best_fit", num_bins=3, native=native)
    placer.place([6, 7, 3])
    before = placer.snapshot()
    clone = placer.copy()
    assert clone.snapshot() == before and clone.native is native
    clone_rows = as_rows(clone.place([4, 9])) + as_rows(clone.flush())
    assert placer.snapshot() == before  # the clone's work left the original alone
    assert as_rows(placer.place([4, 9])) + as_rows(placer.flush()) == clone_rows


def test_reset_forgets_open_bins_and_the_window(native):
    for algorithm in ALGORITHMS:
        placer = BinPlacer(10, algorithm=algorithm, window=5, native=native)
        placer.place([3, 4])
        placer.reset()
        assert not placer.pending and placer.admitted == 0
        assert placer.flush().rows == 0
        assert placer.snapshot() == BinPlacer(10, algorithm=algorithm, native=native).snapshot()


@pytest.mark.parametrize(("lengths", "error", "message"), [
    ([3, 0, 2], ValueError, r"lengths\[1\] is 0: every placed document must hold at least one"),
    ([-4], ValueError, r"lengths\[0\] is -4"),
    ([[1, 2]], ValueError, r"lengths must be 1-D, got an array of shape \(1, 2\)"),
    ([1.5], TypeError, "lengths must be integers, got dtype float64"),
])
def test_bad_lengths_are_refused_before_anything_is_placed(native, lengths, error, message):
    placer = BinPlacer(8, native=native)
    placer.place([2])
    with pytest.raises(error, match=message):
        placer.place(lengths)
    assert placer.admitted == 1  # nothing of the refused call was placed


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"algorithm": "next_fit"}, "unknown algorithm 'next_fit'; use one of 'first_fit'"),
    ({"max_length": 0}, "max_length >= 1"),
    ({"num_bins": 0}, "num_bins=0"),
    ({"window": 0}, "window=0"),
    ({"min_sequence_length": 9}, "min_sequence_length=9"),
])
def test_bad_configuration_is_refused(native, kwargs, message):
    config = {"max_length": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        BinPlacer(**config, native=native)


def test_the_raw_states_refuse_arrays_that_are_not_native_int64(native):
    state = BinPlacer(8, native=native)._state
    for bad in (np.array([1, 2], dtype=np.int32), np.arange(8, dtype=np.int64)[::2]):
        with pytest.raises(TypeError, match="1-D C-contiguous array of native int64"):
            state.place(bad)


# --------------------------------------------------------------------------- selection


def test_zephon_native_0_selects_the_twin(monkeypatch):
    monkeypatch.setenv("ZEPHON_NATIVE", "0")
    assert native_enabled() is False
    assert BinPlacer(8).native is False
    assert isinstance(BinPlacer(8)._state, TwinState)


def test_without_zephon_native_the_compiled_kernel_is_used_when_built(monkeypatch):
    monkeypatch.delenv("ZEPHON_NATIVE", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NativeKernelWarning)
        assert BinPlacer(8).native is native_available()
    monkeypatch.setenv("ZEPHON_NATIVE", "1")
    assert native_enabled() is native_available()


def test_an_unknown_zephon_native_value_is_an_error(monkeypatch):
    monkeypatch.setenv("ZEPHON_NATIVE", "maybe")
    with pytest.raises(ValueError, match=r"ZEPHON_NATIVE='maybe' is not understood; set it to 0"):
        BinPlacer(8)


def test_a_missing_kernel_warns_once_and_falls_back_to_the_twin(monkeypatch):
    monkeypatch.delenv("ZEPHON_NATIVE", raising=False)
    monkeypatch.setattr(_binpack, "_native", None)
    monkeypatch.setattr(_binpack, "_NATIVE_ERROR", "No module named 'binpack'")
    monkeypatch.setattr(_binpack, "_warned", False)
    with pytest.warns(NativeKernelWarning, match="pure-Python twin.*C compiler.*ZEPHON_NATIVE=0"):
        assert BinPlacer(8).native is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert BinPlacer(8).native is False  # once per process
    with pytest.raises(RuntimeError, match="compiled placement kernel is not available"):
        BinPlacer(8, native=True)


# --------------------------------------------------------------------------- row assembly


@st.composite
def run_tables(draw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Values, and runs of them laid out without overlap in an output of ``size`` slots."""
    values = np.array(draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=200)),
                      dtype=np.int32)
    src, dest, lengths = [], [], []
    at = 0
    for _ in range(draw(st.integers(0, 30))):
        start = draw(st.integers(0, len(values)))
        n = draw(st.integers(0, len(values) - start))
        at += draw(st.integers(0, 5))  # gaps stay as they were (padding)
        src.append(start)
        dest.append(at)
        lengths.append(n)
        at += n
    order = draw(st.permutations(range(len(src))))  # runs need not come in output order
    as64 = [np.array([x[i] for i in order], dtype=np.int64) for x in (src, dest, lengths)]
    return (values, *as64, at + draw(st.integers(0, 5)))


@settings(max_examples=200, deadline=None)
@given(run_tables())
def test_copy_runs_lays_each_run_where_it_is_asked(native, table):
    values, src, dest, lengths, size = table
    out = np.full(size, -7, dtype=np.int32)
    copy_runs(values, src, dest, lengths, out, native=native)
    want = np.full(size, -7, dtype=np.int32)
    for a, d, n in zip(src.tolist(), dest.tolist(), lengths.tolist()):
        want[d:d + n] = values[a:a + n]
    assert out.tolist() == want.tolist()


@pytest.mark.parametrize(("src", "dest", "length"), [(8, 0, 3), (0, 9, 2), (-1, 0, 1),
                                                     (0, -1, 1), (0, 0, -1)])
def test_copy_runs_refuses_a_run_outside_its_arrays(native, src, dest, length):
    values, out = np.arange(10, dtype=np.int32), np.zeros(10, dtype=np.int32)
    runs = [np.array([x], dtype=np.int64) for x in (src, dest, length)]
    with pytest.raises(ValueError, match="outside"):
        copy_runs(values, *runs, out, native=native)
    assert not out.any()  # nothing was written


@pytest.mark.skipif(not NATIVE, reason=WHY_NOT)
def test_the_compiled_copy_runs_names_an_array_of_the_wrong_kind():
    runs = [np.zeros(1, dtype=np.int64)] * 3
    with pytest.raises(TypeError, match="values must be a 1-D C-contiguous array of int32"):
        copy_runs(np.zeros(4, dtype=np.int64), *runs, np.zeros(4, dtype=np.int32), native=True)
    with pytest.raises(TypeError, match="out must be a 1-D C-contiguous writable array"):
        copy_runs(np.zeros(4, dtype=np.int32), *runs, np.zeros(4, dtype=np.int32)[::2],
                  native=True)


@settings(max_examples=200, deadline=None)
@given(run_tables())
def test_ramps_count_each_run_from_zero_and_leave_the_rest(native, table):
    _, _, starts, lengths, size = table
    out = np.full(size, -7, dtype=np.int32)
    ramps(starts, lengths, out, native=native)
    want = np.full(size, -7, dtype=np.int32)
    for a, n in zip(starts.tolist(), lengths.tolist()):
        want[a:a + n] = np.arange(n)
    assert out.tolist() == want.tolist()


@pytest.mark.parametrize(("start", "length"), [(8, 3), (-1, 1), (0, -1)])
def test_ramps_refuse_a_run_outside_out(native, start, length):
    out = np.zeros(10, dtype=np.int32)
    runs = [np.array([x], dtype=np.int64) for x in (start, length)]
    with pytest.raises(ValueError, match="outside"):
        ramps(*runs, out, native=native)
    assert not out.any()
