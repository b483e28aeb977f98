"""What a mixture's weights promise, checked before the first sample is read.

The work schedule (``schedule.py``) deals positions of the stream to the
datasets by smooth weighted round-robin: after ``n`` positions, dataset ``c``
has served about ``n * w_c`` samples (``w`` normalised to sum to 1). Three
things follow from the weights, the datasets' sizes and their passes, and
are checked here, once, from what the schedule already knows:

**Weights are finite numbers >= 0.** ``inf`` would take every position
(``inf / inf`` is not a share), ``nan`` none; both, and negatives, are
refused naming the dataset, and so are weights whose sum overflows to
``inf`` (``[1e308, 1e308]``: every share would read as 0).

**A share needs samples.** A dataset given a positive weight but holding no
sample (an all-blank JSONL, files all skipped) can never serve its share;
the other datasets would take it without a word (a 50/50 mixture becoming
100/0). That is an error in every ``exhausted`` mode: ``"stop"`` would end
(or skew) the stream at once, and ``"repeat"`` cannot repeat nothing.
Weight 0 leaves a dataset out on purpose (it is never read, and its passes
do not count); ``weights=None`` gives an empty dataset its size, 0.

**The length of the stream.** Let ``L_c`` be what dataset ``c``'s passes
hold (passes times samples). Dataset ``c`` has done its passes after about
``L_c / w_c`` positions, so the stream ends after about

* ``max_c L_c / w_c`` positions with ``exhausted="repeat"`` (every dataset
  finishes its passes; the others repeat meanwhile), and
* ``min_c L_c / w_c`` with ``exhausted="stop"`` (the first to run out ends
  it), which never exceeds the samples of all passes.

(Within about ``1 / w_c`` positions: the round-robin keeps each count within
a sample of ``n * w_c``.) A tiny positive weight is not weight 0: the
dataset must still be read in full, so ``[1, 1e-6]`` over two 20-sample
datasets is about 20 million positions, the first dataset read a million
times over. When ``"repeat"`` makes some dataset be read more than
:data:`REPEAT_WARNING` times what its passes ask, :func:`length_warning`
says so (the iterator and ``num_batches`` warn before the first item); a
stream longer than :data:`MAX_POSITIONS` (2**53, where float arithmetic can
no longer count positions exactly, and centuries of reading) is refused.

Example: weights 0.9/0.1 over two datasets of 20 samples, one pass each:
the second finishes after about ``20 / 0.1 = 200`` positions, the first has
then been read ``200 * 0.9 / 20 = 9`` times (no warning); at 0.99/0.01 it is
about 2,000 positions and 99 readings (a warning).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from zephon_torch.sources.base import Dataset

__all__ = ["MAX_POSITIONS", "REPEAT_WARNING", "check_shares", "check_weights", "files_of",
           "length_warning", "stream_length"]

#: ``exhausted="repeat"`` warns when a dataset would be read more than this many
#: times what its passes ask.
REPEAT_WARNING = 10
#: Longest stream a mixture may describe (positions): refused beyond it.
MAX_POSITIONS = 2**53


def _who(dataset: Dataset) -> str:
    return f"dataset {dataset.name!r} (component {dataset.component_id})"


def check_weights(datasets: Sequence[Dataset], weights: Sequence[Any]) -> None:
    """Refuse weights that are not finite numbers >= 0 summing to more than 0.

    Raises:
        ValueError: Naming the first bad weight's dataset and value, and what
            to give instead.
    """
    shown = list(weights)
    for dataset, w in zip(datasets, weights):
        if (not isinstance(w, numbers.Real) or isinstance(w, bool)
                or not math.isfinite(w) or w < 0):
            raise ValueError(
                f"weights must be nonnegative finite numbers with a positive sum, got "
                f"{shown}: {_who(dataset)} has weight {w!r}; give each component its share "
                "as a finite number (they need not add up to 1), 0 to leave a dataset out, "
                "or weights=None for shares proportional to the sizes"
            )
    total = sum(weights)
    if total > 0 and not math.isfinite(total):
        raise ValueError(
            f"weights must be nonnegative finite numbers with a finite sum, got {shown}, "
            "whose sum is inf (too large to add up in floating point, so every share would "
            "read as 0); scale them down: only their ratios matter"
        )
    if not total > 0:
        raise ValueError(
            f"weights must be nonnegative and sum to a positive number, got {shown}; give "
            "each component its share (they need not add up to 1), or weights=None for "
            "shares proportional to the sizes"
        )


def files_of(dataset: Dataset, limit: int = 4) -> str:
    """The dataset's files for a message: the first ``limit`` paths (or shard names)."""
    shards = dataset.shards()
    names = [s.path or f"{s.name} (in memory)" for s in shards]
    if not names:
        return "no files"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def check_shares(datasets: Sequence[Dataset], weights: Sequence[float],
                 sizes: Sequence[int]) -> None:
    """Refuse a positive weight on a dataset with no samples (see the module doc).

    Raises:
        ValueError: Naming the dataset, its weight and its files.
    """
    for dataset, w, n in zip(datasets, weights, sizes):
        if w > 0 and n == 0:
            raise ValueError(
                f"{_who(dataset)} has weight {w:.6g} in the mixture but holds no samples "
                f"(files: {files_of(dataset)}): its share could never be served and the other "
                "datasets would silently take it; remove the dataset, give it weight 0, or "
                "fix its files (blank lines are not samples)"
            )


def stream_length(weights: Sequence[float], limits: Sequence[float], exhausted: str) -> float:
    """About how many positions the stream holds (``inf``: endless).

    Args:
        weights: Normalised weights (0 for a dataset left out).
        limits: What each dataset's passes hold (``inf``: endless passes).
        exhausted: ``"repeat"`` or ``"stop"``.
    """
    ends = [limit / w for w, limit in zip(weights, limits) if w > 0]
    if not ends:
        return 0.0
    if len(ends) == 1:
        return next(limit for w, limit in zip(weights, limits) if w > 0)
    return max(ends) if exhausted == "repeat" else min(ends)


def _short(dataset: Dataset) -> str:
    return f"{dataset.name!r} (component {dataset.component_id})"


def _count(value: float) -> str:
    return f"{value:,.0f}" if value < 1e15 else f"{value:.3g}"


def length_warning(datasets: Sequence[Dataset], weights: Sequence[float],
                   limits: Sequence[float], exhausted: str) -> str | None:
    """The warning for a ``"repeat"`` mixture far longer than its data, or None.

    Raises:
        ValueError: The stream would exceed :data:`MAX_POSITIONS` positions.
    """
    active = [(d, w, limit) for d, w, limit in zip(datasets, weights, limits) if w > 0]
    if len(active) < 2 or exhausted != "repeat" or any(math.isinf(x) for _, _, x in active):
        return None
    total = stream_length(weights, limits, exhausted)
    reads = [(total * w / limit, d) for d, w, limit in active]
    times, most = max(reads, key=lambda r: r[0])
    if times <= REPEAT_WARNING:
        return None
    last = _short(max(active, key=lambda a: a[2] / a[1])[0])  # the one that ends it
    shares = ", ".join(f"{_short(d)} {w:.3g}" for d, w, _ in active)
    held = sum(limit for _, _, limit in active)
    stop = stream_length(weights, limits, "stop")
    advice = (f"to bound it: exhausted='stop' (the stream ends when the first dataset runs "
              f"out, about {_count(stop)} samples), a larger weight for {last}, weight 0 to "
              "leave a dataset out (a tiny weight still has to be read in full), or "
              "passes=None and stop the loop at the step you want")
    if not total < MAX_POSITIONS:
        raise ValueError(
            f"mixture weights {shares} with exhausted='repeat' make a stream of more than "
            f"2**53 samples{'' if math.isinf(total) else f' (about {_count(total)})'}, which "
            "would never end: it ends only when "
            f"{last} has finished its passes; {advice}"
        )
    return (
        f"zephon_torch: mixture weights {shares} with exhausted='repeat' make a stream of "
        f"about {_count(total)} samples for the {_count(held)} samples the datasets' passes "
        f"hold: the stream ends only when every dataset has finished its passes, and {last} "
        f"at its weight needs that long, while {_short(most)} is read about {_count(times)} "
        f"times what its passes ask (more than {REPEAT_WARNING}); {advice}"
    )
