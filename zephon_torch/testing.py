"""The operator contract, as checks you can run on any pipeline.

Every built-in operator passes these checks, and an operator of your own
should too (see ``docs/writing-an-operator.md``)::

    from zephon_torch.testing import check_operator_contract

    def test_my_operator_keeps_the_contract():
        check_operator_contract(lambda: zt.Pipeline.from_items(texts, num_lanes=4,
                                                               chunk_size=5)
                                .apply(MyOperator()))

:func:`check_operator_contract` runs the four parts of the contract:

- **deterministic** (:func:`assert_deterministic`): every runner, worker
  count and micro-batch size gives exactly the inline output;
- **elastic** (:func:`assert_elastic`): each lane's output is the same
  whatever the number of ranks;
- **conserved** (:func:`assert_conserved`): every input sample is delivered
  (closed once) or tombstoned, none twice;
- **restores everywhere** (:func:`assert_restores_everywhere`): a checkpoint
  taken after any number of outputs, resumed in a fresh iterator, continues
  with exactly the rest of the uninterrupted run.

The checks compare outputs *exactly*: metas (cursor keys, lanes, chunks,
contributors, tags, component counts) and payloads by value (arrays element
by element, with their dtype). They raise ``AssertionError`` naming the
setting and the first output that differs. They use only the public
``Pipeline.iter`` and import neither torch nor pytest.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from zephon_torch.pipeline import Pipeline
from zephon_torch.runners.options import RUNNERS as _REGISTERED_RUNNERS
from zephon_torch.types import SampleBatch, SampleRecord, payloads_equal

__all__ = [
    "DEFAULT_RESUME_SETTINGS",
    "RUNNERS",
    "assert_conserved",
    "assert_deterministic",
    "assert_elastic",
    "assert_restores_everywhere",
    "assert_same",
    "check_operator_contract",
    "closed_samples",
    "collect",
    "describe",
    "lane_of",
    "matrix",
    "per_lane",
    "small_microbatch_sizes",
    "token_total",
]

#: Every runner a pipeline can run on (``runners/registry.py``'s, in its order).
RUNNERS = _REGISTERED_RUNNERS


def collect(pipe: Pipeline, **iter_kwargs: Any) -> list[Any]:
    """Every output of one iterator (``pipe.iter(**iter_kwargs)``), closing it afterwards."""
    it = pipe.iter(**iter_kwargs)
    try:
        return list(it)
    finally:
        it.close()


def lane_of(elem: Any) -> int:
    """The lane of an output record or batch."""
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


def small_microbatch_sizes(pipe: Pipeline, size: int) -> dict[str, int]:
    """``{stage: size}`` for every stage whose micro-batch size is a performance knob.

    Stages whose size defines the output (``batch``, ``shuffle``,
    ``ensure_mixture``) refuse an override and are left out.
    """
    sizes = {}
    for name in pipe.stage_names():
        try:
            pipe.compile({name: size})
        except ValueError:
            continue
        sizes[name] = size
    return sizes


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
    """Every input sample is delivered (closed once) or tombstoned; nothing twice.

    Runs ``pipe.iter(**iter_kwargs)`` to its end and returns its ``stats()``.
    (:func:`zephon_torch.checks.assert_conserved` checks the counts of an
    iterator you ran yourself.)
    """
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


#: Where a resume runs in :func:`check_operator_contract`, in turn.
DEFAULT_RESUME_SETTINGS: tuple[Mapping[str, Any], ...] = (
    {"runner": "inline"},
    {"runner": "threads", "num_workers": 2},
)


def check_operator_contract(
    pipeline: Pipeline | Callable[[], Pipeline],
    *,
    runners: Sequence[str] = RUNNERS,
    workers: Sequence[int] = (1, 2, 4),
    microbatch_sizes: Sequence[Mapping[str, int] | None] | None = None,
    settings: Sequence[Mapping[str, Any]] | None = None,
    world_sizes: Sequence[int] = (1, 2, 4),
    cut_points: Sequence[int] | None = None,
    resume_settings: Sequence[Mapping[str, Any]] = DEFAULT_RESUME_SETTINGS,
    **iter_kwargs: Any,
) -> list[Any]:
    """Run the whole operator contract on a pipeline that uses the operator.

    Keep the pipeline small (tens of samples, a few lanes, small chunks and a
    short ``flush_every_k_chunks``): the restore check runs it about twice
    per output.

    Args:
        pipeline: The pipeline, or a function that builds it.
        runners: The runners of the determinism matrix.
        workers: Its worker counts.
        microbatch_sizes: Its micro-batch overrides (``None`` in the list: each
            operator's default). ``None`` (the default): the defaults, 1 and
            3 for every stage whose size is a performance knob
            (:func:`small_microbatch_sizes`).
        settings: The determinism settings, given one by one instead of
            the matrix of ``runners``, ``workers`` and ``microbatch_sizes``
            (to spend fewer process start-ups, for example).
        world_sizes: The numbers of ranks of the elasticity check.
        cut_points: The numbers of outputs after which the restore check
            takes a checkpoint (``None``: after every output, and before the
            first).
        resume_settings: Where the resumed runs go, in turn (default: inline
            and two threads).
        **iter_kwargs: Passed to every ``pipe.iter`` (``epoch=2`` checks
            another epoch).

    Returns:
        The inline output (the reference every check compared with).

    Raises:
        AssertionError: A part of the contract does not hold (or the
            pipeline produced nothing, which would prove nothing); the
            message names the setting and the first output that differs.
    """
    pipe = pipeline if isinstance(pipeline, Pipeline) else pipeline()
    reference = collect(pipe, runner="inline", **iter_kwargs)
    assert reference, f"{pipe!r} produced nothing: the contract needs some output to compare"
    if settings is None:
        if microbatch_sizes is None:
            microbatch_sizes = (None, small_microbatch_sizes(pipe, 1),
                                small_microbatch_sizes(pipe, 3))
        distinct: list[Mapping[str, int] | None] = []
        for sizes in microbatch_sizes:  # an empty override is the defaults again
            sizes = sizes or None
            if sizes not in distinct:
                distinct.append(sizes)
        settings = matrix(runners, workers, distinct)
    assert_deterministic(pipe, [{**s, **iter_kwargs} for s in settings], reference)
    assert_elastic(pipe, world_sizes, **iter_kwargs)
    assert_conserved(pipe, runner="inline", **iter_kwargs)
    restored = assert_restores_everywhere(pipe, cut_points=cut_points,
                                          resume_settings=resume_settings, **iter_kwargs)
    assert_same(reference, restored, label="the restore check's own reference")
    return reference
