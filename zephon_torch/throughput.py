"""The pace of one run: ``stats()["throughput"]`` and the periodic log line.

It reads the items and samples delivered from an iterator's books
(:class:`~zephon_torch.accounting.Accounting`) and the time the caller
waited from the consumer's pumps.

This module imports nothing from ``runners/``.
"""

from __future__ import annotations

import time
from typing import Any

from zephon_torch.accounting import Accounting

__all__ = ["Throughput"]


class Throughput:
    """The pace of one run, for ``stats()["throughput"]`` and the periodic log line.

    The consumer reports each engine pump (:meth:`pumped`) with the seconds
    it took: that is the time the caller waited for data (the whole work
    under ``runner="inline"``; under the pools, the time the workers were
    behind). Items and samples are read from the books' counters, since the
    run (re)started: a resumed run counts from its resume.

    Args:
        books: The run's :class:`Accounting`.
        interval: Seconds between two :meth:`due` reports (0: never due).
    """

    def __init__(self, books: Accounting, interval: float) -> None:
        self.books = books
        self.interval = float(interval)
        self.started: float | None = None  # the first pump
        self.wait_s = 0.0
        self.pumps = 0
        self._base_outputs = sum(lane.outputs for lane in books.lanes.values())
        self._base_samples = sum(lane.samples_delivered for lane in books.lanes.values())
        self._next_report = float("inf")
        self._last: tuple[float, int, int] | None = None  # (time, outputs, samples)

    def pumped(self, began: float, ended: float) -> None:
        """One pump of the engine ran from ``began`` to ``ended`` (``time.monotonic``)."""
        if self.started is None:
            self.started = began
            self._last = (began, 0, 0)
            if self.interval > 0:
                self._next_report = began + self.interval
        self.wait_s += ended - began
        self.pumps += 1

    def due(self, now: float) -> bool:
        """Whether a periodic report is due at ``now`` (then the next is scheduled)."""
        if now < self._next_report:
            return False
        self._next_report = now + self.interval
        return True

    def report(self, now: float | None = None) -> dict[str, Any]:
        """Items and samples delivered, seconds elapsed and waited, and the rates.

        ``outputs`` counts the items handed to the caller (batches when the
        pipeline ends in ``batch``), ``samples`` the base samples they closed;
        ``wait_s`` the seconds spent producing them while the caller waited;
        ``*_per_s`` the rates over the whole run and, under ``recent``, since
        the previous report.
        """
        now = time.monotonic() if now is None else now
        lanes = self.books.lanes.values()
        outputs = sum(lane.outputs for lane in lanes) - self._base_outputs
        samples = sum(lane.samples_delivered for lane in lanes) - self._base_samples
        elapsed = 0.0 if self.started is None else max(0.0, now - self.started)
        out: dict[str, Any] = {
            "outputs": outputs,
            "samples": samples,
            "elapsed_s": round(elapsed, 6),
            "wait_s": round(self.wait_s, 6),
            "outputs_per_s": _rate(outputs, elapsed),
            "samples_per_s": _rate(samples, elapsed),
        }
        return out

    def recent(self, now: float) -> dict[str, Any]:
        """:meth:`report` plus the rates since the previous ``recent`` call."""
        out = self.report(now)
        then, outputs, samples = self._last or (now, 0, 0)
        span = max(0.0, now - then)
        out["recent_outputs_per_s"] = _rate(out["outputs"] - outputs, span)
        out["recent_samples_per_s"] = _rate(out["samples"] - samples, span)
        self._last = (now, out["outputs"], out["samples"])
        return out


def _rate(count: int, seconds: float) -> float | None:
    return round(count / seconds, 3) if seconds > 0 else None
