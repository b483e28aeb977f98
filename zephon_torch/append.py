"""``Pipeline.append_shards``: resume a state over a dataset whose file list grew.

The caller builds the pipeline over the grown files (the same glob now
matching more files, or a longer list) and calls
``grown.append_shards(state=state)``. The state's shards must all be there,
unchanged and in their place (same name, sample count and content digest),
the new ones after them in the dataset's shard order; then the new shards
join at the dataset's *next pass boundary* after the state's change point
(the highest global chunk of any lane's ``next``, ``weight_plan.change_point``):
every chunk the state has registered, replays or regenerates before that
point reads the old shards exactly as the saved run did, the pass in progress
is finished over them, and from the next pass on each pass runs over the
grown list, in the seeded order a fresh pipeline over it gives that pass
(``sources/shard_growth.py``). The pass depends on the whole state, never on
the world size, so any world size resuming the same global state runs the
same stream.

The growth travels in the pipeline's fingerprint (a ``shard_growth`` part),
so the states it saves carry it: a relaunched job runs the same line on the
pipeline over the files as they are then, and gets the growths back from the
state (adding one only where shards were appended since). One dataset only:
a mixture component that grows is refused for now (its share and its end
follow its size).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from zephon_torch.checkpoint import check_state
from zephon_torch.epochs import state_epoch
from zephon_torch.fingerprint import fingerprint_parts
from zephon_torch.sources.base import parse_content_table
from zephon_torch.sources.shard_growth import (
    ShardGrowth,
    growth_from_json,
    growth_of,
    join_pass,
    segments,
    shards_problem,
    with_growth,
)
from zephon_torch.sources.weight_plan import change_point, next_before

if TYPE_CHECKING:
    from zephon_torch.pipeline import Pipeline

__all__ = ["append_shards"]

_ACTION = "append_shards"


def append_shards(pipeline: Pipeline, *, state: Mapping[str, Any]) -> Pipeline:
    """``pipeline`` (over the grown files) reading its new shards from the state's next pass.

    Args:
        pipeline: The pipeline ``state`` was saved by, built over the files as
            they are now: the state's shards first, unchanged, new ones after.
        state: A whole state (every lane's entry: a ``merge_states`` or
            gathered one) saved by the pipeline before the files grew (or by
            one this function made).

    Raises:
        ValueError: More than one dataset, a state that is not the pipeline's
            (other settings or operators), shards of the state removed,
            changed in place or reordered, lanes missing or ended, or a
            dataset with no pass left for the new shards to join.
    """
    source = pipeline.source
    if len(source.datasets) != 1:
        raise ValueError(f"{_ACTION}: the pipeline reads {len(source.datasets)} datasets; shards "
                         "appended to a mixture component are not supported yet (its share and "
                         "its end follow its size): start a new run, or resume on the files the "
                         "state was saved with")
    fingerprint = state.get("fingerprint") if isinstance(state, Mapping) else None
    if not isinstance(fingerprint, Mapping):
        raise ValueError(f"{_ACTION}: corrupted state: its 'fingerprint' is missing")
    saved_data = fingerprint.get("data")
    if not isinstance(saved_data, list) or len(saved_data) != 1 \
            or not isinstance(saved_data[0], Mapping) \
            or not isinstance(saved_data[0].get("shards"), str):
        raise ValueError(f"{_ACTION}: the state has no content table of its dataset's shards "
                         "(saved by a zephon_torch from before they existed, or over another "
                         "number of datasets), so which shards are new cannot be told; resume "
                         "on the files it was saved with")
    dataset = source.datasets[0]
    saved = [ShardGrowth(n, p, e) for d, n, p, e in
             growth_from_json(fingerprint.get("shard_growth")) if d == 0]
    own = growth_of(dataset)
    if own and list(own) != saved[:len(own)]:
        raise ValueError(f"{_ACTION}: the pipeline's own appended shards are not those of the "
                         "state; pass the pipeline as built over the files (Pipeline.from_*)")
    now_table = fingerprint_parts(pipeline.fingerprint())["data"][0]["shards"]
    if now_table is None:
        raise ValueError(f"{_ACTION}: dataset {dataset.name!r} has no content table, so which "
                         "shards are new cannot be told")
    now = parse_content_table(now_table)
    try:
        then = parse_content_table(saved_data[0]["shards"])
    except ValueError:
        raise ValueError(f"{_ACTION}: corrupted state: the content table of its dataset is "
                         "malformed; nothing was loaded") from None
    names = [s.name for s in dataset.shards()]
    problem = shards_problem(f"dataset {dataset.name!r}", names, now, then)
    if problem:
        raise ValueError(f"{_ACTION}: {problem}")
    base = pipeline.with_source(datasets=(with_growth(dataset, saved),))
    if len(now) == len(then):  # nothing appended since (a relaunch): the state's growths
        check_state(state, base.fingerprint(), stage_names=base.stage_names())
        return base
    epoch = state_epoch(state)
    # Checks the state against the pipeline (its settings, operators, the old shards'
    # contents) before its lanes are read; the pass joined at is set below.
    trial = pipeline.with_source(datasets=(with_growth(dataset, [*saved, ShardGrowth(
        len(then), 0, epoch)]),))
    check_state(state, trial.fingerprint(), stage_names=trial.stage_names())
    num_lanes = int(state["num_lanes"])
    trips = dataset.passes if dataset.passes is not None else source.passes
    lanes = state["lanes"]
    if any(str(lane) in lanes and lanes[str(lane)]["next"] is None for lane in range(num_lanes)):
        raise ValueError(
            f"{_ACTION}: the saved stream over dataset {dataset.name!r} has ended (a lane has "
            f"no next chunk: its {trips} pass(es) are done), so the new shard(s) "
            f"{names[len(then)]!r}{' ...' if len(now) > len(then) + 1 else ''} have no pass "
            "to join. Read them in a run of their own (a pipeline over them alone)"
        )
    point = change_point(state, num_lanes, action=_ACTION)
    reached = int(next_before(state, point)[1])  # type: ignore[index]
    in_force = [g for g in saved if g.epoch == epoch]
    first, start, _, size = segments(in_force, [e.samples for e in then])[-1]
    join = first + join_pass(max(reached - start, 0), size)
    if trips is not None and join >= trips:
        raise ValueError(
            f"{_ACTION}: dataset {dataset.name!r} is read for {trips} pass(es) and the state "
            f"is in pass {join - 1}, its last: the new shard(s) {names[len(then)]!r}"
            f"{' ...' if len(now) > len(then) + 1 else ''} would join at pass {join}, which "
            "never comes. Finish this run on the files it was saved with and read the new "
            "shards in a run of their own (a pipeline over them alone)"
        )
    grown = with_growth(dataset, [*saved, ShardGrowth(len(then), join, epoch)])
    return pipeline.with_source(datasets=(grown,))
