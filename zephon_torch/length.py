"""How many items a pass yields, when that is known without reading the data.

``len(loader)`` and Lightning's progress bar want the number of batches of an
epoch. For most pipelines it depends on the data: ``decode_text`` turns
empty documents into tombstones, ``filter`` and ``map_transform`` drop what
they drop, the packers fill rows by document lengths, ``ensure_mixture``
holds back what it holds back. An upper bound would make a training loop
wait for batches that never come, so :func:`num_batches` gives an exact
count or ``None``, nothing in between.

**When the count is exact.** The number of samples each lane reads is a
pure function of the configuration (the work schedule: dataset sizes,
``passes``, weights, ``chunk_size``, ``num_lanes``), so it is exact when every
sample read reaches ``batch`` (or the end) as one record:

* every ``passes`` is finite;
* the sources cannot make tombstones: every dataset has
  ``on_error="raise"``, no shard is read as a stream (compressed JSONL:
  empty lines would be tombstones), and in-memory items hold no empty text
  (checked here: the items are in memory);
* the chain holds only ``fetch``, ``tokenize``, ``shuffle`` and at the end
  one ``batch``, each with ``on_error="raise"``, plus ``decode_text`` over
  in-memory items (an empty text in a file is only seen by reading it).

Per lane, ``shuffle`` keeps the count, and ``batch(b)`` gives ``n // b``
batches with ``drop_last=True`` (it never cuts a partial batch mid-stream),
and with ``drop_last=False`` one batch per ``b`` records or part thereof in
each flush period of the lane (a flush sentinel sends the partial batch
out). A rank owns the lanes ``l % world_size == rank``, so its count is the
sum over them; ranks may differ by a batch or so.

The count is the same in every epoch (epochs reorder, they do not change
what each lane reads). Anything else is ``None``, and
:func:`unknown_reason` says why.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from zephon_torch.sources.lane_plan import lane_count
from zephon_torch.sources.schedule import WorkSchedule
from zephon_torch.topology import owned_lanes
from zephon_torch.vocab import empty_text_rows, is_empty_text

if TYPE_CHECKING:
    from zephon_torch.pipeline import Pipeline

__all__ = ["lane_records", "num_batches", "unknown_reason"]


def unknown_reason(pipeline: Pipeline) -> str | None:
    """Why the pipeline's item count is not known in advance (None: it is).

    Every cause is named, in the order of the chain (datasets, then stages,
    then what only the data shows), separated by ``"; "``: a JSONL pipeline
    that packs is data-dependent both because ``decode_text`` may meet empty
    documents and because ``pack_flat`` fills rows by length, and removing
    only the first would not give it a count. The data itself (in-memory
    items with empty texts) is only looked at when nothing else decides.
    """
    from zephon_torch.ops.batch import Batch
    from zephon_torch.ops.io import DecodeText, Fetch
    from zephon_torch.ops.shuffle import Shuffle
    from zephon_torch.ops.tokenize import Tokenize

    src = pipeline.source
    datasets = src.datasets
    reasons: list[str] = []
    if getattr(src, "lane_changes", ()):
        reasons.append("the lanes grew part-way through the run (Pipeline.change_lanes): a "
                       "rank's share of the stream differs from epoch to epoch")
    for dataset in datasets:
        trips = dataset.passes if dataset.passes is not None else src.passes
        if trips is None:
            reasons.append(f"dataset {dataset.name!r} repeats forever (passes=None)")
        if getattr(dataset, "on_error", "raise") != "raise":
            reasons.append(f"dataset {dataset.name!r} has on_error={dataset.on_error!r}: bad "
                           "samples become tombstones")
    in_memory = all(s.access == "inline" for d in datasets for s in d.shards())
    ops = pipeline.ops
    names = pipeline.stage_names()
    for i, (name, op) in enumerate(zip(names, ops)):
        kind = type(op)
        if kind is Batch:
            if i != len(ops) - 1:
                reasons.append(f"{name} is followed by other stages")
        elif kind is DecodeText and not in_memory:
            reasons.append(f"{name} turns empty documents of files into tombstones (seen only "
                           "by reading)")
        elif kind not in (Fetch, DecodeText, Tokenize, Shuffle):
            reasons.append(f"{name} may drop, merge or hold back records")
        if kind in (Batch, Fetch, DecodeText, Tokenize, Shuffle) and getattr(
                op, "on_error", "raise") != "raise":
            reasons.append(f"{name} has on_error={op.on_error!r}: bad samples become "
                           "tombstones")
    for dataset in datasets:
        stream = next((shard for shard in dataset.shards() if shard.access == "stream"), None)
        if stream is not None:
            reasons.append(f"dataset {dataset.name!r} is read as a stream ({stream.name}): "
                           "empty documents become tombstones")
    if reasons:
        return "; ".join(reasons)
    fields = {op.field for op in ops if type(op) is DecodeText}
    for dataset in datasets:
        if dataset.kind != "items" or not len(dataset):
            continue
        payloads = dataset.read(0, range(len(dataset)))
        if empty_text_rows(payloads) or any(
                type(p) is dict and type(p.get(f)) is str and is_empty_text(p[f])
                for p in payloads for f in fields):
            reasons.append(f"dataset {dataset.name!r} holds empty texts, which become "
                           "tombstones wherever the order puts them")
    return "; ".join(reasons) or None


def lane_records(pipeline: Pipeline) -> dict[int, list[int]] | None:
    """Per lane, the sizes of its chunks in order (None: an endless stream).

    A walk over the work schedule (``WorkSchedule.advance``), which never
    computes a pointer: one step per chunk for a single dataset, one per
    sample for a mixture.
    """
    src = pipeline.source
    schedule = WorkSchedule.for_source(src)
    if any(limit == float("inf") for limit in schedule.limits):
        return None
    if schedule.length_warning:  # before a walk that may take a while
        warnings.warn(schedule.length_warning, RuntimeWarning, stacklevel=4)
    sizes: dict[int, list[int]] = {lane: [] for lane in range(schedule.total_lanes)}
    state = schedule.initial_state()
    while True:
        components, nxt = schedule.advance(state)
        if components is None:
            return sizes
        sizes[schedule.lane_of(state.global_chunk)[0]].append(len(components))
        state = nxt


def num_batches(pipeline: Pipeline, *, rank: int | None = None, world_size: int | None = None,
                lanes: Sequence[int] | None = None) -> int | None:
    """The number of items one pass of ``pipeline`` yields to a rank, or None.

    Items are batches when the chain ends in ``batch``, else records. Exact
    or None (see the module doc and :func:`unknown_reason`); the same in
    every epoch.

    Args:
        rank, world_size: The topology, as for ``Pipeline.iter`` (default:
            ``torch.distributed``, then ``RANK``/``WORLD_SIZE``, then 0 and 1).
        lanes: An explicit subset of lanes instead of the rank's.
    """
    from zephon_torch.ops.batch import Batch
    from zephon_torch.topology import resolve_topology

    rank, world_size = resolve_topology(rank, world_size)
    owned = owned_lanes(lane_count(pipeline.source), rank, world_size, lanes)
    if unknown_reason(pipeline) is not None:
        return None
    sizes = lane_records(pipeline)
    if sizes is None:
        return None
    last = pipeline.ops[-1] if pipeline.ops else None
    if type(last) is not Batch:
        return sum(sum(sizes[lane]) for lane in owned)
    size = last.microbatch_size
    if last.drop_last:
        return sum(sum(sizes[lane]) // size for lane in owned)
    period = pipeline.flush_every()
    total = 0
    for lane in owned:
        chunks = sizes[lane]
        spans = [chunks] if not period else [chunks[i:i + period]
                                             for i in range(0, len(chunks), period)]
        total += sum(-(-sum(span) // size) for span in spans)
    return total
