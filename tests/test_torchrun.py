"""Real ``torchrun`` jobs (gloo on CPU): DDP training, a gathered checkpoint, restarts on 2 and 1.

``recipes/torchrun_ddp.py`` is launched with ``python -m torch.distributed.run``:
two ranks train a few steps and save model, optimizer and the loader state
gathered from both ranks; then the job restarts from that file with two
ranks and, separately, with one. Each launch writes the sample ids every
rank received at every step. The reference is an uninterrupted run of the
same pipeline in this process (the inline runner): per lane, what the first
job delivered followed by what a restarted job delivered must be exactly
that lane's uninterrupted output. Every launch has a timeout, so a rank
stuck in a collective fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _torchrun import torchrun  # noqa: E402

FIRST_STEPS = 4  # the first job's steps (even: each rank's two lanes delivered equally)
TOTAL_STEPS = 8
LANES = 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _torchrun(nproc: int, *args: str, script: str = "torchrun_ddp.py",
              timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return torchrun(RECIPES / script, nproc, *args, timeout=timeout)


def _reference(out: Path, batches: int) -> tuple[dict[int, list[Any]], dict[tuple, int]]:
    """Per lane, the batches (as id lists) of an uninterrupted single-process run; id -> lane."""
    sys.path.insert(0, str(RECIPES))
    try:
        import torchrun_ddp as recipe
    finally:
        sys.path.remove(str(RECIPES))
    args = recipe.parser().parse_args(["--out", str(out), "--lanes", str(LANES)])
    files, tokenizer_path, eos, _ = recipe.prepare_data(out, args)
    pipe = recipe.build_pipeline(files, tokenizer_path, eos, args)
    per_lane: dict[int, list[Any]] = defaultdict(list)
    lane_of: dict[tuple, int] = {}
    with pipe.iter(runner="inline") as it:
        for batch, _ in zip(it, range(batches)):
            (lane,) = set(batch.lane_ids)  # a batch holds one lane's records
            ids = [list(i) for i in batch.ids]
            per_lane[lane].append(ids)
            for i in ids:
                assert lane_of.setdefault(tuple(i), lane) == lane  # a sample has one lane
    return per_lane, lane_of


def _per_lane(record: dict[str, Any], lane_of: dict[tuple, int]) -> dict[int, list[Any]]:
    """What each lane delivered in one launch, in step order."""
    lanes: dict[int, list[Any]] = defaultdict(list)
    for rank, log in enumerate(record["ranks"]):
        for entry in log:
            (lane,) = {lane_of[tuple(i)] for i in entry["ids"]}
            assert lane % record["world_size"] == rank, "a rank read a lane it does not own"
            lanes[lane].append(entry["ids"])
    return lanes


def _samples(records: list[dict[str, Any]]) -> dict[int, set[tuple]]:
    """Per rank position, the sample ids it received (over several launches of one size)."""
    seen: dict[int, set[tuple]] = defaultdict(set)
    for record in records:
        for rank, log in enumerate(record["ranks"]):
            for entry in log:
                seen[rank] |= {tuple(i) for i in entry["ids"]}
    return seen


def test_torchrun_ddp_checkpoint_resumes_every_lane_exactly_on_two_and_one_ranks(tmp_path):
    out = tmp_path / "data"  # corpus and tokenizer, shared by every launch
    ckpt = tmp_path / "ckpt.pt"
    common = ["--out", str(out), "--lanes", str(LANES), "--timeout", "60"]
    _torchrun(2, *common, "--steps", str(FIRST_STEPS), "--checkpoint", str(ckpt),
              "--ids-out", str(tmp_path / "first.json"))
    _torchrun(2, *common, "--steps", str(TOTAL_STEPS), "--resume", str(ckpt),
              "--ids-out", str(tmp_path / "resumed2.json"))
    # One rank does in 8 steps what two ranks did in 4.
    _torchrun(1, *common, "--steps", str(FIRST_STEPS + 2 * (TOTAL_STEPS - FIRST_STEPS)),
              "--resume", str(ckpt), "--ids-out", str(tmp_path / "resumed1.json"))

    first, resumed2, resumed1 = (json.loads((tmp_path / f"{name}.json").read_text())
                                 for name in ("first", "resumed2", "resumed1"))
    assert (first["world_size"], first["start"], first["steps"]) == (2, 0, FIRST_STEPS)
    assert (resumed2["world_size"], resumed2["start"], resumed2["steps"]) == (2, 4, 4)
    assert (resumed1["world_size"], resumed1["start"], resumed1["steps"]) == (1, 4, 8)

    saved = torch.load(ckpt, weights_only=True)
    assert sorted(saved["data"]["lanes"]) == [str(lane) for lane in range(LANES)]  # gathered
    assert saved["step"] == FIRST_STEPS and saved["world_size"] == 2
    assert {"model", "optimizer"} <= set(saved)

    reference, lane_of = _reference(out, 2 * TOTAL_STEPS + LANES)
    before = _per_lane(first, lane_of)
    for name, record in (("2 ranks", resumed2), ("1 rank", resumed1)):
        after = _per_lane(record, lane_of)
        for lane in range(LANES):
            got = before[lane] + after[lane]
            assert len(after[lane]) == 2, (name, lane)
            # No duplicate, no skip, no shift: the lane's uninterrupted output, in order.
            assert got == reference[lane][:len(got)], (name, lane)

    # The ranks never shared a sample, before or after the restart.
    seen = _samples([first, resumed2])
    assert not seen[0] & seen[1]
    assert seen[0] and seen[1]

    # Each rank reads its lanes round-robin in ascending order, across the restart too:
    # rank r of 2 owns lanes r and r + 2; one rank owns all four.
    for rank in (0, 1):
        steps = [e["ids"] for e in first["ranks"][rank] + resumed2["ranks"][rank]]
        lanes = [rank, rank + 2]
        assert steps == [reference[lanes[s % 2]][s // 2] for s in range(TOTAL_STEPS)]
    assert [e["ids"] for e in resumed1["ranks"][0]] == [
        reference[s % LANES][FIRST_STEPS // 2 + s // LANES] for s in range(8)]


def _lightning_ddp(out: Path, *args: str) -> dict[str, Any]:
    """Run the Lightning recipe on two ranks; its step-6 checkpoint.

    The recipe fits twice on Lightning's DDP strategy (uninterrupted, then
    from its step-6 checkpoint) and exits non-zero unless every rank saw
    identical data.
    """
    result = _torchrun(2, "--devices", "2", "--out", str(out), "--steps", "12",
                       "--docs", "600", "--val-every", "8", "--val-batches", "2", *args,
                       script="lightning_pretrain.py", timeout=200)
    assert "resume: data identical (6 batches compared by sample ids, on every rank)" \
        in result.stdout, result.stdout + result.stderr
    return torch.load(out / "checkpoints" / "step=6.ckpt", weights_only=False)


def test_lightning_ddp_under_torchrun_saves_every_lane_and_resumes_exactly(tmp_path):
    saved = _lightning_ddp(tmp_path)
    state = saved["ZephonDataModule"]
    # Both ranks' positions, gathered and merged: any world size can restart from it.
    assert sorted(state["train"]["lanes"]) == ["0", "1", "2", "3"]
    assert state["pass_ended"] is False


def test_a_bare_loader_under_lightning_ddp_saves_every_lane_and_resumes_exactly(tmp_path):
    # zephon DataLoaders passed to Trainer.fit: Lightning saves the train loader's own
    # state_dict() (rank 0 writes the file), which gathers every rank's position.
    saved = _lightning_ddp(tmp_path, "--bare-loader")
    assert "ZephonDataModule" not in saved
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert sorted(state["lanes"]) == ["0", "1", "2", "3"]
