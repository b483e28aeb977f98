"""Shared test harnesses: determinism matrix, elastic lanes, conservation.

Every operator goes through these. They compare outputs *exactly*: metas
(cursor keys, lanes, chunks, contributors, tags, component counts) and
payloads by value (arrays element-wise, with dtype).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.pipeline import Pipeline
from zephon_torch.types import SampleBatch, SampleRecord, payloads_equal

RUNNERS = ("inline", "threads", "process", "lanes")


def collect(pipe: Pipeline, **iter_kwargs: Any) -> list[Any]:
    """Every output of one iterator, closing it afterwards."""
    it = pipe.iter(**iter_kwargs)
    try:
        return list(it)
    finally:
        it.close()


def lane_of(elem: Any) -> int:
    return elem.lane_ids[0] if isinstance(elem, SampleBatch) else elem.meta.lane_id


def per_lane(outputs: Iterable[Any]) -> dict[int, list[Any]]:
    """Outputs grouped by lane, in order."""
    lanes: dict[int, list[Any]] = {}
    for elem in outputs:
        lanes.setdefault(lane_of(elem), []).append(elem)
    return lanes


def describe(elem: Any) -> Any:
    """A comparable, printable form of an element (for assertion messages)."""
    if isinstance(elem, SampleBatch):
        return [describe(r) for r in elem.records]
    meta = elem.meta
    return (meta.as_cursor_key(), meta.lane_id, meta.contribution_cursors())


def assert_same(expected: Sequence[Any], actual: Sequence[Any], label: str = "") -> None:
    """Elements equal one by one: meta and payload, arrays by value and dtype."""
    assert len(actual) == len(expected), (
        f"{label}: {len(actual)} outputs, expected {len(expected)}"
    )
    for i, (a, b) in enumerate(zip(expected, actual)):
        if not _elements_equal(a, b):
            raise AssertionError(
                f"{label}: output {i} differs\n expected {describe(a)}\n actual   {describe(b)}"
            )


def _elements_equal(a: Any, b: Any) -> bool:
    if isinstance(a, SampleBatch):
        return (isinstance(b, SampleBatch) and len(a) == len(b)
                and all(_elements_equal(x, y) for x, y in zip(a, b)))
    if not isinstance(b, SampleRecord):
        return False
    return a.meta == b.meta and payloads_equal(a.payload, b.payload)


def matrix(
    runners: Sequence[str] = RUNNERS,
    workers: Sequence[int] = (1, 2, 4),
    microbatch_sizes: Sequence[Mapping[str, int] | None] = (None,),
) -> list[dict[str, Any]]:
    """The iterator settings of the determinism matrix (inline once: it has no workers)."""
    settings = []
    for runner, n, sizes in itertools.product(runners, workers, microbatch_sizes):
        if runner == "inline" and n != workers[0]:
            continue
        settings.append({"runner": runner, "num_workers": n, "microbatch_sizes": sizes})
    return settings


def assert_deterministic(pipe: Pipeline, settings: Sequence[Mapping[str, Any]],
                         reference: Sequence[Any] | None = None) -> list[Any]:
    """Every setting gives exactly the reference output (default: inline)."""
    if reference is None:
        reference = collect(pipe, runner="inline")
    for setting in settings:
        assert_same(reference, collect(pipe, **setting), label=str(dict(setting)))
    return list(reference)


def assert_elastic(pipe: Pipeline, world_sizes: Sequence[int] = (1, 2, 4),
                   runner: str = "inline", **iter_kwargs: Any) -> None:
    """Each lane's output is the same whatever the number of ranks."""
    reference = per_lane(collect(pipe, runner=runner, rank=0, world_size=1, **iter_kwargs))
    for world in world_sizes:
        lanes: dict[int, list[Any]] = {}
        for rank in range(world):
            out = collect(pipe, runner=runner, rank=rank, world_size=world, **iter_kwargs)
            for lane, items in per_lane(out).items():
                assert lane % world == rank, f"rank {rank}/{world} got lane {lane}"
                lanes[lane] = items
        assert sorted(lanes) == sorted(reference), f"world {world}: lanes {sorted(lanes)}"
        for lane, items in reference.items():
            assert_same(items, lanes[lane], label=f"world {world} lane {lane}")


def closed_samples(outputs: Iterable[Any]) -> list[tuple[int, int, tuple[int, int, int]]]:
    """Base samples closed by the delivered outputs: (chunk_id, offset, sample_id) per close."""
    closed = []
    for elem in outputs:
        records = elem.records if isinstance(elem, SampleBatch) else (elem,)
        for record in records:
            for ref in record.meta.contribution_refs():
                if ref.is_last_child:
                    c = ref.cursor
                    closed.append((c.chunk_id, c.chunk_offset, c.sample_id))
    return closed


def assert_conserved(pipe: Pipeline, **iter_kwargs: Any) -> dict[str, Any]:
    """Every input sample is delivered (closed once) or tombstoned; nothing twice."""
    it = pipe.iter(**iter_kwargs)
    try:
        outputs = list(it)
        stats = it.stats()
    finally:
        it.close()
    closed = closed_samples(outputs)
    assert len(closed) == len(set(closed)), "a base sample was closed twice"
    assert stats["delivered"] == len(closed)
    assert stats["read"] == stats["delivered"] + stats["tombstoned"], stats
    for lane, counts in stats["lanes"].items():
        tomb = sum(counts["tombstoned"].values())
        assert counts["read"] == counts["delivered"] + tomb, (lane, counts)
    return stats


def token_total(outputs: Iterable[Any], field: str = "input_ids") -> int:
    """Non-pad tokens delivered (rows minus their recorded trailing padding)."""
    total = 0
    for elem in outputs:
        records = elem.records if isinstance(elem, SampleBatch) else (elem,)
        for record in records:
            payload = record.payload
            tokens = payload[field] if isinstance(payload, dict) else payload
            total += len(np.asarray(tokens)) - (record.meta.padding_length or 0)
    return total


def assert_restores_everywhere(
    pipe: Pipeline,
    *,
    cut_points: Sequence[int] | None = None,
    resume_settings: Sequence[Mapping[str, Any]] = ({"runner": "inline"},),
    max_replayed_per_lane: int | None = None,
    **iter_kwargs: Any,
) -> list[Any]:
    """Checkpoint after k outputs (every k by default), JSON round-trip the state,
    resume in a fresh iterator and check that head + rest equals the uninterrupted run.

    Resumes cycle through ``resume_settings`` (other runners, worker counts).
    """
    import json

    iter_kwargs.setdefault("runner", "inline")
    reference = collect(pipe, **iter_kwargs)
    points = range(len(reference) + 1) if cut_points is None else cut_points
    for n, k in enumerate(points):
        it = pipe.iter(**iter_kwargs)
        try:
            head = [next(it) for _ in range(k)]
            state = json.loads(json.dumps(it.state_dict()))
        finally:
            it.close()
        setting = dict(resume_settings[n % len(resume_settings)])
        resumed = pipe.iter(**{**iter_kwargs, **setting})
        try:
            resumed.load_state_dict(state)
            rest = list(resumed)
            replayed = resumed.stats()["replayed_by_lane"]
        finally:
            resumed.close()
        assert_same(reference, head + rest, label=f"cut at {k}, resumed with {setting}")
        if max_replayed_per_lane is not None:
            worst = max(replayed.values(), default=0)
            assert worst <= max_replayed_per_lane, (k, replayed)
    return reference
