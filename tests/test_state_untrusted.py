"""States as untrusted input (issue 21, item 8).

A hostile or careless edit can recompute a state's checksum, so every field
of a loaded state is checked at ``load_state_dict`` (before anything runs)
against the pipeline's schedule: each case below was accepted before and
silently skipped, duplicated or reordered data, or failed later with a
misleading message. Every state the pipeline itself writes still loads.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from harness import assert_same, collect

import zephon_torch as zt
from zephon_torch import sources as zd
from zephon_torch.checkpoint import state_checksum
from zephon_torch.pipeline import Pipeline

LANES = 4
CHUNK = 4
K = 2  # flush_every_k_chunks


def shuffled_pipe() -> Pipeline:
    """A source shuffled per epoch, a shuffle and batches: sentinels every K chunks."""
    return (zt.Pipeline.from_items([f"doc {i}" for i in range(120)], num_lanes=LANES,
                                   chunk_size=CHUNK, flush_every_k_chunks=K, shuffle=True)
            .shuffle(8, seed=2).batch(2))


def saved(pipe: Pipeline, steps: int = 7, **kwargs: Any) -> dict[str, Any]:
    it = pipe.iter(runner="inline", **kwargs)
    for _ in range(steps):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    return state


def hostile(state: dict[str, Any], edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """``state`` edited by ``edit``, its checksum recomputed as an editing user would."""
    edited = copy.deepcopy(state)
    edit(edited)
    body = {k: v for k, v in edited.items() if k != "checksum"}
    return {**body, "checksum": state_checksum(body)}


def refused(pipe: Pipeline, state: dict[str, Any], match: str) -> None:
    """Loading ``state`` is a ValueError matching ``match``, and nothing was loaded."""
    it = pipe.iter(runner="inline")
    with pytest.raises(ValueError, match=match) as info:
        it.load_state_dict(state)
    text = str(info.value)
    assert text.startswith("corrupted state: ") and "nothing was loaded" in text, text
    assert_same(collect(pipe, runner="inline"), list(it), label="after a refused state")


def lane(state: dict[str, Any], key: str = "0") -> dict[str, Any]:
    return state["lanes"][key]


def row(chunk: int, lane_id: int) -> list[int]:
    """A window row as the one-dataset schedule has it: [chunk, global chunk, count]."""
    g = chunk * LANES + lane_id
    return [chunk, g, g * CHUNK]


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    state = saved(shuffled_pipe())
    # The edits below assume lane 0 mid-window with a cursor (as this pipeline leaves it).
    assert lane(state)["window"] and lane(state)["replay_cursor"] is not None
    return state


# ---------------------------------------------------------------- the cases of the issue


def test_a_next_chunk_far_beyond_the_schedule_is_refused(state: dict[str, Any]) -> None:
    edited = hostile(state, lambda s: lane(s).__setitem__("next", [10**30, 0]))
    refused(shuffled_pipe(), edited, r"lane 0: 'next'\[0\] is 10{30}, outside the allowed "
                                     r"range \[0, 9223372036854775807\]")


def test_a_next_chunk_of_another_lane_is_refused(state: dict[str, Any]) -> None:
    edited = hostile(state, lambda s: lane(s).__setitem__("next", lane(s, "1")["next"]))
    refused(shuffled_pipe(), edited, r"lane 0: 'next' global chunk is \d+, a chunk of lane 1, "
                                     r"not of lane 0")


def test_a_next_chunk_of_the_lane_that_skips_chunks_is_refused(state: dict[str, Any]) -> None:
    last = lane(state)["window"][-1][0]
    edited = hostile(state, lambda s: lane(s).__setitem__("next", row(last + 3, 0)[1:]))
    refused(shuffled_pipe(), edited, rf"'next' global chunk is {(last + 3) * LANES}, lane chunk "
                                     rf"{last + 3}, but the window ends at chunk {last}")


def test_a_next_whose_counts_are_not_the_schedules_is_refused(state: dict[str, Any]) -> None:
    edited = hostile(state, lambda s: lane(s)["next"].__setitem__(1, 0))
    refused(shuffled_pipe(), edited, r"lane 0: 'next' is \[\d+, 0\], whose counts add up to 0 "
                                     r"samples, where \d+ come before global chunk")


def test_thirty_thousand_window_rows_are_refused(state: dict[str, Any]) -> None:
    rows = [row(c, 0) for c in range(30_000)]

    def edit(s: dict[str, Any]) -> None:
        lane(s).update(window=rows, next=row(30_000, 0)[1:],
                       epoch_boundaries=list(range(0, 30_000, K)))
        lane(s)["replay_cursor"][0] = 29_999
    refused(shuffled_pipe(), hostile(state, edit),
            r"lane 0: 'window' is .*\(30000 items\), 30000 rows over 15000 of the lane's epochs "
            r".*at most 2 epochs \(4 chunks\)")
    repeated = hostile(state, lambda s: lane(s).__setitem__("window", [row(0, 0)] * 30_000))
    refused(shuffled_pipe(), repeated, r"'window' is .*not consecutive chunks of the lane")


def test_a_round_robin_index_beyond_the_lanes_is_refused(state: dict[str, Any]) -> None:
    for index in (10**12, LANES, -1):
        edited = hostile(state, lambda s, i=index: s["round_robin"].__setitem__("index", i))
        refused(shuffled_pipe(), edited, rf"'round_robin' index is {index}, outside the allowed "
                                         rf"range \[0, {LANES - 1}\]")


def test_round_robin_lanes_other_than_the_states_are_refused(state: dict[str, Any]) -> None:
    for lanes in ([0, 0, 1, 2], [0, 1, 2], [3, 2, 1, 0], "0123"):
        edited = hostile(state, lambda s, v=lanes: s["round_robin"].__setitem__("lanes", v))
        refused(shuffled_pipe(), edited, r"'round_robin' lanes is .*not the state's lanes "
                                         r"\[0, 1, 2, 3\]")
    extra = hostile(state, lambda s: s["round_robin"].__setitem__("offset", 1))
    refused(shuffled_pipe(), extra, r"'round_robin' is .*not None nor")


def test_a_huge_epoch_is_refused_naming_the_range(state: dict[str, Any]) -> None:
    edited = hostile(state, lambda s: s.__setitem__("epoch", 10**30))
    refused(shuffled_pipe(), edited, r"'epoch' is 10{30}, outside the allowed range "
                                     r"\[0, 9223372036854775807\]")
    with pytest.raises(ValueError, match=r"epoch must be at most 9223372036854775807, got "
                                         r"18446744073709551617: an epoch's seed holds 64 bits"):
        shuffled_pipe().iter(runner="inline", epoch=2**64 + 1)  # was epoch 1's order


def test_an_edited_epoch_is_refused_by_the_cursors_sample(state: dict[str, Any]) -> None:
    edited = hostile(state, lambda s: s.__setitem__("epoch", 3))
    refused(shuffled_pipe(), edited, r"lane \d: 'replay_cursor' sample_id is \[0, 0, \d+\], "
                                     r"not the sample the schedule puts at chunk \d+, offset "
                                     r"\d+ in this epoch .*epoch, window or cursor was edited")


# ---------------------------------------------------------------- every other field


def _cursor_at(state: dict[str, Any], chunk: int, offset: int) -> list[Any]:
    cursor = copy.deepcopy(lane(state)["replay_cursor"])
    cursor[0], cursor[1] = chunk, offset
    return cursor


CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    # the cursor
    "cursor sample": (lambda s: lane(s)["replay_cursor"].__setitem__(3, [9, 9, 9]),
                      r"'replay_cursor' sample_id is \[9, 9, 9\], not the sample"),
    "cursor past the window": (
        lambda s: lane(s).__setitem__("replay_cursor", _cursor_at(s, 40, 0)),
        r"'replay_cursor' chunk is 40, outside the window \(chunks 0 to 1\)"),
    "cursor offset": (lambda s: lane(s)["replay_cursor"].__setitem__(1, CHUNK),
                      rf"'replay_cursor' offset is {CHUNK}, outside a chunk of {CHUNK}"),
    "cursor without window": (lambda s: lane(s).update(window=[], epoch_boundaries=[]),
                              r"'replay_cursor' is .*but the window is empty"),
    "cursor sample_id short": (lambda s: lane(s)["replay_cursor"].__setitem__(3, [0, 0]),
                               r"'replay_cursor' sample_id is \[0, 0\], of 2 item\(s\) where 3"),
    "cursor lineage": (lambda s: lane(s)["replay_cursor"].__setitem__(2, [1.5]),
                       r"'replay_cursor' lineage\[0\] is 1.5, not an integer"),
    # counts
    "replay_count 0 with a cursor": (lambda s: lane(s).__setitem__("replay_count", 0),
                                     r"'replay_count' is 0, below 1"),
    "replay_count without a cursor": (
        lambda s: lane(s).update(replay_cursor=None, window=lane(s)["window"][:1],
                                 next=row(1, 0)[1:]),
        r"'replay_count' is \d+, but there is no replay cursor"),
    "outputs huge": (lambda s: lane(s).__setitem__("outputs", 10**30),
                     r"'outputs' is 10{30}, outside the allowed range"),
    "replay_count huge": (lambda s: lane(s).__setitem__("replay_count", 2**63),
                          r"'replay_count' is 9223372036854775808, outside the allowed range"),
    "outputs bool": (lambda s: lane(s).__setitem__("outputs", True),
                     r"'outputs' is True, not an integer"),
    "outputs float": (lambda s: lane(s).__setitem__("outputs", 2.0),
                      r"'outputs' is 2.0, not an integer"),
    "outputs str": (lambda s: lane(s).__setitem__("outputs", "2"),
                    r"'outputs' is '2', not an integer"),
    "outputs None": (lambda s: lane(s).__setitem__("outputs", None),
                     r"'outputs' is None, not an integer"),
    "outputs negative": (lambda s: lane(s).__setitem__("outputs", -1),
                         r"'outputs' is -1, outside the allowed range"),
    # the window
    "window row of another lane": (lambda s: lane(s)["window"].__setitem__(0, row(0, 1)),
                                   r"'window'\[0\] global chunk is 1, a chunk of lane 1"),
    "window row chunk": (lambda s: [r.__setitem__(0, r[0] + 2) for r in lane(s)["window"]]
                         + [lane(s).pop("epoch_boundaries")],
                         r"'window'\[0\] chunk is 2, not the lane's chunk of global chunk 0"),
    "window row counts": (lambda s: lane(s)["window"][1].__setitem__(2, 3),
                          r"'window'\[1\] is \[1, 4, 3\], whose counts add up to 3"),
    "window row of two datasets": (lambda s: lane(s)["window"][0].append(0),
                                   r"'window'\[0\] is \[0, 0, 0, 0\], with 2 dataset count"),
    "window row short": (lambda s: lane(s)["window"].__setitem__(0, [0, 0]),
                         r"'window'\[0\] is \[0, 0\], of 2 item\(s\) where at least 3"),
    "window mid-epoch": (
        lambda s: lane(s).update(window=[row(1, 0)], epoch_boundaries=[0],
                                 replay_cursor=_cursor_at(s, 1, 0)),
        r"'window' is \[\[1, 4, 16\]\], starting at chunk 1, not at one of the lane's epoch "
        r"boundaries \(a multiple of flush_every_k_chunks=2\)"),
    "window bool": (lambda s: lane(s)["window"][0].__setitem__(1, False),
                    r"'window'\[0\]\[1\] is False, not an integer"),
    "window not a list": (lambda s: lane(s).__setitem__("window", {"0": [0, 0, 0]}),
                          r"'window' is \{'0': \[0, 0, 0\]\}, not a list"),
    "epoch_boundaries": (lambda s: lane(s).__setitem__("epoch_boundaries", [0, 2]),
                         r"'epoch_boundaries' is \[0, 2\], not those of the window \(\[0\]"),
    "next of two datasets": (lambda s: lane(s)["next"].append(0),
                             r"'next' is \[8, 32, 0\], with 2 dataset count"),
    "next past the end": (
        lambda s: lane(s).update(window=[], replay_cursor=None, replay_count=0,
                                 epoch_boundaries=[], next=row(30, 0)[1:]),
        r"'next' is \[120, 480\], past the end of the schedule"),
    # keys
    "unknown key": (lambda s: s.__setitem__("resume_here", 1),
                    r"unknown key\(s\) \['resume_here'\]"),
    "unknown lane key": (lambda s: lane(s).__setitem__("skip", 1),
                         r"lane 0: unknown key\(s\) \['skip'\]"),
    "missing lane key": (lambda s: lane(s).pop("outputs"),
                         r"lane 0: the key\(s\) \['outputs'\] are missing"),
    "duplicate lane": (lambda s: s["lanes"].__setitem__("00", lane(s)),
                       r"a lane key is '00', not a lane number as state_dict\(\) writes it"),
    "fullwidth lane": (lambda s: s["lanes"].__setitem__("\uff10", s["lanes"].pop("0")),
                       r"a lane key is '\uff10', not a lane number"),
    "lane out of range": (lambda s: s["lanes"].__setitem__("9", lane(s)),
                          r"a lane key is '9', outside the state's lanes 0 to 3"),
    "num_lanes bool": (lambda s: s.__setitem__("num_lanes", True),
                       r"'num_lanes' is True, not an integer"),
    "version bool": (lambda s: s.__setitem__("version", True),
                     r"'version' is True, not an integer"),
    "accept_changed_data": (lambda s: s.__setitem__("accept_changed_data", "yes"),
                            r"'accept_changed_data' is 'yes', not true or false"),
}

@pytest.mark.parametrize("case", sorted(CASES))
def test_every_field_of_an_edited_state_is_checked(case: str, state: dict[str, Any]) -> None:
    edit, match = CASES[case]
    refused(shuffled_pipe(), hostile(state, edit), match)


def test_a_state_without_its_optional_keys_still_loads(state: dict[str, Any]) -> None:
    """Older states lack epoch, round_robin, deterministic and epoch_boundaries."""
    def strip(s: dict[str, Any]) -> None:
        for key in ("epoch", "round_robin", "deterministic"):
            s.pop(key)
        for entry in s["lanes"].values():
            entry.pop("epoch_boundaries")
    pipe = shuffled_pipe()
    it = pipe.iter(runner="inline")
    it.load_state_dict(hostile(state, strip))
    assert_same(collect(pipe, runner="inline")[7:], list(it), label="an older state")


# ---------------------------------------------------------------- a mixture, the loader


def mixture() -> Pipeline:
    return (Pipeline.from_sources([zd.items([f"a{i}" for i in range(60)]),
                                   zd.items([f"b{i}" for i in range(60)], component_id=1)],
                                  weights=[3, 1], num_lanes=2, chunk_size=4,
                                  flush_every_k_chunks=2)
            .shuffle(4, seed=1).batch(2))


def test_mixture_counts_far_from_the_weights_are_refused() -> None:
    state = saved(mixture(), 5)
    nxt = lane(state)["next"]
    assert nxt[1] > nxt[2]  # 3 to 1

    def swap(s: dict[str, Any]) -> None:
        lane(s)["next"] = [nxt[0], nxt[2], nxt[1]]  # the same total, other shares
    refused(mixture(), hostile(state, swap), r"lane 0: 'next' is \[\d+, \d+, \d+\], where "
                                             r"dataset 0 counts \d+ samples; at global chunk "
                                             r"\d+ its weight 0.75 gives about")


def test_every_state_the_pipeline_writes_loads_and_resumes_exactly() -> None:
    """Restore at every step (a mixture that ends; one-lane-per-rank states; the end)."""
    for pipe, kwargs in ((mixture(), {}), (shuffled_pipe(), {"rank": 1, "world_size": 2}),
                         (zt.Pipeline.from_items([f"d{i}" for i in range(30)], num_lanes=3,
                                                 chunk_size=2).batch(4), {})):
        reference = collect(pipe, runner="inline", **kwargs)
        it = pipe.iter(runner="inline", **kwargs)
        for step in range(len(reference) + 1):
            state = json.loads(json.dumps(it.state_dict()))
            resumed = pipe.iter(runner="inline", **kwargs)
            resumed.load_state_dict(state)
            assert_same(reference[step:], list(resumed), label=f"resumed at {step}")
            if step < len(reference):
                next(it)


def test_the_dataloader_refuses_an_edited_state_at_load_state_dict(
        state: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    edited = hostile(state, lambda s: lane(s).__setitem__("next", lane(s, "1")["next"]))
    loader = zt.DataLoader(shuffled_pipe(), runner="inline", to_training=False)
    with pytest.raises(ValueError, match=r"lane 0: 'next' global chunk is \d+, a chunk of "
                                         r"lane 1"):
        loader.load_state_dict(edited)
    loader.close()


def test_a_rank_state_on_another_world_size_says_merge_and_gather_at_save_time() -> None:
    pipe = shuffled_pipe()
    rank_state = saved(pipe, 2, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"no entry for lane\(s\) \[0, 2\] \(it holds lanes "
                                         r"\[1, 3\]\).*merge_states\(\).*only one rank wrote "
                                         r"the checkpoint.*state_dict\(gather=True\)"):
        pipe.iter(runner="inline").load_state_dict(rank_state)


def test_another_ranks_state_of_an_ended_epoch_is_refused_not_taken_as_finished():
    # Rank 0 (lanes 0, 2) runs its epoch out and saves its own state: every lane of it
    # ended. Rank 1 (lanes 1, 3) loading it used to take the epoch as over and skip its
    # own unread lanes, going silently on with epoch 1.
    pipe = zt.Pipeline.from_items([f"d{i}" for i in range(40)], num_lanes=LANES,
                                  chunk_size=2).batch(2)
    first = zt.DataLoader(pipe, to_training=False, rank=0, world_size=2)
    assert sum(1 for _ in first) == 10
    state = first.state_dict()
    other = zt.DataLoader(pipe, to_training=False, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"no entry for lane\(s\) \[1, 3\] .*gather=True"):
        other.load_state_dict(state)
    assert other.epoch == 0
    # Its own rank's ended state still loads: the next iteration is epoch 1.
    again = zt.DataLoader(pipe, to_training=False, rank=0, world_size=2)
    again.load_state_dict(state)
    assert again.epoch == 1
    assert sum(1 for _ in again) == 10
