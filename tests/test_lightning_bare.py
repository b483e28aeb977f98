"""A bare ``zephon_torch.DataLoader`` under a real Lightning ``Trainer``: exact resumes.

Lightning saves and restores a train loader that has ``state_dict``/
``load_state_dict`` itself (the fit loop's ``"combined_loader"`` entry),
while its fetcher holds one batch ahead of the training step. Each test fits
once uninterrupted with a real ``ModelCheckpoint``, then fits a new model,
loader and Trainer from one of its checkpoints (``ckpt_path=``) and compares
the sample ids each ``training_step`` received: the resumed run must see
exactly the uninterrupted run's batches from the checkpoint on, neither one
batch late (the prefetched batch counted) nor restored twice.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from test_lightning import (
    TO_TRAINING,
    IteratorLM,
    TinyLM,
    ValidatingLM,
    _every,
    _ids,
    _pipe,
)

import zephon_torch as zt
from zephon_torch.torch.loader import DataLoader, Position

pytestmark = pytest.mark.timeout(180)


def _loader(pipe: zt.Pipeline | None = None, **kwargs: Any) -> DataLoader:
    return DataLoader(pipe if pipe is not None else _pipe(), to_training=TO_TRAINING, **kwargs)


def _fit(root: Path, model: TinyLM, train: DataLoader, *, val: DataLoader | None = None,
         ckpt_path: Path | None = None, callbacks: list[Callback] | None = None,
         **trainer_kwargs: Any) -> TinyLM:
    torch.manual_seed(0)
    callbacks = list(callbacks or [])
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        **trainer_kwargs,
    )
    with warnings.catch_warnings():
        # Lightning asks for the checkpoint's callbacks when resuming; the tests leave them
        # out. It also suggests more workers for a loader it does not know.
        warnings.filterwarnings("ignore", ".*callbacks used to create the checkpoint.*")
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*dataloader_iter.*")
        try:
            trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
        finally:
            train.close()
            if val is not None:
                val.close()
    return model


def _states_after(pipe: zt.Pipeline, counts: list[int]) -> dict[int, dict[str, Any]]:
    """A loader's ``state_dict()`` after each of ``counts`` batches, iterated by hand."""
    loader = _loader(pipe, in_process=True)
    states = {}
    it = iter(loader)
    for n in range(max(counts) + 1):
        if n in counts:
            states[n] = loader.state_dict()
        if n < max(counts):
            next(it)
    loader.close()
    return states


def _reference(pipe: zt.Pipeline, n: int, epoch: int = 0) -> list[list[tuple[int, ...]]]:
    return [_ids(b.to_training(**TO_TRAINING))
            for b, _ in zip(pipe.iter(runner="inline", epoch=epoch), range(n))]


# --------------------------------------------------------------------------- mid-epoch


@pytest.mark.parametrize("in_process", [True, False], ids=["in_process", "engine"])
def test_a_bare_loader_resumes_exactly_where_the_checkpointed_step_left_off(
        tmp_path: Path, in_process: bool):
    full = _fit(tmp_path, TinyLM(), _loader(in_process=in_process),
                callbacks=[_every(tmp_path, 4)], max_steps=10)
    assert full.seen == _reference(_pipe(), 10)  # fit received the stream from its start

    for k in (4, 8):
        resumed = _fit(tmp_path / f"resume{k}", TinyLM(), _loader(in_process=in_process),
                       ckpt_path=tmp_path / f"step={k}.ckpt", max_steps=10)
        # No skip (the batch Lightning had prefetched), no repeat, no double restore.
        assert resumed.seen == full.seen[k:], k

    # Lightning saved the loader itself, at the position after exactly 4 batches,
    # although its fetcher had already taken a 5th.
    saved = torch.load(tmp_path / "step=4.ckpt", weights_only=False)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == \
        [_states_after(_pipe(), [4])[4]]


def test_state_dict_called_during_fit_is_the_position_after_the_steps_batch(tmp_path: Path):
    loader = _loader(in_process=True)
    recorded: list[dict[str, Any]] = []

    class Record(Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            recorded.append(loader.state_dict())

    _fit(tmp_path, TinyLM(), loader, callbacks=[Record()], max_steps=5)
    expected = _states_after(_pipe(), [1, 2, 3, 4, 5])
    assert recorded == [expected[n] for n in (1, 2, 3, 4, 5)]
    # Outside the fit, the loader answers for the batches it handed over: Lightning's
    # fetcher had taken a 6th before max_steps stopped it.
    assert loader.state_dict() == _states_after(_pipe(), [6])[6]


def test_validation_between_steps_with_a_bare_val_loader_does_not_move_the_train_position(
        tmp_path: Path):
    val = _pipe(passes=1, n=24)
    kwargs = {"max_steps": 10, "val_check_interval": 3, "check_val_every_n_epoch": None,
              "limit_val_batches": 2}
    full = _fit(tmp_path, ValidatingLM(), _loader(in_process=True),
                val=_loader(val, in_process=True), callbacks=[_every(tmp_path, 5)], **kwargs)
    # Sanity check (2 batches) + 3 validation runs, each from the start of the val pipeline.
    assert full.val_seen == _reference(val, 2) * 4
    saved = torch.load(tmp_path / "step=5.ckpt", weights_only=False)
    assert len(saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]) == 1  # train only
    resumed = _fit(tmp_path / "r", ValidatingLM(), _loader(in_process=True),
                   val=_loader(val, in_process=True), ckpt_path=tmp_path / "step=5.ckpt",
                   **kwargs)
    assert resumed.seen == full.seen[5:]


def test_a_training_step_pulling_from_dataloader_iter_resumes_exactly(tmp_path: Path):
    full = _fit(tmp_path, IteratorLM(), _loader(in_process=True),
                callbacks=[_every(tmp_path, 3)], max_steps=7)
    assert full.seen == _reference(_pipe(), 7)
    resumed = _fit(tmp_path / "r", IteratorLM(), _loader(in_process=True),
                   ckpt_path=tmp_path / "step=3.ckpt", max_steps=7)
    assert resumed.seen == full.seen[3:]


def test_a_state_loaded_by_hand_before_fit_survives_lightnings_iterability_check(
        tmp_path: Path):
    first = _loader(in_process=True)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    first.close()
    loader = _loader(in_process=True)
    loader.load_state_dict(state)
    # Lightning calls iter() once to check the loader, then iterates it for real.
    model = _fit(tmp_path, TinyLM(), loader, max_steps=4)
    assert model.seen == _reference(_pipe(), 7)[3:]


# --------------------------------------------------------------------------- epochs


def test_a_checkpoint_at_the_end_of_a_pass_resumes_with_the_next_pass(tmp_path: Path):
    # 96 items in batches of 2: 48 steps a pass, one pass an epoch.
    epochs = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{step}", every_n_epochs=1,
                             save_top_k=-1)
    full = _fit(tmp_path, TinyLM(), _loader(_pipe(passes=1), in_process=True),
                callbacks=[epochs, _every(tmp_path / "steps", 48)], max_epochs=2)
    # Each epoch is the whole pass, in the pipeline's order of that epoch.
    assert full.seen == _reference(_pipe(passes=1), 48) + _reference(_pipe(passes=1), 48, 1)
    fresh = _loader(_pipe(passes=1), epoch=1).state_dict()
    for ckpt in (tmp_path / "epoch=0-step=48.ckpt", tmp_path / "steps" / "step=48.ckpt"):
        saved = torch.load(ckpt, weights_only=False)
        # Lightning's next epoch iterates the loader again, from the start of the next
        # epoch: so does a resume.
        assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [fresh]
        resumed = _fit(tmp_path / "r" / ckpt.stem, TinyLM(),
                       _loader(_pipe(passes=1), in_process=True), ckpt_path=ckpt,
                       max_epochs=2)
        assert resumed.seen == full.seen[48:], ckpt.name


def test_epochs_cut_by_limit_train_batches_restart_the_loader_and_resume_exactly(
        tmp_path: Path):
    epochs = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{step}", every_n_epochs=1,
                             save_top_k=-1)
    kwargs = {"max_epochs": 3, "limit_train_batches": 4}
    full = _fit(tmp_path, TinyLM(), _loader(in_process=True),
                callbacks=[epochs, _every(tmp_path / "steps", 3)], **kwargs)
    # As with torch's DataLoader, every Lightning epoch is a new iteration of the loader,
    # which runs the pipeline's epoch of that number.
    assert full.seen == [b for epoch in range(3) for b in _reference(_pipe(), 4, epoch)]
    for ckpt in (tmp_path / "epoch=0-step=4.ckpt", tmp_path / "steps" / "step=6.ckpt"):
        resumed = _fit(tmp_path / "r" / ckpt.stem, TinyLM(), _loader(in_process=True),
                       ckpt_path=ckpt, **kwargs)
        k = int(ckpt.stem.rsplit("=", 1)[1])
        assert resumed.seen == full.seen[k:], ckpt.name


# --------------------------------------------------------------------------- Lightning's names


class _StateDictWithout(Callback):
    """Calls the loader's ``state_dict()`` during fit, with one of Lightning's names renamed.

    The first call sees the fit loop as it is; the next two see it as a
    Lightning release that renamed ``name`` (of the fit loop, or of its data
    fetcher) would have it. Records every warning of those calls.
    """

    def __init__(self, loader: DataLoader, name: str) -> None:
        self.loader = loader
        self.owner, self.name = name.split(".")
        self.plain: list[warnings.WarningMessage] = []
        self.renamed: list[warnings.WarningMessage] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != 2:
            return
        with warnings.catch_warnings(record=True) as self.plain:
            warnings.simplefilter("always")
            self.loader.state_dict()
        loop = trainer.fit_loop
        owner = loop if self.owner == "fit_loop" else loop._data_fetcher
        value = owner.__dict__.pop(self.name)
        setattr(owner, f"{self.name}_renamed", value)
        try:
            with warnings.catch_warnings(record=True) as self.renamed:
                warnings.simplefilter("always")
                self.loader.state_dict()
                self.loader.state_dict()
        finally:
            delattr(owner, f"{self.name}_renamed")
            setattr(owner, self.name, value)


@pytest.mark.parametrize("name", ["fit_loop._combined_loader", "fit_loop._data_fetcher",
                                  "fetcher.batches", "fetcher.done"])
def test_a_fit_loop_without_the_names_the_loader_reads_warns_once_to_use_the_data_module(
        tmp_path: Path, name: str):
    loader = _loader(in_process=True)
    probe = _StateDictWithout(loader, name)
    _fit(tmp_path, TinyLM(), loader, callbacks=[probe], max_steps=4)
    assert probe.plain == []  # the names of this Lightning release: no warning
    assert len(probe.renamed) == 1, [str(w.message) for w in probe.renamed]  # once per loader
    warning = probe.renamed[0]
    assert issubclass(warning.category, RuntimeWarning)
    message = str(warning.message)
    assert name.split(".")[1] in message
    assert "off by the batch(es) Lightning prefetched" in message
    assert "zephon_torch.lightning.ZephonDataModule" in message


def test_a_lightning_release_outside_the_tested_range_warns_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import lightning

    loader = _loader(in_process=True)
    caught: list[warnings.WarningMessage] = []

    class Record(Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                loader.state_dict()
            caught.extend(seen)

    monkeypatch.setattr(lightning, "__version__", "2.7.0")
    _fit(tmp_path, TinyLM(), loader, callbacks=[Record()], max_steps=3)
    assert [w.category for w in caught] == [RuntimeWarning]  # three calls, one warning
    message = str(caught[0].message)
    assert "lightning 2.7.0" in message and "lightning>=2.2,<2.7" in message
    assert "zephon_torch.lightning.ZephonDataModule" in message


def test_the_lightning_extra_pins_the_range_the_loader_was_tested_with():
    from zephon_torch.lightning import TESTED_LIGHTNING

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml")
                            .read_text(encoding="utf-8"))["project"]
    (low_major, low_minor), (high_major, high_minor) = TESTED_LIGHTNING
    pinned = f"lightning>={low_major}.{low_minor},<{high_major}.{high_minor}"
    assert project["optional-dependencies"]["lightning"] == [pinned]
    major, minor = (int(part) for part in pl.__version__.split(".")[:2])
    assert TESTED_LIGHTNING[0] <= (major, minor) < TESTED_LIGHTNING[1]  # this suite's release


# --------------------------------------------------------------------------- the positions kept


def test_positions_further_back_than_remembered_are_refused_not_guessed():
    position = Position()
    position.reset(None)
    states = [{"after": n} for n in range(1, 21)]
    for state in states:
        position.hand(state)
    assert position.before(0) == states[-1]
    assert position.before(3) == states[-4]
    with pytest.raises(RuntimeError, match="whose positions it remembers"):
        position.before(12)
    with pytest.raises(RuntimeError, match="has handed over only 20"):
        position.before(21)
    assert position.before(20) is None  # the start of the iteration: the beginning


@pytest.mark.parametrize("num_workers", [0, 2])
def test_three_trainer_epochs_of_a_bare_loader_run_three_orders_and_resume_mid_epoch_2(
        tmp_path: Path, num_workers: int):
    # 24 items in batches of 2: 12 steps an epoch; the checkpoint is 5 steps into epoch 2.
    pipe = _pipe(passes=1, n=24)
    full = _fit(tmp_path, TinyLM(), _loader(pipe, num_workers=num_workers),
                callbacks=[_every(tmp_path, 29)], max_epochs=3)
    epochs = [_reference(pipe, 12, e) for e in range(3)]
    assert full.seen == epochs[0] + epochs[1] + epochs[2]
    assert len({str(e) for e in epochs}) == 3
    saved = torch.load(tmp_path / "step=29.ckpt", weights_only=False)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["epoch"] == 2
    resumed = _fit(tmp_path / "r", TinyLM(), _loader(pipe, num_workers=num_workers),
                   ckpt_path=tmp_path / "step=29.ckpt", max_epochs=3)
    assert resumed.seen == full.seen[29:]


def test_lightning_reads_the_epoch_length_from_len_of_a_bare_loader(tmp_path: Path):
    pipe = _pipe(passes=1, n=24)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, max_epochs=1,
                         enable_checkpointing=False)
    trainer.fit(TinyLM(), _loader(pipe, in_process=True))
    assert trainer.num_training_batches == len(_loader(pipe)) == 12


def test_a_fit_loop_class_lightning_renamed_warns_instead_of_a_quietly_shifted_position(
        tmp_path: Path) -> None:
    # A Lightning whose fit loop has another class name: the loader cannot read it,
    # sees Trainer.fit iterating it through public attributes, and says so.
    loader = _loader(in_process=True)
    seen: dict[str, Any] = {}

    class RenameFitLoop(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step != 2:
                return
            seen["right"] = loader.state_dict()  # the fit loop as this release has it
            cls = type(trainer.fit_loop)
            name = cls.__name__
            cls.__name__ = "_FitLoopRenamed"  # as a Lightning release that renamed it
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    seen["renamed"] = loader.state_dict()
            finally:
                cls.__name__ = name
            seen["warnings"] = [w for w in caught if issubclass(w.category, RuntimeWarning)
                                and "ZephonDataModule" in str(w.message)]

    _fit(tmp_path, TinyLM(), loader, callbacks=[RenameFitLoop()], max_steps=4)
    assert "right" in seen
    assert seen["renamed"] != seen["right"]  # the prefetched batch is counted now ...
    assert len(seen["warnings"]) == 1  # ... and the loader says so, once
    assert "is not one this loader can read" in str(seen["warnings"][0].message)
    assert seen["warnings"][0].filename == __file__  # names the caller of state_dict()
