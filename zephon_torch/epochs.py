"""Epochs: a new, reproducible order for every trip over a finite pipeline.

A training loop that iterates a finite pipeline several times (torch's
``for epoch in range(3): for batch in loader``, Lightning's ``max_epochs``)
expects a new order each time, the same one on every run, as torch's
samplers (``set_epoch``) and Hugging Face's ``IterableDataset.set_epoch``
give. ``pipe.iter(epoch=n)`` runs epoch ``n``: everything seeded is derived
from the seed and the epoch, so epoch ``n`` is a pure function of the
configuration and ``n``:

* the source's orders (``shuffle=True``): each pass's shard order, the
  order of each shard's read blocks and of the samples of each block
  (the schedule runs with :func:`epoch_seed` of the pipeline's seed);
* every ``.shuffle()`` (its salts start from :func:`epoch_seed` of its own
  seed);
* ``ctx.seed`` as operators see it in ``setup``/``accumulator`` (a user
  operator drawing its randomness from ``ctx.seed`` varies per epoch too).

Epoch 0 is the pipeline as it always ran (``epoch_seed(seed, 0) == seed``),
so outputs and states saved before epochs existed are unchanged. Nothing
unseeded changes: a pipeline without ``shuffle=True`` sources and without
``.shuffle()`` gives the same order in every epoch, as torch's
``DataLoader(shuffle=False)`` does. Chunking, packing, mixture proportions
and batching are the same functions of the (reordered) data in every epoch.

**Epochs and passes.** ``passes=N`` makes one epoch N trips over each
dataset, each pass in its own order; epoch ``n`` reshuffles all of them
(pass ``p`` of epoch ``n`` is keyed by ``(epoch_seed(seed, n), dataset, p)``).
So ``passes=3`` is one long stream (packing, shuffle buffers and batches run
on across the pass boundaries; one ``len``), while three epochs of
``passes=1`` are three separate runs (each ends with its own partial batch;
the training loop sees epoch boundaries).

**States.** A state records its epoch (``state["epoch"]``; states saved
before epochs existed are epoch 0). ``iter()`` without ``epoch=`` takes the
epoch of the state it loads; ``iter(epoch=m)`` refuses a state of another
epoch (:func:`check_state_epoch`).

:class:`EpochCounter` is the small object with ``set_epoch`` that torch and
Lightning call (Lightning 2.x on ``loader.sampler`` and
``loader.batch_sampler.sampler``); it imports nothing of torch.

Not to be confused with a *lane's* epochs in ``checkpoint.py`` and
``lane_progress.py``: the ``flush_every_k_chunks`` chunks between two flush
sentinels of a lane, the unit a resume replays.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from zephon_torch.sources.lane_plan import epoch_lane_changes
from zephon_torch.sources.permute import seed_key
from zephon_torch.sources.shard_growth import growth_of, with_growth
from zephon_torch.sources.weight_plan import epoch_weights

if TYPE_CHECKING:
    from zephon_torch.pipeline import Pipeline

__all__ = [
    "MAX_EPOCH",
    "EpochCounter",
    "check_epoch",
    "check_state_epoch",
    "epoch_pipeline",
    "epoch_seed",
    "state_epoch",
    "state_finished",
]

#: Folded into the seed of every epoch but 0 ("epoch" in ASCII), so that an
#: epoch's seed never coincides with a plain seed's fold of other numbers.
_EPOCH_DOMAIN = 0x65706F6368


#: The last epoch (int64's largest): an epoch's seed folds it into 64 bits, so
#: epochs 2**64 apart would share an order.
MAX_EPOCH = 2**63 - 1


_TOO_LATE = ("an epoch's seed holds 64 bits, so a later epoch would repeat the order of an "
             "earlier one")


def check_epoch(epoch: Any, name: str = "epoch") -> int:
    """``epoch`` as an int, or a ValueError: epochs count from 0 up to :data:`MAX_EPOCH`."""
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError(
            f"{name} must be an integer >= 0 (the first epoch is 0), got {epoch!r}"
        )
    if epoch > MAX_EPOCH:
        raise ValueError(f"{name} must be at most {MAX_EPOCH}, got {epoch!r}: {_TOO_LATE}")
    return int(epoch)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed a run of ``epoch`` uses in place of ``seed``.

    Epoch 0 keeps ``seed`` itself (the pipeline's output as before epochs
    existed); every other epoch folds ``seed`` and ``epoch`` into a 64-bit
    key, so each epoch of each seed has its own order.
    """
    epoch = check_epoch(epoch)
    if epoch == 0:
        return seed
    return seed_key(_EPOCH_DOMAIN, seed, epoch)


def epoch_pipeline(pipeline: Pipeline, epoch: int) -> Pipeline:
    """The pipeline that runs in ``epoch``: the seeds derived for it (see the module doc),
    mixture weights changed in an earlier epoch in force from its start
    (``sources/weight_plan.py``), and shards appended in an earlier epoch read from
    its first pass (``sources/shard_growth.py``), and lanes grown in an earlier
    epoch dealt from its first chunk (``sources/lane_plan.py``).

    Only for running: its fingerprint differs from ``pipeline``'s (the seed
    does), and states carry the original's fingerprint and the epoch. Epoch 0
    returns ``pipeline`` itself (unless its weights changed in a later epoch).
    """
    epoch = check_epoch(epoch)
    # Mixture weights changed on a resume: those of earlier epochs from the start.
    weights = epoch_weights(pipeline.source.weights, epoch)
    # Shards appended in an earlier epoch (sources/shard_growth.py): read from its first pass.
    datasets = tuple(with_growth(d, [g for g in growth_of(d) if g.epoch >= epoch])
                     for d in pipeline.source.datasets)
    # Lanes grown on a resume (sources/lane_plan.py): those of earlier epochs from the start.
    held = getattr(pipeline.source, "lane_changes", ())
    lanes = epoch_lane_changes(held, epoch) if held else held
    if epoch == 0 and weights is pipeline.source.weights and lanes == held:
        return pipeline
    changed: dict[str, Any] = {"seed": epoch_seed(pipeline.source.seed, epoch)} if epoch else {}
    if weights is not pipeline.source.weights:
        changed["weights"] = weights
    if datasets != pipeline.source.datasets:
        changed["datasets"] = datasets
    if lanes != held:
        changed["lane_changes"] = lanes
    source = pipeline.with_source(**changed).source
    # The pipeline's own class: this module sits below the builder and never imports it.
    return type(pipeline)(source, tuple(op.for_epoch(epoch) for op in pipeline.ops))


def state_epoch(state: Mapping[str, Any]) -> int:
    """The epoch a state was saved in (0 for states saved before epochs existed).

    Raises:
        ValueError: The state's ``"epoch"`` is not an integer in ``[0, MAX_EPOCH]``.
    """
    value = state.get("epoch", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"corrupted state: 'epoch' must be an integer >= 0, got {value!r}; nothing was "
            "loaded"
        )
    if value > MAX_EPOCH:
        raise ValueError(f"corrupted state: 'epoch' is {value!r}, outside the allowed range "
                         f"[0, {MAX_EPOCH}] ({_TOO_LATE}); nothing was loaded")
    return value


def check_state_epoch(state: Mapping[str, Any], epoch: int | None) -> int:
    """The epoch a state resumes in; ``epoch`` is the one the iterator was asked for.

    ``epoch=None`` (not asked for) takes the state's. An explicit epoch must
    be the state's: resuming a position of epoch 3 in the order of epoch 1
    would land on other samples.

    Raises:
        ValueError: The state is of another epoch than ``epoch``.
    """
    saved = state_epoch(state)
    if epoch is not None and epoch != saved:
        raise ValueError(
            f"the state was saved in epoch {saved}, but this iterator runs epoch {epoch}: a "
            f"position of one epoch means other samples in another epoch's order. Resume "
            f"with pipe.iter(epoch={saved}) (or leave epoch= out: the state's epoch is used), "
            f"or start epoch {epoch} afresh without the state"
        )
    return saved


def state_finished(state: Mapping[str, Any]) -> bool:
    """Whether every lane of ``state`` had ended: nothing is left to deliver in its epoch.

    A loader that loads such a state goes on with the next epoch instead of
    resuming an empty one. A state taken after the last item but before the
    iterator noticed the end (before ``StopIteration``) is not finished; its
    resume yields nothing more.
    """
    lanes = state.get("lanes")
    if not isinstance(lanes, Mapping) or not lanes:
        return False
    return all(isinstance(entry, Mapping) and entry.get("next") is None
               and not entry.get("window") for entry in lanes.values())


class EpochCounter:
    """The epoch of a loader: ``set_epoch(n)`` where torch and Lightning look for it.

    Each iteration of the loader asks :meth:`start` for its epoch; the next
    one then runs the following epoch unless :meth:`set_epoch` says
    otherwise. So plain re-iteration walks through epochs 0, 1, 2 ..., and
    Lightning, which calls ``set_epoch(current_epoch)`` before each epoch
    (on ``loader.sampler`` and ``loader.batch_sampler.sampler``: attach the
    same counter to both), gets exactly its own numbering, after a restore
    too. Thread-safe; no torch.

    Args:
        epoch: The epoch of the first iteration.
    """

    def __init__(self, epoch: int = 0) -> None:
        self._next = check_epoch(epoch)
        self._current: int | None = None
        self._lock = threading.Lock()

    def set_epoch(self, epoch: int) -> None:
        """Run ``epoch`` at the next iteration (torch's and Lightning's hook)."""
        epoch = check_epoch(epoch)
        with self._lock:
            self._next = epoch

    @property
    def epoch(self) -> int:
        """The epoch of the iteration in progress (before any: the next one's)."""
        with self._lock:
            return self._next if self._current is None else self._current

    @property
    def next_epoch(self) -> int:
        """The epoch the next :meth:`start` returns."""
        with self._lock:
            return self._next

    def start(self) -> int:
        """The epoch of an iteration that starts now; the next one runs the one after."""
        with self._lock:
            self._current = self._next
            self._next += 1
            return self._current

    def resume(self, state: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """A pipeline state was loaded: the next iteration runs its epoch, or the next one.

        Returns the state to resume at the next iteration, or None when every
        lane of it had ended (:func:`state_finished`): its epoch is over, and
        the next iteration starts the following epoch afresh.
        """
        saved = state_epoch(state)
        if state_finished(state):
            self.set_epoch(saved + 1)
            return None
        self.set_epoch(saved)
        return state

    def begin(self, pending: Mapping[str, Any] | None = None) -> int:
        """:meth:`start` an iteration that resumes ``pending`` (a :meth:`resume` result).

        Raises:
            ValueError: ``set_epoch`` chose another epoch than the pending
                state's since it was loaded (the message of
                :func:`check_state_epoch`): resuming it there would land on
                other samples.
        """
        epoch = self.start()
        if pending is not None:
            check_state_epoch(pending, epoch)
        return epoch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": next epoch}``, for a loader state without a pipeline position."""
        return {"epoch": self.next_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (a pipeline state: see :meth:`resume`)."""
        if "lanes" in state:
            self.resume(state)
        else:
            self.set_epoch(state_epoch(state))

    def __repr__(self) -> str:
        return f"EpochCounter(epoch={self.epoch}, next={self.next_epoch})"
