"""``ZephonDataModule``: a Lightning DataModule whose checkpoints carry the data position.

::

    dm = ZephonDataModule(train=train_pipe, val=val_pipe,
                          loader_kwargs={"num_workers": 2,
                                         "to_training": {"return_labels": True}})
    ckpt = ModelCheckpoint(every_n_train_steps=500, save_top_k=-1)
    pl.Trainer(max_steps=10_000, callbacks=[ckpt]).fit(model, datamodule=dm)
    # later, in a new process:
    pl.Trainer(max_steps=10_000).fit(model, datamodule=dm, ckpt_path="...ckpt")

``train_dataloader()`` and ``val_dataloader()`` hand Lightning a
:class:`ZephonStream` over a :class:`zephon_torch.torch.loader.DataLoader`;
the module's ``state_dict()`` is the train pipeline's position and
``load_state_dict()`` makes the next train loader continue from it.

**Saving: the position of the last batch the training step received.**
Lightning's fetcher asks the loader for one batch *ahead* of the training
step (for an iterable without a length it must, to know which batch is the
last), so when ``ModelCheckpoint`` saves at the end of step ``k`` the loader
has already handed over batch ``k + 1``. The stream therefore keeps the
state that came with each batch it handed out, and the module's
``on_before_batch_transfer`` hook, which Lightning calls once per batch, in
order, just before the training step receives it, marks the oldest as
consumed::

    event                               stream handed   step received   state_dict()
    fit starts, fetcher prefetches      b0              -               start
    step 0 (fetcher refills b1)         b0 b1           b0              after b0
    step 1 (fetcher refills b2)         b0 b1 b2        b1              after b1
    ModelCheckpoint, end of step 1      b2 is waiting                   after b1

(With a ``training_step(self, dataloader_iter)`` Lightning does not prefetch
and does not call the hook: every batch handed out counts as received.)

**Restoring: once, into the loader fit iterates.** ``Trainer.fit(ckpt_path=)``
calls the module's ``load_state_dict`` before its fit loop asks for the train
loader. The state goes into a fresh ``DataLoader``, which the next
``train_dataloader()`` returns; the loader applies a loaded state at the
start of its next iteration and then forgets it. Lightning first calls
``iter()`` once just to check that the loader is iterable: a stream's
iterator is lazy, so that probe neither starts an engine process nor uses up
the state; the fetcher's iterator is the one that runs.

**Lightning's own stateful-loader checkpoints do not apply.** Lightning saves
and restores every train loader that has ``state_dict``/``load_state_dict``
(the fit loop's ``"combined_loader"`` entry); that is how a bare
``DataLoader`` passed to ``Trainer.fit`` resumes. A stream has neither
method, so that mechanism sees nothing: the position travels only in the
module's state, saved once and restored once. (The loader inside a stream
is not Lightning's train loader, so it does not adjust its own
``state_dict()`` for Lightning's prefetch either: the stream counts.)

**Epochs.** A Lightning epoch over a stream ends when the pipeline ends
(``passes`` is finite) or after ``limit_train_batches``. In the first case the
next epoch is the pipeline's next epoch (``docs/epochs.md``: a new,
reproducible order; Lightning's ``set_epoch`` reaches the loader through the
stream's ``sampler``) from its beginning; in the second it continues
where the last batch the step received left off (so an endless pretraining
stream is never replayed by "epochs"). A checkpoint records which case it
is in, so a resumed run does the same as the uninterrupted one.

**Distributed.** Under an initialized ``torch.distributed`` group (Lightning's
DDP strategy starts one), each rank's loader takes its own lanes, and
``state_dict()`` all-gathers every rank's position and merges them (a
collective: Lightning saves checkpoints on every rank), so a checkpoint
restarts on any world size up to the pipeline's ``num_lanes``.

**A bare loader under Lightning.** A ``zephon_torch.DataLoader`` passed to
``Trainer.fit`` directly is saved by Lightning itself; :func:`fit_loop_view`
(of ``zephon_torch._lightning_compat``, the one module that knows Lightning's
private fit-loop structure, re-exported here with :data:`TESTED_LIGHTNING`
and :class:`FitView`) tells the loader how Lightning's fit loop stands with
it, so that it answers with the position of the batch the training step
received. Everything the loader and the stream keep of
positions is the loader's :class:`~zephon_torch.torch.loader.Position`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from zephon_torch._extras import missing

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ModuleNotFoundError as exc:  # an extra: say which one
    if (exc.name or "").split(".")[0] != "lightning":
        raise
    raise missing("lightning", "zephon_torch.lightning") from exc

from zephon_torch._lightning_compat import TESTED_LIGHTNING, FitView, fit_loop_view
from zephon_torch.checkpoint import merge_states
from zephon_torch.epochs import state_epoch
from zephon_torch.logs import logger as _logger
from zephon_torch.logs import metrics
from zephon_torch.pipeline import Pipeline
from zephon_torch.topology import resolve_topology
from zephon_torch.torch._loader_dist import gather
from zephon_torch.torch.dataset import pipeline_of
from zephon_torch.torch.loader import DataLoader

__all__ = ["TESTED_LIGHTNING", "FitView", "ZephonDataModule", "ZephonStream", "fit_loop_view"]

STATE_FORMAT = "zephon_torch.ZephonDataModule"
STATE_VERSION = 1
_KEYS = ("format", "version", "train", "pass_ended")


class ZephonStream:
    """What the data module hands Lightning: a lazily started iteration of a loader.

    It deliberately has no ``state_dict``/``load_state_dict``, so Lightning
    does not checkpoint it on its own (see the module doc). ``iter()`` does
    not start the loader; the first ``next()`` does.

    Args:
        loader: The zephon loader to iterate.
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self._generation = 0  # the iteration that is current; older iterators are stale
        self._started = False
        self._current: Any = None  # the loader's iterator of the current generation

    @property
    def started(self) -> bool:
        """Whether an iteration has begun (the loader has consumed any loaded state)."""
        return self._started

    def __iter__(self) -> Iterator[Any]:
        return _LazyIterator(self)

    def __len__(self) -> int:
        """The loader's ``len()``: batches in one epoch, when known without reading the data.

        Lightning reads it as the epoch length (``num_training_batches``, the
        progress bar, ``estimated_stepping_batches`` for LR schedules).

        Raises:
            TypeError: The count depends on the data (Lightning then trains by
                ``max_steps`` or until the pipeline ends); the message says why.
        """
        return len(self.loader)

    def _begin(self) -> tuple[int, Iterator[Any]]:
        """Start a new iteration of the loader; returns its generation and iterator.

        Lightning asks for a new iteration when it is done with the last one,
        which it may leave unfinished (an epoch of known length ends after its
        ``len()`` batches, without asking for more): that one is closed first.
        """
        self._generation += 1
        self._started = True
        previous, self._current = self._current, None
        if previous is not None:
            previous.close()
        self._current = iter(self.loader)
        return self._generation, self._current

    def _handed(self, generation: int) -> None:
        """A batch of iteration ``generation`` is about to be returned to Lightning."""

    def _ended(self, generation: int) -> None:
        """Iteration ``generation`` has no more batches."""

    def close(self) -> None:
        """Stop the loader's iteration in progress (its engine process and workers)."""
        self.loader.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.loader!r})"


class _TrainStream(ZephonStream):
    """A stream that also counts the batches handed out that the step has not received.

    The states are the loader's: its :class:`~zephon_torch.torch.loader.Position`
    remembers the state after each of its last batches, so the position of the
    last batch received is the one before the ``held`` batches still waiting.

    Args:
        loader: The train loader.
        all_received: Whether every batch handed out counts as received (a
            ``training_step(dataloader_iter)`` pulls its batches, and Lightning
            then calls no hook per batch).
    """

    def __init__(self, loader: DataLoader, all_received: Callable[[], bool]) -> None:
        super().__init__(loader)
        self._all_received = all_received
        self._held = 0  # batches handed out, not yet received by the step
        self._exhausted = False

    def _begin(self) -> tuple[int, Iterator[Any]]:
        if self._all_received():
            self._held = 0
        if self.started and self.loader.checkpointable and not self._pass_ended():
            # Lightning ended an epoch before the pipeline ended (limit_train_batches):
            # the next epoch continues after the last batch the step received, so the
            # batch its fetcher had prefetched is not lost.
            self.loader.load_state_dict(self._received())
        generation, iterator = super()._begin()
        self._held = 0
        self._exhausted = False
        return generation, iterator

    def _handed(self, generation: int) -> None:
        if generation == self._generation:
            self._held += 1

    def _ended(self, generation: int) -> None:
        if generation == self._generation:
            self._exhausted = True

    @property
    def sampler(self) -> _StreamEpochs:
        """Where Lightning 2.x calls ``set_epoch`` before each epoch (:class:`_StreamEpochs`)."""
        return _StreamEpochs(self)

    @property
    def batch_sampler(self) -> _StreamBatchSampler:
        """Holds the same ``.sampler`` (Lightning also looks there)."""
        return _StreamBatchSampler(_StreamEpochs(self))

    def received_one(self) -> None:
        """The training step is about to receive the oldest batch handed out."""
        self._held = max(0, self._held - 1)

    def _received(self) -> dict[str, Any]:
        """The state after the last batch the step received (this rank's lanes)."""
        return self.loader._state_before(self._held)

    def position(self) -> tuple[dict[str, Any], bool]:
        """``(state after the last batch received, whether the pass has ended)``."""
        if self._all_received():
            self._held = 0
        # Before the first iteration: the loaded state, or the beginning.
        return self._received(), self.started and self._pass_ended()

    def _pass_ended(self) -> bool:
        """Whether the step has received the last batch of the pass.

        The iteration ran out, and the step received all it handed out; or,
        for an epoch whose length is known, the step has received ``len()``
        batches of it (Lightning then ends the epoch without asking for more,
        so the iteration never runs out).
        """
        if self._exhausted:
            return not self._held
        try:
            length = len(self.loader)
        except TypeError:  # no length: only running out ends the pass
            return False
        state = self._received()
        received = 0 if state is None else sum(
            int(entry.get("outputs", 0)) for entry in state["lanes"].values())
        return received >= length


class _StreamEpochs:
    """The train stream's ``set_epoch``: Lightning's epoch ``n`` runs the pipeline's epoch
    ``n``, except where the stream holds a position to continue (a checkpoint's, loaded
    before the epoch starts): the pipeline's epoch of that position goes on, as in the
    uninterrupted run (where an epoch cut by ``limit_train_batches`` continues in the next).
    """

    __slots__ = ("_stream",)

    def __init__(self, stream: _TrainStream) -> None:
        self._stream = stream

    def set_epoch(self, epoch: int) -> None:
        """Run ``epoch`` next, unless a loaded position continues its own."""
        loader = self._stream.loader
        if loader._loaded is None:
            loader.set_epoch(epoch)

    def __eq__(self, other: object) -> bool:  # Lightning collects samplers in a set
        return isinstance(other, _StreamEpochs) and other._stream is self._stream

    def __hash__(self) -> int:
        return id(self._stream)


class _StreamBatchSampler:
    """``stream.batch_sampler``: only its ``.sampler``, the stream's epochs."""

    __slots__ = ("sampler",)

    def __init__(self, sampler: _StreamEpochs) -> None:
        self.sampler = sampler


class _EvalStream(ZephonStream):
    """A validation/test/predict stream: every run reads epoch 0 from its beginning, so
    every validation run sees the same batches in the same order."""

    def _begin(self) -> tuple[int, Iterator[Any]]:
        self.loader.set_epoch(0)
        return super()._begin()


class _LazyIterator:
    """Starts the stream's loader at the first ``next()``, not at ``iter()``."""

    def __init__(self, stream: ZephonStream) -> None:
        self._stream = stream
        self._generation = 0
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> _LazyIterator:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._generation, self._iterator = self._stream._begin()
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._stream._ended(self._generation)
            raise
        self._stream._handed(self._generation)
        return batch


class ZephonDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` over zephon pipelines, with an exact data position.

    Args:
        train: The training pipeline (ending in ``.batch(n)``).
        val: An optional validation pipeline, read from its beginning (its
            epoch 0) at every validation run.
        loader_kwargs: Keyword arguments of
            :class:`zephon_torch.torch.loader.DataLoader` for the train loader,
            and for the others unless ``eval_loader_kwargs`` is given
            (``num_workers``, ``to_training``, ``in_process``, ``on_uneven``
            ...). ``device`` is optional: Lightning moves each batch to the
            module's device itself (a batch already there stays).
        test: An optional pipeline for ``Trainer.test`` (read like ``val``).
        predict: An optional pipeline for ``Trainer.predict`` (read like ``val``).
        eval_loader_kwargs: Loader arguments for the val, test and predict
            loaders (default: ``loader_kwargs``); e.g. ``{"num_workers": 0}``
            runs a short validation in process, with no workers to start,
            while training uses workers.
        log_stats: Log the train loader's throughput and data wait
            (:func:`zephon_torch.logs.metrics` of its ``stats()``, under
            ``data/``) to the trainer's loggers every ``log_every_n_steps``.

    Every train epoch runs the pipeline's epoch of the same number (a new,
    reproducible order, see ``docs/epochs.md``): Lightning calls
    ``set_epoch`` on the train loader's ``sampler`` before each epoch.

    Subclasses that override ``on_before_batch_transfer`` must call
    ``super().on_before_batch_transfer(batch, dataloader_idx)``: it is how
    the module learns which batch the training step received. A
    LightningModule's own ``on_before_batch_transfer`` still runs (this
    module calls it); Lightning warns that both are overridden.

    Raises:
        TypeError: ``train``/``val`` are not pipelines, or a loader argument
            does not apply (see ``DataLoader``).
        ValueError: A bad loader argument value.
    """

    def __init__(
        self,
        train: Pipeline,
        val: Pipeline | None = None,
        loader_kwargs: Mapping[str, Any] | None = None,
        *,
        test: Pipeline | None = None,
        predict: Pipeline | None = None,
        eval_loader_kwargs: Mapping[str, Any] | None = None,
        log_stats: bool = True,
    ) -> None:
        super().__init__()
        self.loader_kwargs = _check_kwargs(loader_kwargs, "loader_kwargs")
        self.eval_loader_kwargs = (self.loader_kwargs if eval_loader_kwargs is None else
                                   _check_kwargs(eval_loader_kwargs, "eval_loader_kwargs"))
        self.log_stats = bool(log_stats)
        self.train = _check_pipeline(train, "train")
        self.val = None if val is None else _check_pipeline(val, "val")
        self.test = None if test is None else _check_pipeline(test, "test")
        self.predict = None if predict is None else _check_pipeline(predict, "predict")
        # Built now so that a bad argument fails here; the first train_dataloader() uses it.
        self._next_train: DataLoader | None = self._loader(self.train)
        for pipeline in (self.val, self.test, self.predict):
            if pipeline is not None:
                self._loader(pipeline, evaluation=True)
        self._train_stream: _TrainStream | None = None
        self._eval_streams: dict[str, ZephonStream] = {}
        self._logged_step = -1  # the last global step whose stats went to the loggers
        self._torn_down = False  # the last fit ended: its train stream is history
        for name in ("val", "test", "predict"):
            hook = f"{name}_dataloader"
            if getattr(self, name) is None and getattr(type(self), hook) is getattr(
                    ZephonDataModule, hook):
                # Lightning runs a loop when its hook is overridden. Without a pipeline, show
                # it the base hook, as LightningDataModule.from_datasets attaches only the
                # loaders it has: no loop, and no warning about an empty loader.
                setattr(self, hook, getattr(super(), hook))

    # ------------------------------------------------------------------ loaders

    def _loader(self, pipeline: Pipeline, evaluation: bool = False) -> DataLoader:
        return DataLoader(pipeline,
                          **(self.eval_loader_kwargs if evaluation else self.loader_kwargs))

    def train_dataloader(self) -> ZephonStream:
        """A stream over a new train loader (holding a state loaded beforehand, if any)."""
        loader, self._next_train = self._next_train, None
        if loader is None:
            loader = self._loader(self.train)
        if self._train_stream is not None:
            self._train_stream.close()
        self._train_stream = _TrainStream(loader, self._step_takes_iterator)
        self._torn_down = False
        return self._train_stream

    def val_dataloader(self) -> ZephonStream:
        """A stream over the validation pipeline, read from its start at every validation run."""
        return self._eval_stream("val")

    def test_dataloader(self) -> ZephonStream:
        """A stream over the test pipeline, read from its start at every test run."""
        return self._eval_stream("test")

    def predict_dataloader(self) -> ZephonStream:
        """A stream over the predict pipeline, read from its start at every predict run."""
        return self._eval_stream("predict")

    def _eval_stream(self, name: str) -> ZephonStream:
        pipeline = getattr(self, name)
        if pipeline is None:  # a subclass calling it without that pipeline
            raise ValueError(f"this ZephonDataModule has no {name} pipeline: pass {name}=...")
        if name not in self._eval_streams:
            self._eval_streams[name] = _EvalStream(self._loader(pipeline, evaluation=True))
        return self._eval_streams[name]

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Notes that the training step receives its next batch; runs the model's hook too."""
        trainer = self._trainer
        if trainer is not None and trainer.training and self._train_stream is not None:
            self._train_stream.received_one()
            self._log_stats(trainer)
        module = trainer.lightning_module if trainer is not None else None
        if module is not None and is_overridden("on_before_batch_transfer", module):
            batch = module.on_before_batch_transfer(batch, dataloader_idx)
        return batch

    def _log_stats(self, trainer: pl.Trainer) -> None:
        """The train loader's throughput and data wait to the trainer's loggers, every
        ``log_every_n_steps`` (once per step)."""
        step = trainer.global_step
        every = getattr(trainer, "log_every_n_steps", 50) or 50
        if not self.log_stats or step == self._logged_step or step % every or not trainer.loggers:
            return
        self._logged_step = step
        try:
            stats = self._train_stream.loader.stats()  # type: ignore[union-attr]
        except RuntimeError as exc:  # an engine process: its iterator is not here
            self.log_stats = False
            _logger.warning("ZephonDataModule logs no data stats: %s", exc)
            return
        values = metrics(stats)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)

    def teardown(self, stage: str) -> None:
        """Stops the loaders' engine processes when fit (or validate) ends."""
        for stream in (self._train_stream, *self._eval_streams.values()):
            if stream is not None:
                stream.close()
        self._torn_down = True  # state_dict() still reports where that fit stopped

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The train pipeline's position after the last batch the training step received.

        Under an initialized ``torch.distributed`` group this is a collective
        (every rank's position is gathered and merged): call it on every rank,
        as Lightning does when it saves a checkpoint.

        Returns:
            ``{"format", "version", "train": <pipeline state>, "pass_ended": bool}``,
            JSON-able builtins.
        """
        stream = self._train_stream
        if stream is None:
            loader = self._next_train if self._next_train is not None else self._loader(self.train)
            local, ended = loader.state_dict(gather=False), False
        else:
            loader = stream.loader
            local, ended = stream.position()
        state, ended = _gather(loader, local, ended)
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "train": state,
                "pass_ended": ended}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Make the next train loader continue exactly where ``state_dict`` stopped.

        Args:
            state_dict: A :meth:`state_dict` of a module over the same train
                pipeline configuration, saved on any world size.

        Raises:
            ValueError: Not such a state, or one of another pipeline
                configuration.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                "not a ZephonDataModule state: expected the dict ZephonDataModule.state_dict() "
                f"returns (format {STATE_FORMAT!r})"
            )
        if state_dict.get("version") != STATE_VERSION:
            raise ValueError(
                f"unknown ZephonDataModule state version {state_dict.get('version')!r}; this "
                f"zephon_torch reads version {STATE_VERSION}"
            )
        missing = [key for key in _KEYS if key not in state_dict]
        if missing:
            raise ValueError(f"corrupted ZephonDataModule state: no {missing}")
        loader = self._loader(self.train)
        loader.load_state_dict(state_dict["train"])  # validates it against the pipeline
        if state_dict["pass_ended"]:
            # The step had received the last batch of a pass: what comes next is the next
            # epoch from its beginning, as in the uninterrupted run.
            loader = self._loader(self.train)
            loader.set_epoch(state_epoch(state_dict["train"]) + 1)
        stream = self._train_stream
        if stream is not None and not stream.started:
            stream.close()
            stream.loader = loader  # Lightning asked for it already but has not iterated
            return
        if stream is not None and not self._torn_down:
            warnings.warn(
                "ZephonDataModule.load_state_dict() after the train loader started: the state "
                "applies to the next train_dataloader() call, not to the iteration in progress",
                RuntimeWarning, stacklevel=2,
            )
        self._next_train = loader

    def _step_takes_iterator(self) -> bool:
        """Whether ``training_step`` pulls batches itself (``dataloader_iter``), or no trainer."""
        trainer = self._trainer
        module = trainer.lightning_module if trainer is not None else None
        if module is None:
            return True  # used by hand: whatever was handed out was received
        return is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)

    @property
    def _trainer(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)


def _check_kwargs(kwargs: Any, name: str) -> dict[str, Any]:
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(
            f"{name} must be a dict of zephon DataLoader arguments, got {type(kwargs).__name__}"
        )
    return dict(kwargs or {})


def _check_pipeline(pipeline: Any, name: str) -> Pipeline:
    return pipeline_of(f"ZephonDataModule({name}=...)", pipeline)


def _gather(loader: DataLoader, local: dict[str, Any],
            ended: bool) -> tuple[dict[str, Any], bool]:
    """Every rank's position merged, when the loader spans an initialized process group."""
    parts = gather({"state": local, "ended": ended},
                   *resolve_topology(loader.rank, loader.world_size))
    if not parts:  # one process, or an explicit sub-topology whose peers are not the group
        return local, ended
    return merge_states([p["state"] for p in parts]), all(p["ended"] for p in parts)
