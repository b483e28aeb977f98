"""Bin placement for the packers: lengths in, bins out, over one lane's open bins.

First fit and best fit are sequential (each decision depends on the bins the
previous ones left), so numpy cannot vectorise them. They run here over a run
of document lengths at a time, in a small C kernel
(``zephon_torch/_native/binpack.c``, compiled at install when a C compiler is
present) or in :class:`TwinState`, its pure-Python twin, which makes exactly
the same decisions. The kernel knows nothing of records: a document is its
*sequence number* (the documents placed since the last reset, counted from 0),
a piece is ``(doc, start, stop, child)`` (a run of a document's tokens and its
ordinal among the document's pieces) and a bin that goes out is a *row*, a run
of pieces in placement order.

Rules, for a document of ``n >= 1`` tokens and rows of ``max_length``:

* ``"first_fit"`` / ``"best_fit"``: the document is cut into pieces of
  ``max_length`` tokens (the last shorter; one piece when ``n <= max_length``),
  placed one after the other into the first open bin with room (first fit) or
  the open bin with the least room that still fits (best fit, ties to the
  earliest opened). A piece that fits nowhere and would leave less than
  ``min_sequence_length`` of room even in a fresh bin goes out at once as a row
  of its own; otherwise it opens a bin, after the fullest open bin (ties: the
  earliest opened) went out if ``num_bins`` were open. A bin goes out as soon as
  its room drops below ``min_sequence_length``.
* ``"wrap"``: one open row; a document fills it and continues in the next one
  (each cut is a piece); ``num_bins`` does not apply.
* ``"best_fit_decreasing"``: documents are held until ``window`` of them are
  in; then the window's pieces (cut as for first fit) are sorted by length,
  longest first (ties in stream order), and placed by best fit into as many
  bins as they need (ties to the earliest opened; a bin whose room drops below
  ``min_sequence_length`` takes nothing more). All of the window's bins go out
  together, in opening order. ``num_bins`` does not apply.

:meth:`BinPlacer.flush` emits what is open in opening order (under
``"best_fit_decreasing"``, the partial window, packed) and leaves the state as
a fresh one; :meth:`BinPlacer.reset` forgets it instead.

Example, ``first_fit``, ``max_length=8``, ``num_bins=2``::

    >>> placer = BinPlacer(8, num_bins=2)
    >>> out = placer.place([5, 4, 3, 2, 6, 7])
    >>> out.rows, out.row_used.tolist(), out.row_after.tolist()
    (2, [8, 6], [2, 5])
    >>> out.row_pieces(0).tolist()  # doc, start, stop, child
    [[0, 0, 5, 0], [2, 0, 3, 0]]
    >>> placer.flush().row_used.tolist()
    [6, 7]

``ZEPHON_NATIVE=0`` in the environment makes new placers use the twin (the
CI runs the packer tests once more so); without the compiled kernel the twin
is used anyway, with a one-time warning that says how to get the fast path.
"""

from __future__ import annotations

import bisect
import os
import warnings
from array import array
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ALGORITHMS",
    "BinPlacer",
    "NativeKernelWarning",
    "Placement",
    "TwinState",
    "copy_runs",
    "native_available",
    "native_enabled",
    "native_requested",
    "ramps",
    "warn_kernel_missing",
]

#: The placement algorithms, in the kernel's order.
ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_decreasing")
_ENV = "ZEPHON_NATIVE"
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")

try:
    from zephon_torch._native import binpack as _native
    _NATIVE_ERROR = ""
except ImportError as exc:  # no compiler at install time, or built for another Python
    _native = None
    _NATIVE_ERROR = str(exc)

_warned = False


class NativeKernelWarning(RuntimeWarning):
    """A compiled kernel is missing: its pure-Python twin is used (the same results, slower)."""


def native_available() -> bool:
    """Whether the compiled kernel was built and imports."""
    return _native is not None


def native_requested() -> bool:
    """Whether ``ZEPHON_NATIVE`` leaves the compiled kernels on (unset, or 1); every kernel
    (placement, ``to_training``) reads this one switch.

    Raises:
        ValueError: ``ZEPHON_NATIVE`` holds something other than 0/1 (or
            false/true, no/yes, off/on).
    """
    value = os.environ.get(_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value not in _ON:
        raise ValueError(
            f"{_ENV}={os.environ[_ENV]!r} is not understood; set it to 0 to use the pure-Python "
            "twins of the compiled kernels, or 1 (or leave it unset) to use the compiled kernels"
        )
    return True


def native_enabled() -> bool:
    """Whether new placers use the compiled kernel (built, and not disabled by ``ZEPHON_NATIVE``).

    Raises:
        ValueError: ``ZEPHON_NATIVE`` holds something other than 0/1 (or
            false/true, no/yes, off/on).
    """
    if not native_requested():
        return False
    if _native is None:
        _warn_missing()
        return False
    return True


def copy_runs(values: np.ndarray, src: np.ndarray, dest: np.ndarray, lengths: np.ndarray,
              out: np.ndarray, *, native: bool | None = None) -> None:
    """Copy run ``p`` of ``values`` (``src[p]:src[p] + lengths[p]``) to ``out[dest[p]:...]``.

    The packers assemble flat rows with it: one call copies every piece of a
    micro-batch's rows (a ``memcpy`` per piece in the compiled kernel, without
    the GIL; a slice assignment per piece in the twin). ``values`` and ``out``
    are 1-D int32 arrays, the runs int64 arrays of one length.

    Args:
        native: True for the compiled kernel, False for the twin, None (the
            default) for :func:`native_enabled`'s choice.

    Raises:
        ValueError: A run falls outside ``values`` or ``out``.
    """
    if native is None:
        native = native_enabled()
    if native and _native is not None:
        _native.copy_runs(values, src, dest, lengths, out)
        return
    if len(lengths) and (int(lengths.min()) < 0 or int(src.min()) < 0 or int(dest.min()) < 0
                         or int((src + lengths).max()) > len(values)
                         or int((dest + lengths).max()) > len(out)):
        raise ValueError("copy_runs(): a run falls outside values or out")
    for a, d, n in zip(src.tolist(), dest.tolist(), lengths.tolist()):
        out[d:d + n] = values[a:a + n]


def ramps(starts: np.ndarray, lengths: np.ndarray, out: np.ndarray, *,
          native: bool | None = None) -> None:
    """Write ``0, 1, ..., lengths[p] - 1`` at ``out[starts[p]:]`` for every run ``p``.

    The packers' positions: every segment of a flat row (a piece, or the
    trailing padding) counts from 0. ``out`` is a 1-D int32 array, the runs
    int64 arrays of one length.

    Args:
        native: True for the compiled kernel, False for the twin, None (the
            default) for :func:`native_enabled`'s choice.

    Raises:
        ValueError: A run falls outside ``out``.
    """
    if native is None:
        native = native_enabled()
    if native and _native is not None:
        _native.ramps(starts, lengths, out)
        return
    if len(lengths) and (int(lengths.min()) < 0 or int(starts.min()) < 0
                         or int((starts + lengths).max()) > len(out)):
        raise ValueError("ramps(): a run falls outside out")
    for a, n in zip(starts.tolist(), lengths.tolist()):
        out[a:a + n] = np.arange(n, dtype=out.dtype)


def warn_kernel_missing(kernel: str, error: str, consequence: str, *, stacklevel: int) -> None:
    """Say that the compiled ``kernel`` did not import (``error``), what that costs, and how
    to get it (its caller says so once per process); ``stacklevel`` counts from the caller."""
    warnings.warn(
        f"zephon_torch: the compiled {kernel} is not available ({error}), so {consequence}. "
        "For the fast path, install a C compiler and the Python headers (e.g. apt-get install "
        "gcc python3-dev) and reinstall the package (pip install -e ., or python setup.py "
        f"build_ext --inplace in a checkout); set {_ENV}=0 to use the twin without this "
        "warning.",
        NativeKernelWarning, stacklevel=stacklevel + 1,
    )


def _warn_missing() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warn_kernel_missing(
        "placement kernel", _NATIVE_ERROR,
        "pack_flat/pack_sequences place documents with the pure-Python twin: the same rows, "
        "placed some 10-50x slower", stacklevel=3,
    )


# --------------------------------------------------------------------------- results


class Placement(NamedTuple):
    """The rows that went out during one call, as arrays (all int64).

    Row ``r`` holds pieces ``row_offsets[r]:row_offsets[r + 1]`` of
    ``pieces`` in the order they were placed; ``row_used[r]`` is its token
    count and ``row_after[r]`` the sequence number of the document whose
    placement sent it out (-1 for rows emitted by a flush), which tells a
    caller where the row goes among records it passes through unplaced.
    ``pieces`` has one row ``(doc, start, stop, child)`` per piece.
    """

    row_offsets: np.ndarray
    row_used: np.ndarray
    row_after: np.ndarray
    pieces: np.ndarray

    @property
    def rows(self) -> int:
        """The number of rows that went out."""
        return len(self.row_used)

    def row_pieces(self, row: int) -> np.ndarray:
        """The ``(doc, start, stop, child)`` pieces of row ``row``."""
        return self.pieces[self.row_offsets[row]:self.row_offsets[row + 1]]

    @classmethod
    def from_raw(cls, raw: tuple[bytes, bytes, bytes, bytes]) -> Placement:
        """From a state's ``place``/``flush`` result: four buffers of native int64."""
        offsets, used, after, pieces = (np.frombuffer(b, dtype=np.int64) for b in raw)
        return cls(offsets, used, after, pieces.reshape(-1, 4))


# --------------------------------------------------------------------------- the twin


def _check_config(max_length: int, algorithm: str, num_bins: int, min_sequence_length: int,
                  window: int) -> None:
    if algorithm not in ALGORITHMS:
        options = ", ".join(repr(a) for a in ALGORITHMS)
        raise ValueError(f"unknown algorithm {algorithm!r}; use one of {options}")
    if (max_length < 1 or num_bins < 1 or window < 1 or min_sequence_length < 1
            or min_sequence_length > max_length):
        raise ValueError(
            "placement needs max_length >= 1, num_bins >= 1, window >= 1 and "
            "1 <= min_sequence_length <= max_length; got "
            f"max_length={max_length}, num_bins={num_bins}, window={window}, "
            f"min_sequence_length={min_sequence_length}"
        )


class _Out:
    """The rows of one call, gathered as flat lists of ints."""

    __slots__ = ("after", "offsets", "pieces", "used")

    def __init__(self) -> None:
        self.offsets = [0]
        self.used: list[int] = []
        self.after: list[int] = []
        self.pieces: list[int] = []

    def row(self, pieces: list[tuple[int, int, int, int]], used: int, after: int) -> None:
        for piece in pieces:
            self.pieces.extend(piece)
        self.offsets.append(len(self.pieces) // 4)
        self.used.append(used)
        self.after.append(after)

    def result(self) -> tuple[bytes, bytes, bytes, bytes]:
        return tuple(array("q", v).tobytes()  # type: ignore[return-value]
                     for v in (self.offsets, self.used, self.after, self.pieces))


class _OpenBin:
    __slots__ = ("pieces", "used")

    def __init__(self) -> None:
        self.used = 0
        self.pieces: list[tuple[int, int, int, int]] = []

    def add(self, piece: tuple[int, int, int, int]) -> None:
        self.pieces.append(piece)
        self.used += piece[2] - piece[1]


class TwinState:
    """The pure-Python twin of the compiled ``State``: the same methods, the same results.

    Args:
        max_length: Tokens per bin.
        algorithm: One of :data:`ALGORITHMS`.
        num_bins: Open bins at most (first and best fit).
        min_sequence_length: A bin whose room drops below this goes out.
        window: Documents per best-fit-decreasing window.
    """

    def __init__(self, max_length: int, *, algorithm: str = "first_fit", num_bins: int = 8,
                 min_sequence_length: int = 1, window: int = 4096) -> None:
        _check_config(max_length, algorithm, num_bins, min_sequence_length, window)
        self.algorithm = algorithm
        self._max = max_length
        self._num_bins = num_bins
        self._min_room = min_sequence_length
        self._window_size = window
        self._bins: list[_OpenBin] = []  # open, in opening order
        self._window: list[int] = []  # best_fit_decreasing: the window's lengths
        self.admitted = 0

    @property
    def pending(self) -> bool:
        """Whether a flush would emit anything."""
        return bool(self._bins or self._window)

    def place(self, lengths: Any) -> tuple[bytes, bytes, bytes, bytes]:
        """Place documents of these lengths (a 1-D int64 array); the rows that went out."""
        values = np.asarray(lengths)
        if values.ndim != 1 or values.dtype != np.int64 or not values.flags.c_contiguous:
            raise TypeError(
                "place() takes a 1-D C-contiguous array of native int64 lengths "
                "(numpy.ascontiguousarray(lengths, dtype=numpy.int64))"
            )
        sizes = values.tolist()
        for j, length in enumerate(sizes):
            if length < 1:
                raise ValueError(
                    f"lengths[{j}] is {length}: every placed document must hold at least one "
                    "token (turn empty documents into tombstones before placing)"
                )
        out = _Out()
        for length in sizes:
            doc = self.admitted
            self.admitted += 1
            if self.algorithm == "wrap":
                self._wrap(out, doc, length)
            elif self.algorithm == "best_fit_decreasing":
                self._window.append(length)
                if len(self._window) >= self._window_size:
                    self._pack_window(out, doc)
            else:
                for child, start in enumerate(range(0, length, self._max)):
                    self._place((doc, start, min(start + self._max, length), child), out, doc)
        return out.result()

    def flush(self) -> tuple[bytes, bytes, bytes, bytes]:
        """Emit every open bin (and a partial window) in opening order; the state is fresh."""
        out = _Out()
        if self.algorithm == "best_fit_decreasing":
            if self._window:
                self._pack_window(out, -1)
        else:
            for open_bin in self._bins:
                out.row(open_bin.pieces, open_bin.used, -1)
            self._bins = []
        self.admitted = 0
        return out.result()

    def reset(self) -> None:
        """Forget everything open; the state is fresh."""
        self._bins = []
        self._window = []
        self.admitted = 0

    def copy(self) -> TwinState:
        """An independent copy."""
        twin = TwinState(self._max, algorithm=self.algorithm, num_bins=self._num_bins,
                         min_sequence_length=self._min_room, window=self._window_size)
        for open_bin in self._bins:
            clone = _OpenBin()
            clone.used, clone.pieces = open_bin.used, list(open_bin.pieces)
            twin._bins.append(clone)
        twin._window = list(self._window)
        twin.admitted = self.admitted
        return twin

    def snapshot(self) -> dict[str, Any]:
        """The state as plain values: ``admitted``, the open bins' pieces, the window."""
        return {"admitted": self.admitted,
                "bins": tuple(tuple(b.pieces) for b in self._bins),
                "window": tuple(self._window)}

    # ------------------------------------------------------------------ decisions

    def _place(self, piece: tuple[int, int, int, int], out: _Out, after: int) -> None:
        size, limit, bins = piece[2] - piece[1], self._max, self._bins
        index = None
        if self.algorithm == "best_fit":
            best_room = limit + 1
            for i, open_bin in enumerate(bins):
                room = limit - open_bin.used
                if size <= room < best_room:  # strict: ties keep the earliest opened
                    index, best_room = i, room
        else:
            for i, open_bin in enumerate(bins):
                if limit - open_bin.used >= size:
                    index = i
                    break
        if index is None:
            if limit - size < self._min_room:  # a row on its own: no open bin is pushed out
                out.row([piece], size, after)
                return
            if len(bins) >= self._num_bins:
                fullest, most = 0, -1
                for i, open_bin in enumerate(bins):
                    if open_bin.used > most:  # strict: ties keep the earliest opened
                        fullest, most = i, open_bin.used
                gone = bins.pop(fullest)
                out.row(gone.pieces, gone.used, after)
            bins.append(_OpenBin())
            index = len(bins) - 1
        target = bins[index]
        target.add(piece)
        if limit - target.used < self._min_room:
            del bins[index]
            out.row(target.pieces, target.used, after)

    def _wrap(self, out: _Out, doc: int, length: int) -> None:
        start, child, bins = 0, 0, self._bins
        while start < length:
            if not bins:
                bins.append(_OpenBin())
            row = bins[0]
            stop = min(length, start + self._max - row.used)
            row.add((doc, start, stop, child))
            if self._max - row.used < self._min_room:
                bins.pop()
                out.row(row.pieces, row.used, doc)
            start, child = stop, child + 1

    def _pack_window(self, out: _Out, after: int) -> None:
        limit, first = self._max, self.admitted - len(self._window)
        pieces = []
        for j, length in enumerate(self._window):
            for child, start in enumerate(range(0, length, limit)):
                pieces.append((first + j, start, min(start + limit, length), child))
        # Longest first; sort() is stable, so ties stay in stream order.
        pieces.sort(key=lambda p: p[1] - p[2])
        bins: list[_OpenBin] = []
        candidates: list[tuple[int, int]] = []  # (room, opening index), sorted
        for piece in pieces:
            size = piece[2] - piece[1]
            at = bisect.bisect_left(candidates, (size, -1))  # least room that fits, earliest
            if at < len(candidates):
                index = candidates.pop(at)[1]
            else:
                index = len(bins)
                bins.append(_OpenBin())
            bins[index].add(piece)
            room = limit - bins[index].used
            if room >= self._min_room:  # else the bin is closed: it takes nothing more
                bisect.insort(candidates, (room, index))
        for open_bin in bins:
            out.row(open_bin.pieces, open_bin.used, after)
        self._window = []


# --------------------------------------------------------------------------- the front


def _as_lengths(lengths: Any) -> np.ndarray:
    values = np.asarray(lengths)
    if values.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got an array of shape {values.shape}")
    if values.size and values.dtype.kind not in "iu":
        raise TypeError(f"lengths must be integers, got dtype {values.dtype}")
    return np.ascontiguousarray(values, dtype=np.int64)


class BinPlacer:
    """One lane's open bins, placed by the compiled kernel or by its twin.

    Args:
        max_length: Tokens per bin (row).
        algorithm: ``"first_fit"``, ``"best_fit"``, ``"wrap"`` or
            ``"best_fit_decreasing"`` (see the module docstring).
        num_bins: Open bins at most (first and best fit only).
        min_sequence_length: A bin whose room drops below this goes out.
        window: Documents per ``"best_fit_decreasing"`` window.
        native: True for the compiled kernel, False for the twin, None (the
            default) for the kernel unless ``ZEPHON_NATIVE=0`` or it is not
            built (then a one-time :class:`NativeKernelWarning`).

    Raises:
        ValueError: A parameter out of range.
        RuntimeError: ``native=True`` but the kernel is not built.
    """

    __slots__ = ("_state", "native")

    def __init__(self, max_length: int, *, algorithm: str = "first_fit", num_bins: int = 8,
                 min_sequence_length: int = 1, window: int = 4096,
                 native: bool | None = None) -> None:
        if native is None:
            native = native_enabled()
        elif native and _native is None:
            raise RuntimeError(
                f"the compiled placement kernel is not available ({_NATIVE_ERROR}); build it "
                "with a C compiler and the Python headers (pip install -e .) or pass "
                "native=False"
            )
        factory = _native.State if native else TwinState
        self._state = factory(int(max_length), algorithm=algorithm, num_bins=int(num_bins),
                              min_sequence_length=int(min_sequence_length), window=int(window))
        self.native = bool(native)

    @property
    def pending(self) -> bool:
        """Whether a flush would emit anything (open bins, or a partial window)."""
        return self._state.pending

    @property
    def admitted(self) -> int:
        """Documents placed since the last reset (the next document's sequence number)."""
        return self._state.admitted

    def place(self, lengths: Any) -> Placement:
        """Place a run of documents, in stream order; the rows that went out meanwhile.

        Args:
            lengths: Token counts (1-D integers, each >= 1); the documents get
                the sequence numbers ``admitted, admitted + 1, ...``.

        Raises:
            ValueError: A length below 1, or lengths that are not 1-D.
            TypeError: Lengths that are not integers.
        """
        return Placement.from_raw(self._state.place(_as_lengths(lengths)))

    def flush(self) -> Placement:
        """Emit every open bin (and a partial window) in opening order; the state is fresh."""
        return Placement.from_raw(self._state.flush())

    def reset(self) -> None:
        """Forget what is open; the state is fresh."""
        self._state.reset()

    def copy(self) -> BinPlacer:
        """An independent placer in the same state, on the same implementation."""
        clone = object.__new__(BinPlacer)
        clone._state = self._state.copy()
        clone.native = self.native
        return clone

    def snapshot(self) -> dict[str, Any]:
        """The state as plain values (``admitted``, open bins' pieces, window lengths)."""
        return self._state.snapshot()
