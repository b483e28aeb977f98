"""``ZephonDataModule`` under a real Lightning ``Trainer``: checkpoints carry the exact position.

Every resume test fits once uninterrupted with a real ``ModelCheckpoint``,
then fits a new model, data module and Trainer from one of its checkpoints
(``ckpt_path=``) and compares the sample ids each ``training_step``
received: the resumed run must see exactly the uninterrupted run's batches
from the checkpoint on. The main test runs the loader's engine process; the
variants run the pipeline in process (``in_process=True``), which takes the
same save/restore path at a fraction of the start-up cost.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import zephon_torch as zt
from zephon_torch.lightning import ZephonDataModule, ZephonStream
from zephon_torch.torch.loader import DataLoader

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
TO_TRAINING = {"return_labels": True}

pytestmark = pytest.mark.timeout(120)


def _pipe(passes: int | None = None, n: int = 96, seed: int = 1) -> zt.Pipeline:
    items = [{"input_ids": np.arange(i % 50, i % 50 + 9, dtype=np.int32)} for i in range(n)]
    return (zt.Pipeline.from_items(items, num_lanes=4, chunk_size=4, passes=passes)
            .shuffle(8, seed=seed).batch(2))


def _ids(batch: dict[str, Any]) -> list[tuple[int, ...]]:
    return [tuple(i) for i in batch["ids"]]


class TinyLM(pl.LightningModule):
    """An embedding and a linear head over ``to_training`` batches; records what it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)
        self.head = torch.nn.Linear(8, 64)
        self.seen: list[list[tuple[int, ...]]] = []
        self.val_seen: list[list[tuple[int, ...]]] = []

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        logits = self.head(self.embed(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.append(_ids(batch))
        return self._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ValidatingLM(TinyLM):
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.val_seen.append(_ids(batch))


class IteratorLM(TinyLM):
    """Pulls its batch itself (Lightning's ``dataloader_iter`` flavour: no prefetching)."""

    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        batch = next(dataloader_iter)
        batch = batch[0] if isinstance(batch, tuple) else batch
        return super().training_step(batch, 0)


class HookedLM(TinyLM):
    """Overrides ``on_before_batch_transfer``: it must still run under the data module."""

    def __init__(self) -> None:
        super().__init__()
        self.hooked = 0

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.hooked += 1
        return batch


def _fit(root: Path, model: TinyLM, dm: ZephonDataModule, *, ckpt_path: Path | None = None,
         checkpoint: ModelCheckpoint | None = None, **trainer_kwargs: Any) -> TinyLM:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
        callbacks=[checkpoint] if checkpoint is not None else [],
        enable_checkpointing=checkpoint is not None, **trainer_kwargs,
    )
    with warnings.catch_warnings():
        # Lightning asks for the checkpoint's callbacks when resuming; the tests leave them out.
        warnings.filterwarnings("ignore", ".*callbacks used to create the checkpoint.*")
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model


def _dm(*, passes: int | None = None, val: zt.Pipeline | None = None,
        **loader_kwargs: Any) -> ZephonDataModule:
    return ZephonDataModule(train=_pipe(passes), val=val,
                            loader_kwargs={"to_training": TO_TRAINING, **loader_kwargs})


def _every(root: Path, steps: int) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=steps,
                           save_top_k=-1)


# --------------------------------------------------------------------------- real Trainer


def test_resumed_fit_sees_the_uninterrupted_batches_from_the_checkpoint_on(tmp_path: Path):
    full = _fit(tmp_path, TinyLM(), _dm(), checkpoint=_every(tmp_path, 4), max_steps=10)
    assert len(full.seen) == 10
    assert len({i for batch in full.seen for i in batch}) == 20  # no sample twice

    for k in (4, 8):
        ckpt = tmp_path / f"step={k}.ckpt"
        resumed = _fit(tmp_path / f"resume{k}", TinyLM(), _dm(), ckpt_path=ckpt, max_steps=10)
        # No duplicate, no skip, no shift by the batch Lightning had prefetched.
        assert resumed.seen == full.seen[k:], k

    saved = torch.load(tmp_path / "step=4.ckpt", weights_only=False)
    state = saved["ZephonDataModule"]
    # The saved position is after exactly 4 batches (Lightning had already fetched a 5th) ...
    loader = DataLoader(_pipe(), to_training=TO_TRAINING, in_process=True)
    it = iter(loader)
    for _ in range(4):
        next(it)
    assert state["train"] == loader.state_dict()
    assert state["pass_ended"] is False
    loader.close()
    # ... and Lightning kept no loader state of its own that could be restored a second time.
    assert "combined_loader" not in saved["loops"]["fit_loop"]["state_dict"]


def test_validation_runs_between_steps_do_not_move_the_saved_position(tmp_path: Path):
    val = _pipe(passes=1, n=24)
    kwargs = {"max_steps": 10, "val_check_interval": 3, "check_val_every_n_epoch": None,
              "limit_val_batches": 2}
    full = _fit(tmp_path, ValidatingLM(), _dm(val=val, in_process=True),
                checkpoint=_every(tmp_path, 5), **kwargs)
    first_val = [b.to_training(**TO_TRAINING) for b, _ in zip(val.iter(runner="inline"),
                                                               range(2))]
    # Sanity check (2) + 3 validation runs, each from the start of the val pipeline.
    assert full.val_seen == [_ids(b) for b in first_val] * 4
    resumed = _fit(tmp_path / "r", ValidatingLM(), _dm(val=val, in_process=True),
                   ckpt_path=tmp_path / "step=5.ckpt", **kwargs)
    assert resumed.seen == full.seen[5:]


def test_a_training_step_that_pulls_from_dataloader_iter_resumes_exactly(tmp_path: Path):
    full = _fit(tmp_path, IteratorLM(), _dm(in_process=True), checkpoint=_every(tmp_path, 3),
                max_steps=7)
    resumed = _fit(tmp_path / "r", IteratorLM(), _dm(in_process=True),
                   ckpt_path=tmp_path / "step=3.ckpt", max_steps=7)
    assert len(full.seen) == 7
    assert resumed.seen == full.seen[3:]


def test_an_epoch_end_checkpoint_resumes_with_the_next_pass(tmp_path: Path):
    # 96 items in batches of 2: 48 steps a pass, one pass an epoch.
    epochs = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{step}", every_n_epochs=1,
                             save_top_k=-1)
    full = _fit(tmp_path, TinyLM(), _dm(passes=1, in_process=True), checkpoint=epochs,
                max_epochs=2)
    assert len(full.seen) == 96
    # Each epoch is the whole pass, in the pipeline's order of that epoch.
    assert full.seen == [_ids(b.to_training(**TO_TRAINING)) for epoch in range(2)
                         for b in _pipe(passes=1).iter(runner="inline", epoch=epoch)]
    assert full.seen[48:] != full.seen[:48]
    saved = torch.load(tmp_path / "epoch=0-step=48.ckpt", weights_only=False)
    assert saved["ZephonDataModule"]["pass_ended"] is True
    resumed = _fit(tmp_path / "r", TinyLM(), _dm(passes=1, in_process=True),
                   ckpt_path=tmp_path / "epoch=0-step=48.ckpt", max_epochs=2)
    assert resumed.seen == full.seen[48:]


def test_epochs_cut_by_limit_train_batches_continue_the_stream_and_resume_exactly(
        tmp_path: Path):
    epochs = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{step}", every_n_epochs=1,
                             save_top_k=-1)
    kwargs = {"max_epochs": 3, "limit_train_batches": 4}
    full = _fit(tmp_path, TinyLM(), _dm(in_process=True), checkpoint=epochs, **kwargs)
    reference = [_ids(b.to_training(**TO_TRAINING))
                 for b, _ in zip(_pipe().iter(runner="inline"), range(12))]
    # Epoch 2 starts after epoch 1's last batch: the one Lightning prefetched is not lost.
    assert full.seen == reference
    resumed = _fit(tmp_path / "r", TinyLM(), _dm(in_process=True),
                   ckpt_path=tmp_path / "epoch=0-step=4.ckpt", **kwargs)
    assert resumed.seen == full.seen[4:]


def test_epochs_cut_by_limit_train_batches_continue_the_stream_when_the_step_pulls_batches(
        tmp_path: Path):
    # training_step(dataloader_iter): Lightning calls no hook per batch, so every batch
    # handed out counts as received, and the next epoch goes on after the last of them.
    full = _fit(tmp_path, IteratorLM(), _dm(in_process=True), max_epochs=3,
                limit_train_batches=4)
    reference = [_ids(b.to_training(**TO_TRAINING))
                 for b, _ in zip(_pipe().iter(runner="inline"), range(12))]
    assert full.seen == reference


def test_a_model_hook_on_before_batch_transfer_still_runs(tmp_path: Path):
    with pytest.warns(UserWarning, match="overridden `on_before_batch_transfer` in both"):
        model = _fit(tmp_path, HookedLM(), _dm(in_process=True), max_steps=3)
    assert model.hooked == 3


# --------------------------------------------------------------------------- the module alone


def test_the_iterability_probe_neither_starts_the_loader_nor_uses_up_a_loaded_state():
    source = _dm(in_process=True)
    stream = source.train_dataloader()
    it = iter(stream)
    first = [_ids(next(it)) for _ in range(3)]
    state = source.state_dict()  # used by hand: every batch handed out counts as received
    source.teardown("fit")

    dm = _dm(in_process=True)
    dm.load_state_dict(state)
    stream = dm.train_dataloader()
    assert isinstance(stream, ZephonStream)
    assert not hasattr(stream, "state_dict")  # Lightning must not checkpoint it itself
    iter(stream)  # what Lightning's _check_dataloader_iterable does
    assert not stream.started
    rest = [_ids(b) for b, _ in zip(stream, range(2))]
    dm.teardown("fit")

    reference = [_ids(b.to_training(**TO_TRAINING))
                 for b, _ in zip(_pipe().iter(runner="inline"), range(5))]
    assert first + rest == reference


def test_state_before_any_batch_is_the_start_and_round_trips():
    dm = _dm(in_process=True)
    state = dm.state_dict()
    assert state["train"] == DataLoader(_pipe(), to_training=TO_TRAINING).state_dict()
    other = _dm(in_process=True)
    other.load_state_dict(state)
    batches = [_ids(b) for b, _ in zip(other.train_dataloader(), range(2))]
    other.teardown("fit")
    reference = [_ids(b.to_training(**TO_TRAINING))
                 for b, _ in zip(_pipe().iter(runner="inline"), range(2))]
    assert batches == reference


def test_load_state_dict_rejects_what_is_not_this_pipelines_state():
    dm = _dm()
    with pytest.raises(ValueError, match="not a ZephonDataModule state"):
        dm.load_state_dict({"lanes": {}})
    state = dm.state_dict()
    with pytest.raises(ValueError, match="version"):
        dm.load_state_dict({**state, "version": 99})
    other = ZephonDataModule(train=_pipe(seed=2))
    with pytest.raises(ValueError, match="different pipeline configuration"):
        other.load_state_dict(state)


def test_bad_arguments_fail_when_the_module_is_built():
    with pytest.raises(TypeError, match=r"takes a zephon_torch\.Pipeline"):
        ZephonDataModule(train=[1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch_size"):
        ZephonDataModule(train=_pipe(), loader_kwargs={"batch_size": 8})


# --------------------------------------------------------------------------- the recipe


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lightning_recipe_resumes_the_data_exactly_and_the_loss_continues(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, str(RECIPES / "lightning_pretrain.py"), "--steps", "12",
         "--docs", "600", "--val-every", "8", "--val-batches", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=220,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resume: data identical (6 batches compared by sample ids)" in result.stdout
    diff = float(re.search(r"max \|diff\| over 6 steps ([0-9.e+-]+)", result.stdout).group(1))
    assert diff < 1e-3
    assert (tmp_path / "checkpoints" / "step=6.ckpt").exists()


# --------------------------------------------------------------------------- epochs


def _epoch_ids(pipe: zt.Pipeline, epoch: int) -> list[list[tuple[int, ...]]]:
    return [_ids(b.to_training(**TO_TRAINING)) for b in pipe.iter(runner="inline", epoch=epoch)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_three_trainer_epochs_run_three_reproducible_orders_and_resume_mid_epoch_2(
        tmp_path: Path, num_workers: int):
    # 24 items in batches of 2: 12 steps an epoch; the checkpoint is 5 steps into epoch 2.
    pipe = _pipe(passes=1, n=24)

    def dm() -> ZephonDataModule:
        return ZephonDataModule(train=pipe, loader_kwargs={"to_training": TO_TRAINING,
                                                           "num_workers": num_workers})

    full = _fit(tmp_path, TinyLM(), dm(), checkpoint=_every(tmp_path, 29), max_epochs=3)
    epochs = [_epoch_ids(pipe, e) for e in range(3)]
    assert full.seen == epochs[0] + epochs[1] + epochs[2]
    assert len({str(e) for e in epochs}) == 3
    again = _fit(tmp_path / "again", TinyLM(), dm(), max_epochs=3)
    assert again.seen == full.seen
    saved = torch.load(tmp_path / "step=29.ckpt", weights_only=False)
    assert saved["ZephonDataModule"]["train"]["epoch"] == 2
    resumed = _fit(tmp_path / "r", TinyLM(), dm(), ckpt_path=tmp_path / "step=29.ckpt",
                   max_epochs=3)
    assert resumed.seen == full.seen[29:]


def test_validation_reads_the_same_batches_in_every_epoch_with_its_own_loader_options(
        tmp_path: Path):
    val = _pipe(passes=1, n=8)
    dm = ZephonDataModule(train=_pipe(passes=1, n=8), val=val,
                          loader_kwargs={"to_training": TO_TRAINING, "num_workers": 2},
                          eval_loader_kwargs={"to_training": TO_TRAINING, "num_workers": 0})
    model = _fit(tmp_path, ValidatingLM(), dm, max_epochs=3, num_sanity_val_steps=0)
    assert dm.val_dataloader().loader.num_workers == 0
    assert dm.train_dataloader().loader.num_workers == 2
    assert model.val_seen == _epoch_ids(val, 0) * 3


class EvalLM(TinyLM):
    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.val_seen.append(_ids(batch))

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[tuple[int, ...]]:
        return _ids(batch)


def test_test_and_predict_pipelines_run_under_trainer_test_and_predict(tmp_path: Path):
    test, predict = _pipe(passes=1, n=8, seed=2), _pipe(passes=1, n=6, seed=3)
    dm = ZephonDataModule(train=_pipe(passes=1, n=8), test=test, predict=predict,
                          loader_kwargs={"to_training": TO_TRAINING})
    model = EvalLM()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.test(model, datamodule=dm)
    assert model.val_seen == _epoch_ids(test, 0)
    assert trainer.predict(model, datamodule=dm) == _epoch_ids(predict, 0)
    with pytest.raises(ValueError, match="no test pipeline: pass test="):
        ZephonDataModule(train=_pipe(passes=1, n=8))._eval_stream("test")


def test_the_data_module_logs_the_train_loaders_throughput_to_the_trainers_logger(
        tmp_path: Path):
    from lightning.pytorch.loggers import CSVLogger

    dm = ZephonDataModule(train=_pipe(passes=1, n=16), loader_kwargs={"to_training": TO_TRAINING})
    trainer = pl.Trainer(accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, max_epochs=1,
                         logger=CSVLogger(tmp_path), log_every_n_steps=2,
                         enable_checkpointing=False)
    trainer.fit(TinyLM(), datamodule=dm)
    text = (Path(trainer.logger.log_dir) / "metrics.csv").read_text()
    header = text.splitlines()[0].split(",")
    assert {"data/outputs_per_s", "data/wait_s", "data/epoch"} <= set(header)
