"""The contenders of ``compare.py``: one function per (job, contender).

Every contender does the same job and hands its batches to :class:`Tally`:

* text job: JSONL -> parse -> tokenize (``encode_batch_fast`` where the installed
  ``tokenizers`` has it, else ``encode_batch``; 256 texts a call)
  with EOS -> pack into flat 2049-token rows with per-document positions ->
  shuffle buffer of 1024 rows -> batches of 8 -> ``input_ids``/``labels``/
  ``positions`` torch ``int64`` tensors of shape ``[8, 2048]`` (labels are the
  next tokens, ``-100`` on padding);
* token job: the same from Parquet shards of pre-tokenized documents (a
  ``list<int32>`` column, EOS already appended), without tokenization.

Documents longer than a row are cut into 2049-token pieces by every
contender (zephon's ``oversized="split"``), so all deliver the same tokens.
:class:`Tally` counts, from the final tensors, the non-pad tokens
(``labels != -100`` plus one per row), the rows, and a checksum (the sum of
every delivered token id; padding is id 0), which must agree across
contenders whatever their packing and shuffle order.

The hand-written pieces (:class:`FirstFit`, :class:`ShuffleBuffer`,
:func:`collate`) are what a careful user writes: first-fit over 8 open bins
in numpy, the same placement rules as zephon's ``pack_flat`` (the first open
bin that fits; with 8 open and none fitting, the fullest goes out; a full
bin goes out at once; a piece of a whole row is a row on its own). They
serve the ``handwritten``, ``torchdata.nodes`` and ``DataLoader``
contenders; Grain uses its own ``FirstFitPackIterDataset`` and
``WindowShuffleIterDataset`` (it has no streaming shuffle buffer).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _compare_data import ENCODE_BATCH, EOS_TOKEN, ROW

BINS = 8
SHUFFLE = 1024
BATCH = 8
CHUNK_LINES = 256  # JSONL lines per chunk handed to a worker / encode_batch
WORKERS_DEFAULT = 2


# --------------------------------------------------------------------------- the consumer


class Tally:
    """What a training loop sees: counts non-pad tokens, rows and a token checksum."""

    def __init__(self) -> None:
        self.tokens = 0
        self.rows = 0
        self.batches = 0
        self.checksum = 0

    def add(self, input_ids: Any, labels: Any, positions: Any) -> None:
        """Account one batch of ``int64`` tensors ``[B, ROW - 1]``."""
        rows = int(input_ids.shape[0])
        if labels.shape != input_ids.shape or positions.shape != input_ids.shape:
            raise ValueError(f"shape mismatch: input_ids {tuple(input_ids.shape)}, labels "
                             f"{tuple(labels.shape)}, positions {tuple(positions.shape)}")
        self.tokens += int((labels != -100).sum()) + rows
        self.rows += rows
        self.batches += 1
        self.checksum += int(input_ids.sum()) + int(labels[:, -1].clamp(min=0).sum())

    def result(self) -> dict[str, int]:
        """The counts, as JSON-ready numbers."""
        return {"tokens": self.tokens, "rows": self.rows, "batches": self.batches,
                "checksum": self.checksum}


# --------------------------------------------------------------------------- shared pieces


def load_tokenizer(path: str) -> tuple[Any, int]:
    """The trained tokenizer and its EOS id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    return tok, tok.token_to_id(EOS_TOKEN)


def encoder(tok: Any) -> Any:
    """The fastest batch call the installed ``tokenizers`` offers: ``encode_batch_fast``
    (0.20+, no character offsets; zephon's tokenize uses it too), else ``encode_batch``."""
    return getattr(tok, "encode_batch_fast", None) or tok.encode_batch


def encode_texts(tok: Any, eos: int, texts: list[str]) -> list[np.ndarray]:
    """:func:`encoder` + EOS, each document an ``int32`` array."""
    docs = []
    for enc in encoder(tok)(texts, add_special_tokens=False):
        ids = enc.ids
        doc = np.empty(len(ids) + 1, dtype=np.int32)
        doc[:-1] = ids
        doc[-1] = eos
        docs.append(doc)
    return docs


def line_chunks(files: Iterable[str], worker: int = 0, num_workers: int = 1
                ) -> Iterator[list[bytes]]:
    """Chunks of ``CHUNK_LINES`` raw JSONL lines; worker ``k`` of ``n`` takes every n-th."""
    index = 0
    for path in files:
        with open(path, "rb") as fh:
            chunk: list[bytes] = []
            for line in fh:
                chunk.append(line)
                if len(chunk) == CHUNK_LINES:
                    if index % num_workers == worker:
                        yield chunk
                    index += 1
                    chunk = []
            if chunk:
                if index % num_workers == worker:
                    yield chunk
                index += 1


def parse_lines(lines: list[bytes]) -> list[str]:
    """The ``text`` of each JSONL line."""
    return [json.loads(line)["text"] for line in lines]


def row_groups(files: Iterable[str], worker: int = 0, num_workers: int = 1
               ) -> Iterator[tuple[str, int]]:
    """``(file, row group)`` pairs of Parquet shards; worker ``k`` of ``n`` takes every n-th."""
    import pyarrow.parquet as pq

    index = 0
    for path in files:
        for group in range(pq.ParquetFile(path).metadata.num_row_groups):
            if index % num_workers == worker:
                yield path, group
            index += 1


def read_row_group(path: str, group: int) -> list[np.ndarray]:
    """The documents of one row group, as ``int32`` views into one decoded buffer."""
    import pyarrow.parquet as pq

    column = pq.ParquetFile(path).read_row_group(group, columns=["input_ids"]).column(0)
    column = column.combine_chunks()
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy()
    offsets = offsets - offsets[0] if offsets[0] else offsets
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def pieces(doc: np.ndarray) -> Iterator[np.ndarray]:
    """A document cut into pieces of at most ``ROW`` tokens."""
    if len(doc) <= ROW:
        yield doc
        return
    for start in range(0, len(doc), ROW):
        yield doc[start:start + ROW]


def make_row(parts: list[np.ndarray]) -> tuple[np.ndarray, int, np.ndarray]:
    """A flat row from its pieces: tokens (padded with 0), tokens used, positions."""
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int32, count=len(parts))
    used = int(lengths.sum())
    row = np.zeros(ROW, dtype=np.int32)
    np.concatenate(parts, out=row[:used])
    if used < ROW:
        lengths = np.append(lengths, ROW - used)  # padding restarts at 0 as its own segment
    starts = np.cumsum(lengths) - lengths
    positions = np.arange(ROW, dtype=np.int32) - np.repeat(starts, lengths).astype(np.int32)
    return row, used, positions


class FirstFit:
    """First-fit (or best-fit) packing into ``ROW``-token rows with ``bins`` open bins."""

    def __init__(self, bins: int = BINS, best: bool = False) -> None:
        self.bins = bins
        self.best = best
        self.used: list[int] = []
        self.parts: list[list[np.ndarray]] = []

    def add(self, doc: np.ndarray) -> list[tuple[np.ndarray, int, np.ndarray]]:
        """Place a document's pieces; return the rows this closes."""
        out = []
        used, parts = self.used, self.parts
        for piece in pieces(doc):
            n = len(piece)
            if n == ROW:
                out.append(make_row([piece]))
                continue
            limit = ROW - n
            index = -1
            if self.best:
                best_used = -1
                for i, u in enumerate(used):
                    if best_used < u <= limit:
                        index, best_used = i, u
            else:
                for i, u in enumerate(used):
                    if u <= limit:
                        index = i
                        break
            if index < 0:
                if len(used) == self.bins:
                    full = used.index(max(used))
                    used.pop(full)
                    out.append(make_row(parts.pop(full)))
                used.append(n)
                parts.append([piece])
                continue
            used[index] += n
            parts[index].append(piece)
            if used[index] == ROW:
                used.pop(index)
                out.append(make_row(parts.pop(index)))
        return out

    def flush(self) -> list[tuple[np.ndarray, int, np.ndarray]]:
        """The open bins, in opening order."""
        out = [make_row(p) for p in self.parts]
        self.used, self.parts = [], []
        return out


class ShuffleBuffer:
    """A streaming shuffle: hold ``size`` items, hand out a random one for each new one."""

    def __init__(self, size: int = SHUFFLE, seed: int = 0) -> None:
        self.size = size
        self.items: list[Any] = []
        self.rng = random.Random(seed)

    def push(self, item: Any) -> Any | None:
        """Add an item; once full, return a random held one (else None)."""
        items = self.items
        if len(items) < self.size:
            items.append(item)
            return None
        i = self.rng.randrange(self.size)
        out, items[i] = items[i], item
        return out

    def drain(self) -> list[Any]:
        """What is left, in random order."""
        self.rng.shuffle(self.items)
        out, self.items = self.items, []
        return out


def collate(rows: list[tuple[np.ndarray, int, np.ndarray]]) -> dict[str, Any]:
    """``input_ids``/``labels``/``positions`` int64 tensors of a batch of rows."""
    import torch

    tokens = torch.from_numpy(np.stack([r[0] for r in rows])).long()
    used = torch.tensor([r[1] for r in rows])
    positions = torch.from_numpy(np.stack([r[2] for r in rows])[:, :-1]).long()
    labels = tokens[:, 1:].clone()
    labels[torch.arange(ROW - 1)[None, :] >= (used - 1)[:, None]] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels, "positions": positions}


def pack_shuffle_batch(docs: Iterable[np.ndarray], seed: int = 0) -> Iterator[dict[str, Any]]:
    """First-fit packing -> shuffle buffer -> batches of 8 -> tensors, as one generator."""
    packer, buffer, batch = FirstFit(), ShuffleBuffer(seed=seed), []

    def rows() -> Iterator[tuple[np.ndarray, int, np.ndarray]]:
        for doc in docs:
            yield from packer.add(doc)
        yield from packer.flush()

    for row in rows():
        out = buffer.push(row)
        if out is not None:
            batch.append(out)
            if len(batch) == BATCH:
                yield collate(batch)
                batch = []
    for row in buffer.drain():
        batch.append(row)
        if len(batch) == BATCH:
            yield collate(batch)
            batch = []
    if batch:
        yield collate(batch)


def _consume(batches: Iterable[dict[str, Any]]) -> dict[str, int]:
    tally = Tally()
    for b in batches:
        tally.add(b["input_ids"], b["labels"], b["positions"])
    return tally.result()


# --------------------------------------------------------------------------- text sources


def text_docs(files: list[str], tokenizer: str) -> Iterator[np.ndarray]:
    """The hand-written reader: chunks of lines -> parse -> :func:`encoder` + EOS."""
    tok, eos = load_tokenizer(tokenizer)
    for lines in line_chunks(files):
        yield from encode_texts(tok, eos, parse_lines(lines))


def token_docs(files: list[str]) -> Iterator[np.ndarray]:
    """The hand-written Parquet reader: row group by row group."""
    for path, group in row_groups(files):
        yield from read_row_group(path, group)


# --------------------------------------------------------------------------- contenders


def tokenize_only(files: list[str], tokenizer: str, **_: Any) -> Any:
    """The floor: :func:`encoder` over texts already in memory (loaded before the clock)."""
    tok, _eos = load_tokenizer(tokenizer)
    texts = [t for lines in line_chunks(files) for t in parse_lines(lines)]
    encode = encoder(tok)

    def run() -> dict[str, int]:
        tokens = 0
        for start in range(0, len(texts), ENCODE_BATCH):
            for enc in encode(texts[start:start + ENCODE_BATCH], add_special_tokens=False):
                tokens += len(enc.ids) + 1
        return {"tokens": tokens, "rows": 0, "batches": 0, "checksum": None}

    return run


def handwritten(job: str, files: list[str], tokenizer: str, **_: Any) -> Any:
    """The plain loop, one process: read, (tokenize), pack, shuffle, batch, collate."""
    def run() -> dict[str, int]:
        docs = text_docs(files, tokenizer) if job == "text" else token_docs(files)
        return _consume(pack_shuffle_batch(docs))

    return run


def _stream_node_class() -> type:
    from torchdata.nodes import BaseNode

    class StreamNode(BaseNode):
        """A torchdata.nodes node running a generator function over its source node."""

        def __init__(self, source: Any, fn: Any) -> None:
            super().__init__()
            self.source = source
            self.fn = fn
            self._it: Iterator[Any] | None = None

        def reset(self, initial_state: dict | None = None) -> None:
            super().reset(initial_state)
            self.source.reset(None)
            self._it = self.fn(self.source)

        def next(self) -> Any:
            return next(self._it)

        def get_state(self) -> dict[str, Any]:
            return {"source": self.source.state_dict()}

    return StreamNode


def torchdata_nodes(job: str, files: list[str], tokenizer: str, workers: int = 2,
                    **_: Any) -> Any:
    """torchdata.nodes: a ParallelMapper (threads) reads and tokenizes chunks in order,
    then nodes for packing + shuffle, a ``Batcher`` and a collating ``Mapper``, in a ``Loader``."""
    from torchdata.nodes import Batcher, IterableWrapper, Loader, Mapper, ParallelMapper

    stream = _stream_node_class()
    if job == "text":
        tok, eos = load_tokenizer(tokenizer)
        source = IterableWrapper(line_chunks(files))

        def work(lines: list[bytes]) -> list[np.ndarray]:
            return encode_texts(tok, eos, parse_lines(lines))
    else:
        source = IterableWrapper(row_groups(files))

        def work(item: tuple[str, int]) -> list[np.ndarray]:
            return read_row_group(*item)

    docs = ParallelMapper(source, work, num_workers=workers, method="thread", in_order=True)

    def pack(chunks: Iterable[list[np.ndarray]]) -> Iterator[Any]:
        packer = FirstFit()
        for chunk in chunks:
            for doc in chunk:
                yield from packer.add(doc)
        yield from packer.flush()

    def shuffle(rows: Iterable[Any]) -> Iterator[Any]:
        buffer = ShuffleBuffer()
        for row in rows:
            out = buffer.push(row)
            if out is not None:
                yield out
        yield from buffer.drain()

    node = Mapper(Batcher(stream(stream(docs, pack), shuffle), BATCH, drop_last=False), collate)

    def run() -> dict[str, int]:
        return _consume(Loader(node))

    return run


class HandwrittenDataset:
    """A ``torch.utils.data.IterableDataset`` (made one lazily): worker k of n takes every
    n-th chunk (JSONL) or row group (Parquet) and packs, shuffles, batches and collates it."""

    def __init__(self, job: str, files: list[str], tokenizer: str) -> None:
        self.job, self.files, self.tokenizer = job, files, tokenizer

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch.utils.data as tud

        info = tud.get_worker_info()
        k, n = (0, 1) if info is None else (info.id, info.num_workers)
        if self.job == "text":
            tok, eos = load_tokenizer(self.tokenizer)
            docs = (doc for lines in line_chunks(self.files, k, n)
                    for doc in encode_texts(tok, eos, parse_lines(lines)))
        else:
            docs = (doc for item in row_groups(self.files, k, n) for doc in read_row_group(*item))
        return pack_shuffle_batch(docs, seed=k)


def torch_dataloader(job: str, files: list[str], tokenizer: str, workers: int = 2,
                     **_: Any) -> Any:
    """``torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)``."""
    import torch.utils.data as tud

    dataset_type = type("PackedBatches", (HandwrittenDataset, tud.IterableDataset), {})
    dataset = dataset_type(job, files, tokenizer)

    def run() -> dict[str, int]:
        loader = tud.DataLoader(dataset, batch_size=None, num_workers=workers)
        return _consume(loader)

    return run


# ------------------------------------------------------------------ grain


class _GrainFileChunks:
    """Grain FlatMap: a JSONL file -> its chunks of lines (a file has at most 2**16)."""

    max_fan_out = 1 << 16

    def flat_map(self, path: str) -> list[list[bytes]]:
        return list(line_chunks([path]))


class _GrainRowGroups:
    """Grain FlatMap: a Parquet file -> its ``(file, row group)`` pairs."""

    max_fan_out = 1 << 16

    def flat_map(self, path: str) -> list[tuple[str, int]]:
        return list(row_groups([path]))


class _GrainPieces:
    """Grain FlatMap: a list of documents -> ``{"input_ids": piece}`` elements."""

    max_fan_out = 1 << 20

    def flat_map(self, docs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [{"input_ids": p} for doc in docs for p in pieces(doc)]


class _GrainTokenize:
    """Grain map: a chunk of JSONL lines -> tokenized documents (tokenizer loaded lazily)."""

    def __init__(self, tokenizer: str) -> None:
        self.path = tokenizer
        self.tok: Any = None

    def __call__(self, lines: list[bytes]) -> list[np.ndarray]:
        if self.tok is None:
            self.tok, self.eos = load_tokenizer(self.path)
        return encode_texts(self.tok, self.eos, parse_lines(lines))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "tok": None}


def _grain_read(item: tuple[str, int]) -> list[np.ndarray]:
    return read_row_group(*item)


def _grain_collate(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Grain's packed batch (``input_ids``, ``input_ids_segment_ids``,
    ``input_ids_positions``) -> the same int64 tensors as everyone else."""
    import torch

    tokens = torch.from_numpy(np.asarray(batch["input_ids"])).long()
    segments = torch.from_numpy(np.asarray(batch["input_ids_segment_ids"]))
    positions = torch.from_numpy(np.asarray(batch["input_ids_positions"])[:, :-1]).long()
    labels = tokens[:, 1:].clone()
    labels[segments[:, 1:] == 0] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels, "positions": positions}


def grain_dataset(job: str, files: list[str], tokenizer: str, workers: int = 0,
                  best_fit: bool = False, shuffle_batch: bool = True) -> Any:
    """Grain IterDataset: files -> chunks -> (tokenize) -> pieces -> Grain's first-fit packing
    (8 bins) -> ``WindowShuffleIterDataset(1024)`` -> ``batch(8)`` -> tensors; with
    ``workers`` > 0, ``mp_prefetch`` over that many processes (files split between them)."""
    import grain
    from grain.experimental import (
        BestFitPackIterDataset,
        FirstFitPackIterDataset,
        FlatMapIterDataset,
        WindowShuffleIterDataset,
    )

    ds = grain.MapDataset.source(list(files)).to_iter_dataset()
    if job == "text":
        ds = FlatMapIterDataset(ds, _GrainFileChunks()).map(_GrainTokenize(tokenizer))
    else:
        ds = FlatMapIterDataset(ds, _GrainRowGroups()).map(_grain_read)
    ds = FlatMapIterDataset(ds, _GrainPieces())
    packer = BestFitPackIterDataset if best_fit else FirstFitPackIterDataset
    ds = packer(ds, length_struct={"input_ids": ROW}, num_packing_bins=BINS, seed=0)
    if not shuffle_batch:
        return ds
    ds = WindowShuffleIterDataset(ds, window_size=SHUFFLE, seed=0)
    ds = ds.batch(BATCH, drop_remainder=False).map(_grain_collate)
    if workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return ds


def grain_contender(job: str, files: list[str], tokenizer: str, workers: int = 0,
                    **_: Any) -> Any:
    """Grain, in process (``workers=0``) or with ``mp_prefetch`` worker processes."""
    ds = grain_dataset(job, files, tokenizer, workers)

    def run() -> dict[str, int]:
        return _consume(iter(ds))

    return run


# ------------------------------------------------------------------ zephon_torch


def zephon_pipeline(job: str, files: list[str], tokenizer: str, *, algorithm: str = "first_fit",
                    shuffle_batch: bool = True, flush_every: int | None = None,
                    shuffle_source: bool = False, num_lanes: int = 1,
                    source_defaults: bool = False) -> Any:
    """The same job as a zephon_torch pipeline.

    ``flush_every`` is the source's ``flush_every_k_chunks``: ``None`` keeps the
    default (a flush sentinel every 8 chunks, which closes the open bins so a
    checkpoint never has to hold them), a large number all but turns it off.
    ``shuffle_source`` is the source's ``shuffle``: False reads the files in
    order as the hand-written contenders do; True is the default of a file
    source (a seeded shard and row-group order per pass). ``num_lanes`` above 1
    packs each lane's documents apart (the lane workers' contender), so its rows
    differ a little while the tokens delivered are the same. ``source_defaults``
    passes none of these: the source as a user gets it (8 lanes, shuffled).
    """
    import zephon_torch as zt

    source = ({} if source_defaults else
              {"num_lanes": num_lanes, "chunk_size": 512, "shuffle": shuffle_source,
               "flush_every_k_chunks": flush_every})
    if job == "text":
        tok, _eos = load_tokenizer(tokenizer)
        pipe = (zt.Pipeline.from_jsonl(files, **source)
                .fetch().decode_text().tokenize(tok, special_tokens="eos"))
    else:
        pipe = zt.Pipeline.from_parquet(files, columns=["input_ids"], **source).fetch()
    pipe = pipe.pack_flat(ROW, num_bins=BINS, algorithm=algorithm)
    if shuffle_batch:
        pipe = pipe.shuffle(SHUFFLE, seed=0)
    return pipe.batch(BATCH, drop_last=False)


def zephon_contender(job: str, files: list[str], tokenizer: str, runner: str = "inline",
                     workers: int | None = 1, shuffle: bool = False, num_lanes: int = 1,
                     source_defaults: bool = False, **_: Any) -> Any:
    """zephon_torch with the given runner and worker count; ``to_training`` makes the tensors.

    The result also holds the iterator's ``bytes_read`` and ``sample_bytes``
    (``stats()``), for the read amplification. ``workers=None`` is the
    runner's default worker count; ``source_defaults`` see :func:`zephon_pipeline`.
    """
    pipe = zephon_pipeline(job, files, tokenizer, shuffle_source=shuffle, num_lanes=num_lanes,
                           source_defaults=source_defaults)

    def run() -> dict[str, int]:
        tally = Tally()
        it = pipe.iter(runner=runner, num_workers=None if runner == "inline" else workers)
        try:
            for batch in it:
                out = batch.to_training(return_labels=True)
                tally.add(out["input_ids"], out["labels"], out["positions"])
        finally:
            it.close()
        stats = it.stats()
        return {**tally.result(), "bytes_read": stats["bytes_read"],
                "sample_bytes": stats["sample_bytes"]}

    return run


#: name -> (factory, keyword arguments); ``job`` is passed by the caller.
CONTENDERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "tokenize_only": (tokenize_only, {}),
    "handwritten": (handwritten, {}),
    "torchdata.nodes-2": (torchdata_nodes, {"workers": 2}),
    "grain": (grain_contender, {"workers": 0}),
    "grain-mp-2": (grain_contender, {"workers": 2}),
    "DataLoader-2": (torch_dataloader, {"workers": 2}),
    "zephon-inline": (zephon_contender, {"runner": "inline"}),
    "zephon-inline-shuffled": (zephon_contender, {"runner": "inline", "shuffle": True}),
    # The default configuration: the source's defaults (8 lanes, shuffled), inline and
    # under iter()'s defaults (threads, the default worker count).
    "zephon-inline-default": (zephon_contender, {"runner": "inline", "source_defaults": True}),
    "zephon-default": (zephon_contender, {"runner": "threads", "workers": None,
                                          "source_defaults": True}),
    "zephon-threads-1": (zephon_contender, {"runner": "threads", "workers": 1}),
    "zephon-threads-2": (zephon_contender, {"runner": "threads", "workers": 2}),
    "zephon-process-1": (zephon_contender, {"runner": "process", "workers": 1}),
    "zephon-process-2": (zephon_contender, {"runner": "process", "workers": 2}),
    # Lane workers (issue 15): 2 lanes, each packed, shuffled and batched whole in its worker.
    "zephon-lanes-2": (zephon_contender, {"runner": "lanes", "workers": 2, "num_lanes": 2}),
}


def build(job: str, name: str, files: list[str], tokenizer: str) -> Any:
    """The timed function of a contender, its set-up (imports, tokenizer, data preloading
    for ``tokenize_only``) already done."""
    factory, kwargs = CONTENDERS[name]
    if factory is tokenize_only:
        return tokenize_only(files, tokenizer)
    return factory(job, files, tokenizer, **kwargs)


# --------------------------------------------------------------------------- overhead job


def overhead(name: str, items: list[dict[str, Any]]) -> Any:
    """Records/s through 5 identity map stages: the timed function for one contender."""
    def identity(x: Any) -> Any:
        return x

    if name == "generator":
        def run() -> int:
            def stage(src: Iterable[Any]) -> Iterator[Any]:
                for p in src:
                    yield identity(p)

            it: Iterable[Any] = iter(items)
            for _ in range(5):
                it = stage(it)
            return sum(1 for _ in it)
    elif name == "torchdata.nodes":
        from torchdata.nodes import IterableWrapper, Loader, Mapper

        def run() -> int:
            node = IterableWrapper(items)
            for _ in range(5):
                node = Mapper(node, identity)
            return sum(1 for _ in Loader(node))
    elif name == "grain":
        import grain

        def run() -> int:
            ds = grain.MapDataset.source(items).to_iter_dataset()
            for _ in range(5):
                ds = ds.map(identity)
            return sum(1 for _ in ds)
    elif name == "zephon-inline":
        import zephon_torch as zt

        def run() -> int:
            pipe = zt.Pipeline.from_items(items, num_lanes=8, chunk_size=512)
            for _ in range(5):
                pipe = pipe.map_transform(identity)
            it = pipe.iter(runner="inline")
            try:
                return sum(1 for _ in it)
            finally:
                it.close()
    else:
        raise ValueError(f"unknown overhead contender {name!r}")
    return run


OVERHEAD_CONTENDERS = ("generator", "torchdata.nodes", "grain", "zephon-inline")


# --------------------------------------------------------------------------- padding job


PADDING_CONTENDERS = ("handwritten-first_fit", "handwritten-best_fit", "grain-first_fit",
                      "grain-best_fit", "zephon-first_fit", "zephon-best_fit", "zephon-wrap",
                      "zephon-best_fit_decreasing", "zephon-first_fit-noflush",
                      "zephon-best_fit-noflush")


def padding(name: str, files: list[str]) -> Any:
    """Rows and non-pad tokens of one packer over the token stream, in order (no shuffle)."""
    kind, algorithm = name.split("-", 1)
    flush_every = None
    if algorithm.endswith("-noflush"):  # a flush sentinel every 10**9 chunks: never, here
        algorithm, flush_every = algorithm.removesuffix("-noflush"), 10**9

    def run() -> dict[str, int]:
        rows = tokens = 0
        if kind == "handwritten":
            packer = FirstFit(best=algorithm == "best_fit")
            for doc in token_docs(files):
                for _row, used, _pos in packer.add(doc):
                    rows, tokens = rows + 1, tokens + used
            for _row, used, _pos in packer.flush():
                rows, tokens = rows + 1, tokens + used
        elif kind == "grain":
            ds = grain_dataset("token", files, "", best_fit=algorithm == "best_fit",
                               shuffle_batch=False)
            for row in ds:
                rows += 1
                tokens += int(np.count_nonzero(row["input_ids_segment_ids"]))
        else:
            pipe = zephon_pipeline("token", files, "", algorithm=algorithm, shuffle_batch=False,
                                   flush_every=flush_every)
            it = pipe.iter(runner="inline")
            try:
                for batch in it:
                    for record in batch:
                        rows += 1
                        tokens += ROW - (record.meta.padding_length or 0)
            finally:
                it.close()
        return {"tokens": tokens, "rows": rows, "batches": 0, "checksum": None}

    return run


def files_of(paths: list[Path]) -> list[str]:
    """Paths as strings."""
    return [str(p) for p in paths]
