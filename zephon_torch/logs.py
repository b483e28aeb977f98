"""The package's logger: start-up, resumes, skips, throughput and the end of a pass.

Everything is logged under ``logging.getLogger("zephon_torch")``, which has
only a ``NullHandler`` (quiet by default, as a library should be). Turn it
on like any Python logger::

    import logging
    logging.basicConfig(level=logging.INFO)                     # everything, or
    logging.getLogger("zephon_torch").setLevel(logging.INFO)    # just this package

What is logged, per iterator:

* INFO at start: the pipeline, the runner and its workers, rank and world
  size, the lanes, the epoch; at a resume: the epoch and what is replayed;
* WARNING for the samples ``on_error="skip"`` turned into tombstones (the
  same text as the ``RuntimeWarning``, which stays);
* INFO every :data:`THROUGHPUT_INTERVAL` seconds while iterating: items and
  samples delivered, their rates (overall and since the last line), and the
  seconds the caller waited for data;
* INFO at the end of a pass: the totals; DEBUG: the per-stage counters.

Nothing here is formatted unless the logger is enabled for the level, so a
quiet logger costs one check per event.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zephon_torch.runners.iterator import PipelineIterator

__all__ = ["THROUGHPUT_INTERVAL", "logger", "metrics"]

#: The package's logger (``NullHandler`` only; see the module doc).
logger = logging.getLogger("zephon_torch")

#: Seconds between two throughput lines of an iterator (0: none). Read when an
#: iterator starts.
THROUGHPUT_INTERVAL = 30.0


def log_start(it: PipelineIterator) -> None:
    """One INFO line: what this iterator runs, where, and in which epoch."""
    if not logger.isEnabledFor(logging.INFO):
        return
    src = it.pipeline.source
    logger.info(
        "iterating %r: runner=%s, num_workers=%d, rank %d of %d, lanes %s of "
        "%d, epoch %d, deterministic=%s; stages %s",
        it.pipeline, it.runner, it.num_workers, it.rank, it.world_size, list(it.lanes),
        src.num_lanes, it.epoch, it.deterministic, it.stage_names,
    )


def log_resume(it: PipelineIterator, replay_chunks: int) -> None:
    """One INFO line: a state was loaded."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("resumed %r in epoch %d on lanes %s; %d chunk(s) to replay",
                    it.pipeline, it.epoch, list(it.lanes), replay_chunks)


def log_skips(message: str) -> None:
    """The skip warning's text, as a WARNING record."""
    logger.warning("%s", message)


def log_throughput(it: PipelineIterator, report: dict[str, Any]) -> None:
    """The periodic INFO line (``report``: ``Throughput.recent``)."""
    logger.info(
        "lanes %s epoch %d: %d item(s), %d sample(s) in %.1f s (%s items/s, "
        "%s samples/s; recently %s items/s); waited %.1f s for data",
        list(it.lanes), it.epoch, report["outputs"], report["samples"], report["elapsed_s"],
        _num(report["outputs_per_s"]), _num(report["samples_per_s"]),
        _num(report["recent_outputs_per_s"]), report["wait_s"],
    )


def log_end(it: PipelineIterator, stats: dict[str, Any]) -> None:
    """At the end of a pass: INFO totals, DEBUG per-stage counters."""
    if logger.isEnabledFor(logging.INFO):
        pace = stats["throughput"]
        logger.info(
            "lanes %s epoch %d ended: %d item(s), %d sample(s) delivered, "
            "%d tombstoned, %d read, in %.1f s (waited %.1f s)",
            list(it.lanes), it.epoch, pace["outputs"], stats["delivered"],
            stats["tombstoned"], stats["read"], pace["elapsed_s"], pace["wait_s"],
        )
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("lanes %s stages %s", list(it.lanes), stats["stages"])


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def metrics(stats: dict[str, Any], prefix: str = "data/") -> dict[str, float]:
    """Flat numbers from ``stats()`` for a metrics logger (Lightning's ``log_dict``).

    ``epoch``, ``outputs``, ``samples``, ``tombstoned``, ``outputs_per_s``,
    ``samples_per_s``, ``wait_s`` and ``wait_fraction`` (the share of the
    elapsed time the caller waited for data), each under ``prefix``; a rate
    not known yet (nothing elapsed) is left out.
    """
    pace = stats["throughput"]
    out: dict[str, float] = {
        "epoch": float(stats["epoch"]),
        "outputs": float(pace["outputs"]),
        "samples": float(pace["samples"]),
        "tombstoned": float(stats["tombstoned"]),
        "wait_s": float(pace["wait_s"]),
    }
    for key in ("outputs_per_s", "samples_per_s"):
        if pace[key] is not None:
            out[key] = float(pace[key])
    if pace["elapsed_s"] > 0:
        out["wait_fraction"] = min(1.0, pace["wait_s"] / pace["elapsed_s"])
    return {prefix + key: value for key, value in out.items()}
