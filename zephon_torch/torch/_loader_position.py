"""What a :class:`~zephon_torch.torch.loader.DataLoader` remembers of the batches it handed over.

:class:`Position` is the loader's record of where the caller stands (the
state after the last batch received, the start of the iteration and the
states after its last few batches); :class:`_BatchSampler` is what
``loader.batch_sampler`` answers, a shim that only carries the epoch counter.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from zephon_torch.epochs import EpochCounter

__all__ = ["Position"]


# States kept of the last batches handed over, to answer for a consumer that holds some
# of them unused (Lightning's fetcher holds one).
_REMEMBERED = 8


class _BatchSampler:
    """What ``loader.batch_sampler`` is: batching lives in the pipeline, so it only
    holds the loader's epoch counter as ``.sampler`` (where Lightning 2.x calls
    ``set_epoch``)."""

    __slots__ = ("sampler",)

    def __init__(self, sampler: EpochCounter) -> None:
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        """The counter's ``set_epoch``."""
        self.sampler.set_epoch(epoch)

    def __repr__(self) -> str:
        return f"BatchSampler(sampler={self.sampler!r})"


class Position:
    """The state after the last batch the caller received (shared with the iterator).

    The one record of "the position after the last item handed out" on the
    torch side: the loader's ``state_dict()``, Lightning's fit loop
    (``_lightning_compat.fit_loop_view``) and the ``ZephonDataModule`` stream read
    it; the pipeline wrappers (``dataset.py``, ``node.py``) use the
    iterator's own ``state_dict()``, which is that position already.

    It also remembers where the iteration started and the states after its
    last :data:`_REMEMBERED` batches, so that :meth:`before` can answer for a
    consumer that holds some batches unused. ``None`` stands for the
    beginning of the pipeline.
    """

    __slots__ = ("count", "handed", "start", "state")

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        self.start: dict[str, Any] | None = None
        self.handed: deque[dict[str, Any]] = deque(maxlen=_REMEMBERED)
        self.count = 0  # batches handed over in this iteration

    def reset(self, state: dict[str, Any] | None) -> None:
        """A new iteration starts at ``state``."""
        self.state = self.start = state
        self.handed.clear()
        self.count = 0

    def hand(self, state: dict[str, Any]) -> None:
        """A batch is handed over; ``state`` is the iterator's right after it."""
        self.state = state
        self.handed.append(state)
        self.count += 1

    def before(self, held: int) -> dict[str, Any] | None:
        """The state before the last ``held`` batches handed over (0: the current one).

        Raises:
            RuntimeError: ``held`` batches go back past this iteration's
                start, or further than the states remembered.
        """
        if held == 0:
            return self.state
        if held > self.count:
            raise RuntimeError(
                f"Lightning holds {held} batches of this zephon DataLoader, but its current "
                f"iteration has handed over only {self.count}: the position before them is "
                "not known (is the loader iterated twice at once, or cycled with others?)"
            )
        if held == self.count:
            return self.start
        if held >= len(self.handed):
            raise RuntimeError(
                f"Lightning holds {held} batches of this zephon DataLoader, more than the "
                f"{_REMEMBERED - 1} whose positions it remembers: cannot save the position "
                "of the last batch the training step received"
            )
        return self.handed[-1 - held]
