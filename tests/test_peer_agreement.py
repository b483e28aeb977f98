"""Ranks that do not run one pipeline, or one epoch, are refused on every rank.

Each rank reads its own lanes of one schedule; a rank over another file list
(or files of other content, or another operator) has another schedule, so
the ranks together train on some documents twice and on others never, and
nothing says so. Under ``on_uneven="stop"`` (the default) the ranks already
run in step: at the start of each iteration they compare a digest of their
pipelines and their epochs, and a difference raises on every rank, naming
what differs. ``tests/peer_agreement_job.py`` is the job; ``merge_states``
names the difference too.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import zephon_torch as zt
from zephon_torch.checkpoint import merge_states

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _torchrun import torchrun  # noqa: E402
from peer_agreement_job import pipeline  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _write(folder: Path, name: str, texts: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _layout(root: Path, scenario: str) -> Path:
    """The files of each rank: the same for both, or differing as ``scenario`` says."""
    data = root / "data"
    for shard in range(3):
        _write(data / "rank0", f"part{shard}.jsonl", [f"s{shard}-{i}" for i in range(12)])
    shutil.copytree(data / "rank0", data / "rank1")
    if scenario == "files":
        _write(data / "rank1", "part3.jsonl", [f"s3-{i}" for i in range(12)])
    elif scenario == "content":  # same name, size and line count; other text
        _write(data / "rank1", "part1.jsonl", [f"t1-{i}" for i in range(12)])
    return data


def _run(tmp_path: Path, scenario: str) -> tuple[Path, list[dict[str, Any]]]:
    data = _layout(tmp_path, scenario)
    out = tmp_path / "out"
    torchrun(HERE / "peer_agreement_job.py", 2, scenario, "--data", str(data), "--out", str(out))
    return data, [json.loads((out / f"{scenario}-{rank}.json").read_text()) for rank in (0, 1)]


def test_ranks_over_the_same_files_run_their_lanes_of_one_schedule(tmp_path):
    data, records = _run(tmp_path, "same")
    assert [r["error"] for r in records] == [None, None]
    for rank, record in enumerate(records):
        expected = [[str(r.payload["text"]) for r in b.records]
                    for b in pipeline(data / "rank0").iter(rank=rank, world_size=2)]
        steps = min(len(record["batches"]), len(expected))
        assert record["batches"] == expected[:steps] and steps > 0
    delivered = [t for r in records for b in r["batches"] for t in b]
    assert len(delivered) == len(set(delivered))  # no document twice


@pytest.mark.parametrize("scenario, named", [
    ("files", ["datasets differ(s)", "3 shard(s) on rank 0, 4 on rank 1",
               "only on rank 1: 'part3.jsonl'"]),
    ("content", ["the content of its files differs"]),
    ("batch", ["ops[2] batch (microbatch_size 2 -> 3)"]),
    ("epoch", ["rank 0: 0, rank 1: 1", "set_epoch()"]),
])
def test_ranks_that_differ_raise_on_every_rank_naming_what_differs(tmp_path, scenario, named):
    _, records = _run(tmp_path, scenario)
    for record in records:
        assert record["batches"] == []  # nothing was trained on
        error = record["error"] or ""
        assert error.startswith("RuntimeError: zephon DataLoader:"), error
        for words in named:
            assert words in error, error
    assert records[0]["error"] == records[1]["error"]  # every rank says the same


def test_merge_states_names_what_differs_between_two_ranks_states(tmp_path):
    data = _layout(tmp_path, "files")
    states = [zt.DataLoader(pipeline(data / f"rank{rank}"), to_training=False, rank=rank,
                            world_size=2).state_dict() for rank in (0, 1)]
    with pytest.raises(ValueError, match=r"state 1 was saved by another pipeline "
                                         r"configuration than state 0: datasets differ"):
        merge_states(states)
    merge_states([states[0], zt.DataLoader(pipeline(data / "rank0"), to_training=False,
                                           rank=1, world_size=2).state_dict()])
