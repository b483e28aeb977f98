"""Uneven ranks under real ``torchrun`` jobs (gloo on CPU): every rank agrees on its epoch.

With ``on_uneven="stop"`` a rank that runs out ends the epoch on every rank;
what the others had not read of it is dropped, and every rank's state says
so: each is the state of that epoch with all its lanes ended, so the
gathered checkpoint merges, and a resume from it (on 2 ranks or 1) goes on
exactly as the uninterrupted run does. ``tests/uneven_ranks_job.py`` is the
job; the references are single-process runs of the same pipelines here.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from zephon_torch.epochs import state_finished

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _torchrun import torchrun  # noqa: E402
from uneven_ranks_job import _ids, pipeline  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _job(nproc: int, out: Path, *args: str, on_uneven: str = "stop",
         timeout: float = 240) -> list[dict[str, Any]]:
    """Run the job on ``nproc`` ranks; every rank's record."""
    torchrun(HERE / "uneven_ranks_job.py", nproc, *args, "--out", str(out),
             "--on-uneven", on_uneven, timeout=timeout)
    return [json.loads((out / f"{args[0]}-{on_uneven}-{nproc}-{rank}.json").read_text())
            for rank in range(nproc)]


def _reference(name: str, epoch: int, rank: int = 0, world_size: int = 1) -> list[list[str]]:
    """One rank's batches (as ids) of one epoch, uninterrupted, in this process."""
    return [_ids(b) for b in pipeline(name).iter(runner="inline", rank=rank,
                                                 world_size=world_size, epoch=epoch)]


def _stopped(name: str, epoch: int) -> list[list[list[str]]]:
    """Both ranks' batches of one epoch under on_uneven="stop": up to the shorter rank's end."""
    both = [_reference(name, epoch, rank, 2) for rank in (0, 1)]
    steps = min(len(b) for b in both)
    return [b[:steps] for b in both]


def _save(path: Path, state: dict[str, Any]) -> str:
    path.write_text(json.dumps(state))
    return str(path)


def _lane_of(name: str, epoch: int) -> dict[str, int]:
    return {str(r.payload["text"]): r.meta.lane_id
            for b in pipeline(name).iter(runner="inline", epoch=epoch) for r in b.records}


def test_a_rank_without_a_batch_ends_the_epoch_on_every_rank_with_one_gathered_state(tmp_path):
    ranks = _job(2, tmp_path, "tiny")
    for record in ranks:
        assert record["errors"] == [], record["errors"]
        # Rank 1 owns no document: every epoch stops at step 0 on both ranks.
        assert record["batches"] == [[], [], []]
        # Both ranks went through epochs 0, 1, 2 together, and say so in their states.
        assert record["loader_epoch"] == [0, 1, 2]
        assert [state["epoch"] for state in record["own"]] == [0, 1, 2]
        assert all(state_finished(state) for state in record["own"])
        assert [state["epoch"] for state in record["gathered"]] == [0, 1, 2]
        assert all(state_finished(state) for state in record["gathered"])
    assert ranks[0]["gathered"] == ranks[1]["gathered"]
    # Rank 0 had batches and trained on none of them: said, not silent.
    assert any("step 0" in w and "on_uneven" in w for w in ranks[0]["warnings"])

    # A resume from the state gathered after epoch 0 goes on with epoch 1, as the run did.
    state = _save(tmp_path / "after0.json", ranks[0]["gathered"][0])
    resumed = _job(2, tmp_path / "r2", "resume", "--pipeline", "tiny", "--state", state,
                   "--epochs", "2")
    for record in resumed:
        assert record["errors"] == [] and record["start_epoch"] == 1
        assert record["batches"] == [[], []] and record["loader_epoch"] == [1, 2]
        assert record["gathered"] == ranks[0]["gathered"][1:]
    # On one rank, which owns every lane, epoch 1 is read whole.
    (alone,) = _job(1, tmp_path / "r1", "resume", "--pipeline", "tiny", "--state", state,
                    "--epochs", "2")
    assert alone["errors"] == [] and alone["start_epoch"] == 1
    assert alone["batches"] == [_reference("tiny", 1), _reference("tiny", 2)]
    assert len(alone["batches"][0]) == 3


def test_uneven_ranks_stop_together_and_resume_exactly_on_two_and_one_ranks(tmp_path):
    ranks = _job(2, tmp_path, "uneven")
    for rank, record in enumerate(ranks):
        assert record["errors"] == [], record["errors"]
        assert record["batches"] == [_stopped("uneven", e)[rank] for e in range(3)]
        assert record["loader_epoch"] == [0, 1, 2]
        assert [state["epoch"] for state in record["gathered"]] == [0, 1, 2]
        assert not record["warnings"]
    assert len(ranks[0]["batches"][0]) == 8  # of rank 0's 10: the stop dropped two

    # After the stopped epoch 0: the next epoch from its beginning, as the run went on.
    after0 = _save(tmp_path / "after0.json", ranks[0]["gathered"][0])
    resumed = _job(2, tmp_path / "a2", "resume", "--pipeline", "uneven", "--state", after0,
                   "--epochs", "2")
    for rank, record in enumerate(resumed):
        assert record["errors"] == [] and record["start_epoch"] == 1
        assert record["batches"] == ranks[rank]["batches"][1:]
        assert record["gathered"] == ranks[0]["gathered"][1:]

    # From step 3 of epoch 1, on two ranks: the rest of epoch 1, then epoch 2.
    mid = _save(tmp_path / "mid.json", ranks[0]["mid"])
    resumed = _job(2, tmp_path / "m2", "resume", "--pipeline", "uneven", "--state", mid,
                   "--epochs", "2")
    for rank, record in enumerate(resumed):
        assert record["errors"] == [] and record["start_epoch"] == 1
        assert record["batches"] == [ranks[rank]["batches"][1][3:], ranks[rank]["batches"][2]]
        assert record["gathered"] == ranks[0]["gathered"][1:]

    # On one rank: each lane goes on exactly where it stood, then epoch 2 whole.
    (alone,) = _job(1, tmp_path / "m1", "resume", "--pipeline", "uneven", "--state", mid,
                    "--epochs", "2")
    assert alone["errors"] == [] and alone["start_epoch"] == 1
    lane_of = _lane_of("uneven", 1)
    per_lane: dict[int, list[list[str]]] = defaultdict(list)
    for batch in [b for record in ranks for b in record["batches"][1][:3]] + alone["batches"][0]:
        (lane,) = {lane_of[i] for i in batch}
        per_lane[lane].append(batch)
    want: dict[int, list[list[str]]] = defaultdict(list)
    for batch in _reference("uneven", 1):
        want[lane_of[batch[0]]].append(batch)
    assert per_lane == want
    assert alone["batches"][1] == _reference("uneven", 2)


def test_continue_lets_each_rank_run_to_its_end_and_still_gathers(tmp_path):
    ranks = _job(2, tmp_path, "tiny", on_uneven="continue")
    assert ranks[0]["batches"] == [_reference("tiny", e, 0, 2) for e in range(3)]
    assert ranks[1]["batches"] == [[], [], []]
    for record in ranks:
        assert record["errors"] == [] and record["loader_epoch"] == [0, 1, 2]
        assert [state["epoch"] for state in record["gathered"]] == [0, 1, 2]


def test_a_rank_whose_pipeline_fails_makes_every_rank_raise_instead_of_stopping(tmp_path):
    ranks = _job(2, tmp_path, "fail", timeout=120)
    (own,) = ranks[1]["errors"]
    assert "bad document d21" in own
    # Rank 0 had its batch: it does not take the failure for the end of the data (and
    # go on to the next epoch, to wait for rank 1 in a collective that never comes).
    (peer,) = ranks[0]["errors"]
    assert "another rank's loader failed at step 0 of epoch 0" in peer
    assert ranks[0]["batches"] == [] and ranks[0]["loader_epoch"] == []


def test_a_single_process_rank_without_a_batch_keeps_its_epochs_in_step():
    """Without a process group (rank and world size given), no vote: each rank runs alone."""
    import zephon_torch as zt

    empty = zt.DataLoader(pipeline("tiny"), to_training=False, rank=1, world_size=2)
    full = zt.DataLoader(pipeline("tiny"), to_training=False, rank=0, world_size=2)
    states = []
    for epoch in range(3):
        assert list(empty) == []
        assert [_ids(b) for b in full] == _reference("tiny", epoch, 0, 2)
        assert empty.epoch == full.epoch == epoch
        states.append([empty.state_dict(), full.state_dict()])
        assert [s["epoch"] for s in states[-1]] == [epoch, epoch]
    # Each rank's own state of epoch 1 resumes in step with the other's.
    again = [zt.DataLoader(pipeline("tiny"), to_training=False, rank=r, world_size=2)
             for r in (1, 0)]
    for loader, state in zip(again, states[1]):
        loader.load_state_dict(state)
    assert list(again[0]) == [] and [_ids(b) for b in again[1]] == _reference("tiny", 2, 0, 2)
    assert again[0].epoch == again[1].epoch == 2
