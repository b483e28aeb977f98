"""Checks an engineer can run on a live iterator: conservation of samples.

zephon_torch promises that nothing is lost and nothing is duplicated: every
sample an iterator reads ends up in exactly one of three places::

    read  =  delivered            (closed by a record or batch the caller received)
          +  tombstoned[reason]   (filtered, empty, or a bad sample skipped with
                                   on_error="skip")
          +  replay_dropped       (after a resume: re-read from the replayed window,
                                   but the caller had received it before the checkpoint)

:func:`assert_conserved` checks that identity, per lane, on an iterator
whose pass has ended. ``Pipeline.iter(verify=True)`` runs it by itself at
the end of the pass and also checks every sample individually (no sample
closed twice, none that was never read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zephon_torch.runners.iterator import PipelineIterator

__all__ = ["ConservationError", "assert_conserved"]


class ConservationError(AssertionError):
    """Samples were lost or counted twice: a bug to report, with the message."""


def assert_conserved(iterator: PipelineIterator) -> dict[str, Any]:
    """Assert that the iterator's finished pass accounted for every sample read.

    Args:
        iterator: A :class:`~zephon_torch.runners.iterator.PipelineIterator`
            that has run to its end (``StopIteration``). A partial pass is
            not conserved yet: samples are in flight.

    Returns:
        The iterator's :meth:`stats`, for further checks.

    Raises:
        ConservationError: A lane's counts do not add up (or, with
            ``verify=True``, a sample was closed twice or never read), naming
            the lane and the counts.
        ValueError: The iterator has not reached its end.
    """
    if not getattr(iterator, "_closed", False) or len(iterator._ended) != len(iterator.lanes):
        raise ValueError("assert_conserved needs an iterator whose pass has ended "
                         "(iterate until StopIteration first); samples of an unfinished "
                         "pass are still in flight")
    stats = iterator.stats()
    problems = []
    for lane, counts in stats["lanes"].items():
        tombstoned = sum(counts["tombstoned"].values())
        accounted = counts["delivered"] + tombstoned + counts["replay_dropped"]
        if counts["read"] != accounted:
            diff = counts["read"] - accounted
            what = (f"{diff} sample(s) lost (neither delivered nor tombstoned)" if diff > 0
                    else f"{-diff} sample(s) counted twice")
            problems.append(
                f"lane {lane}: read {counts['read']} samples but accounted for {accounted} "
                f"(delivered {counts['delivered']}, tombstoned {counts['tombstoned']}, "
                f"replay_dropped {counts['replay_dropped']}): {what}"
            )
    book = iterator.accounting.samples  # every closed sample, with verify=True
    if book is not None:
        duplicates, strays = book.duplicates, book.strays
        if duplicates:
            problems.append(f"{len(duplicates)} sample(s) closed twice, first (lane, chunk, "
                            f"offset) {duplicates[:5]}")
        if strays:
            problems.append(f"{len(strays)} sample(s) closed that no chunk of this pass read, "
                            f"first (lane, chunk, offset) {strays[:5]}")
        expected = sum(book.chunks.values())
        if not duplicates and not strays and len(book.closed) != expected:
            problems.append(f"{expected} samples read but {len(book.closed)} distinct ones "
                            "closed")
    if problems:
        raise ConservationError(
            "zephon_torch: samples not conserved in this pass: " + "; ".join(problems)
            + ". Bad data cannot cause this: a user operator that drops records without "
            "turning them into tombstones (zephon_torch.ops.base.tombstone) or emits a "
            "record twice can; otherwise please report it with repr(pipe) and this message"
        )
    return stats
