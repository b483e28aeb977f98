"""What an iterator reports: ``stats()``, and the warning about skipped samples.

A part of :class:`~zephon_torch.runners.iterator.PipelineIterator`: the
report reads the run's books (``accounting.py``), the source emitter and the
executor's counters, under the iterator's lock.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from zephon_torch.logs import log_skips
from zephon_torch.sources.lane_plan import lane_count

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Callable

    from zephon_torch.accounting import Accounting
    from zephon_torch.pipeline import Pipeline
    from zephon_torch.runners.executor import Executor
    from zephon_torch.throughput import Throughput

__all__ = ["Report"]

#: Bad samples named in the skip warning.
_WARN_EXAMPLES = 5


class Report:
    """``stats()`` and the skip warning of an iterator (see the module doc)."""

    pipeline: Pipeline
    executor: Executor
    accounting: Accounting
    emitter: Any
    lanes: list[int]
    epoch: int
    runner: str
    num_workers: int
    rank: int
    world_size: int
    _pace: Throughput
    _driver_bytes: int
    _reported: bool
    _ended: set[int]
    _exclusive: Callable[[], contextlib.AbstractContextManager[None]]
    _settle_all: Callable[[], None]

    def stats(self) -> dict[str, Any]:
        """What this iterator has read and what became of it.

        ``lanes`` maps each lane to ``read`` (samples of the chunks emitted),
        ``delivered`` (samples closed by what the caller received),
        ``tombstoned`` (``{reason: count}``), ``replayed`` (samples re-read
        from the replayed window after a resume), ``replay_dropped`` (of
        those, the ones the caller had received before the checkpoint,
        dropped again) and ``sample_bytes`` (the storage the samples read
        occupy, see ``Dataset.sample_bytes``: a whole pass adds up to about
        the files' sizes, however often they were read). At the end of a pass,
        per lane, ``read == delivered + sum(tombstoned) + replay_dropped``
        (:func:`zephon_torch.checks.assert_conserved` checks it). The top
        level holds the totals, ``bytes_read`` (what the readers really read
        from storage for this iterator, in all its processes: each decoded
        Parquet row group's compressed columns, per decode; the byte ranges
        read from JSONL files; text files' sizes; so ``bytes_read /
        sample_bytes`` is the read amplification; ``None`` when a stage runs
        on Ray, whose workers are not counted; with ``runner="process"``, a
        worker that dies takes the count of the micro-batch it was running
        with it), ``bad_samples`` (the first few samples skipped by
        ``on_error="skip"``: reason, location, detail), and per stage the
        micro-batches dispatched and sentinels seen or stalled. Counts start
        again at :meth:`load_state_dict`.
        """
        with self._exclusive():  # a consistent report while another thread iterates
            self._settle_all()
            replayed = self.emitter.replayed_by_lane
            report = self.accounting.report(replayed)
            report["bytes_read"] = self._bytes_read()
            report["bad_samples"] = self.accounting.bad_samples()
            report["stages"] = self.executor.counters()
            report["replayed_samples"] = self.emitter.replayed
            report["replayed_by_lane"] = dict(replayed)
            report["throughput"] = self._pace.report()
            report.update(self._describe())
        return report

    def _describe(self) -> dict[str, Any]:
        """What this iterator runs, for ``stats()``: epoch, runner, topology."""
        return {
            "epoch": self.epoch,
            "runner": self.runner,
            "num_workers": self.num_workers,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_lanes": lane_count(self.pipeline.source),
            "owned_lanes": list(self.lanes),
            "outputs": sum(book.outputs for book in self.accounting.lanes.values()),
            "finished": len(self._ended) == len(self.lanes),
        }

    def _bytes_read(self) -> int | None:
        """Bytes read from storage since the run started (None: not knowable here)."""
        return self.executor.bytes_read(self._driver_bytes)

    def _report_skips(self) -> None:
        """One warning for the samples ``on_error="skip"`` turned into tombstones."""
        books = self.accounting
        if self._reported or not books.bad_total:
            return
        self._reported = True
        counts = ", ".join(f"{reason}: {n}" for reason, n in sorted(books.bad_counts.items()))
        first = "; ".join(
            f"{d['where']} ({d['reason']}{': ' + d['detail'] if d['detail'] else ''})"
            for d in books.bad_samples(_WARN_EXAMPLES)
        )
        message = (
            f"zephon_torch: on_error='skip' turned {books.bad_total} bad sample(s) of "
            f"lanes {self.lanes} into tombstones ({counts}); first: {first}. They are counted "
            "in stats()['lanes'][lane]['tombstoned']; fix the data or use on_error='raise' to "
            "stop at the first one"
        )
        log_skips(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
