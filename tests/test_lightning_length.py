"""The data module's loaders have the pipeline's len() when it is known without reading.

``zephon_torch.DataLoader`` has it (``Pipeline.num_batches``), and Lightning
reads it as the epoch length; the ``ZephonStream`` the data module hands
Lightning forwards it, so ``trainer.num_training_batches`` and
``trainer.estimated_stepping_batches`` (which LR schedules are sized from) are
the epoch's batches under the data module too, not ``inf``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import zephon_torch as zt

pl = pytest.importorskip("lightning.pytorch")
from zephon_torch.lightning import ZephonDataModule  # noqa: E402


def _pipe() -> zt.Pipeline:
    # 24 records of token ids, batches of 2, one pass: 12 batches, known up front.
    items = [{"input_ids": np.arange(4, dtype=np.int32) + i} for i in range(24)]
    return zt.Pipeline.from_items(items, num_lanes=2, chunk_size=4, passes=1).batch(2)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.lengths: list[Any] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self.layer(batch["input_ids"][:, :1].float()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_start(self) -> None:
        self.lengths.append((self.trainer.num_training_batches,
                             self.trainer.estimated_stepping_batches))


def test_the_data_modules_train_loader_has_the_pipelines_len_when_it_is_known() -> None:
    pipe = _pipe()
    assert pipe.num_batches() == 12
    assert len(zt.DataLoader(pipe)) == 12  # the bare loader has it
    dm = ZephonDataModule(train=pipe)
    assert len(dm.train_dataloader()) == 12


def test_lightning_sees_the_epoch_length_under_the_data_module(tmp_path: Any) -> None:
    model = _Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=ZephonDataModule(train=_pipe()))
    # As a bare zt.DataLoader of the same pipeline gives.
    assert model.lengths == [(12, 12)]


def test_an_epoch_of_unknown_length_trains_to_the_end_of_the_pipeline(tmp_path: Any) -> None:
    # A filter makes the count depend on the data: len() raises TypeError (torch's way of
    # saying "no length"), Lightning sees an epoch of unknown length and runs it to the end.
    pipe = zt.Pipeline.from_items(
        [{"input_ids": np.arange(4, dtype=np.int32) + i} for i in range(24)],
        num_lanes=2, chunk_size=4, passes=1,
    ).filter(lambda p: int(p["input_ids"][0]) % 3 != 0).batch(2)
    assert pipe.num_batches() is None
    with pytest.raises(TypeError, match="no len"):
        len(ZephonDataModule(train=pipe).train_dataloader())
    model = _Tiny()
    seen: list[int] = []

    class _Count(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            seen.append(1)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=[_Count()])
    trainer.fit(model, datamodule=ZephonDataModule(train=pipe))
    assert model.lengths == [(float("inf"), -1)]  # Lightning's "unknown"
    assert len(seen) == 8  # 16 records kept, in batches of 2
