"""What a dataset is to the engine: shards of samples, and how to read them.

A :class:`Dataset` is a list of :class:`Shard` objects (files, or one
in-memory list). Each sample is named ``(dataset_id, shard_id,
local_sample_id)``. The work schedule (``schedule.py``) decides which samples
go into which chunk and lane; the dataset only answers "how many samples per
shard" and "read these samples".

How a shard is read depends on its ``access``:

* ``"pointer"``: random access (plain JSONL through a cached line index,
  Parquet by row group, text files). The source emits *pointer records*
  (payload :data:`POINTER`) and ``fetch`` reads the bytes on the workers.
* ``"stream"``: sequential only (``.jsonl.gz``, ``.jsonl.zst``). The source
  reads the stream in order and emits records that already hold the raw
  bytes; a resume re-reads the shard from its start.
* ``"inline"``: in memory (``from_items``). The source emits the payloads
  directly.

Raw payloads are ``bytes`` (a JSONL line, a text file) or ``dict`` (a
Parquet row, an item); ``decode_text`` turns them into dict payloads using
the dataset's ``raw_format`` (``"json"``, ``"text"`` or ``"dict"``).

**Read blocks.** :meth:`Dataset.blocks` cuts a shard into runs of
consecutive samples that are read together (a Parquet row group, about a
megabyte of JSONL lines). A shuffled pass visits the blocks of a shard in a
seeded order and the samples of a block in a seeded order, so each block is
read about once per pass (``schedule.py``).

**Bytes read.** Readers report what they really read from storage with
:func:`count_read` (a Parquet row group's compressed column chunks per decode,
the byte ranges of JSONL reads, a text file's size); the counter is per
thread, so whoever runs a read on a thread can tell what it cost with
:func:`thread_bytes_read` before and after (the runners do, for
``stats()["bytes_read"]``).

**Fingerprint.** :meth:`Dataset.describe` is this dataset's part of the
pipeline's checkpoint fingerprint: its options, its shards' names and sample
counts (which decide the work schedule) and, under ``"content"``, a compact
table with each shard's size and content digest (which let a resume notice
files rewritten in place). Names are location-free, so a job can move to
another cluster; nothing in it depends on where or when a file was written.
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

__all__ = ["POINTER", "ContentEntry", "Dataset", "Pointer", "Shard", "content_table",
           "count_read", "is_pointer", "name_tag", "parse_content_table", "thread_bytes_read"]

# Bytes read from storage, per thread: a read and its caller share a thread, so the
# difference of two readings brackets exactly the reads made in between, whatever
# other threads (or other iterators on this thread, between the readings) do.
_METER = threading.local()


def count_read(nbytes: int) -> None:
    """Add ``nbytes`` read from storage to this thread's counter.

    Readers call it where they really read (a custom :class:`Dataset` should
    too, for ``stats()["bytes_read"]``): once per decoded Parquet row group,
    per byte range read from a file, not per sample served from a cache.
    """
    _METER.total = getattr(_METER, "total", 0) + int(nbytes)


def thread_bytes_read() -> int:
    """Bytes that readers have reported with :func:`count_read` on this thread so far."""
    return getattr(_METER, "total", 0)


class Pointer:
    """The payload of a pointer record: "the bytes are still on disk".

    The record's ``meta.sample_id`` is the pointer itself; ``fetch`` replaces
    this marker with the sample's raw bytes.
    """

    __slots__ = ()

    def __reduce__(self) -> str:
        return "POINTER"  # unpickles as the module's singleton

    def __repr__(self) -> str:
        return "POINTER"


#: The singleton pointer payload.
POINTER = Pointer()


def is_pointer(payload: Any) -> bool:
    """True if ``payload`` is the pointer marker (the sample has not been fetched)."""
    return payload is POINTER or isinstance(payload, Pointer)


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """One shard of a dataset.

    Attributes:
        shard_id: Index of the shard in its dataset (stable: sorted paths).
        num_samples: Samples in the shard (an empty file has 0).
        name: A location-free name used in fingerprints (the file's base
            name), so a job can move to another cluster.
        path: Where to read it (a local path or fsspec URL); None in memory.
        access: ``"pointer"``, ``"stream"`` or ``"inline"`` (see module doc).
    """

    shard_id: int
    num_samples: int
    name: str = ""
    path: str | None = None
    access: Literal["pointer", "stream", "inline"] = "pointer"


class Dataset(ABC):
    """One dataset (a mixture component): shards, and readers for them.

    Instances are sent to worker processes (pickled), so they must not hold
    open files when pickled; readers open what they need lazily.

    Attributes:
        kind: ``"items"``, ``"jsonl"``, ``"parquet"`` or ``"text_files"``.
        raw_format: How ``decode_text`` reads raw payloads: ``"json"``,
            ``"text"`` or ``"dict"``.
        component_id: The mixture component this dataset feeds.
        name: A human-readable name for messages and fingerprints.
        on_error: ``"raise"`` (a clear error naming file and line) or
            ``"skip"`` (a counted tombstone).
        passes: Trips over this dataset (None: the pipeline's ``passes``).
    """

    kind: str = ""
    raw_format: Literal["json", "text", "dict"] = "dict"
    #: Samples per read block of the default :meth:`blocks` (datasets that read
    #: nothing from storage: large blocks mix best and cost nothing).
    block_samples: int = 65_536
    component_id: int = 0
    name: str = ""
    on_error: Literal["raise", "skip"] = "raise"
    passes: int | None = None

    @abstractmethod
    def shards(self) -> list[Shard]:
        """The shards, in a stable order, with their sample counts (cached)."""

    @abstractmethod
    def read(self, shard_id: int, local_ids: Sequence[int]) -> list[Any]:
        """Raw payloads of ``local_ids`` of shard ``shard_id``, in the order given.

        Only for ``"pointer"`` and ``"inline"`` shards.
        """

    def stream(self, shard_id: int) -> Iterator[Any]:
        """Raw payloads of a shard in file order (every access kind supports it)."""
        shard = self.shards()[shard_id]
        step = 1024
        for start in range(0, shard.num_samples, step):
            yield from self.read(shard_id, range(start, min(start + step, shard.num_samples)))

    def blocks(self, shard_id: int) -> np.ndarray:
        """Start offsets of the shard's read blocks: runs of samples read together.

        A shuffled pass visits a shard's blocks in a seeded order and the
        samples of each block in a seeded order, so a block is read about once
        per pass. Override it where reads have a natural unit (file datasets
        do: Parquet row groups, ranges of about a megabyte of JSONL lines).
        The answer must depend only on the shard's content and layout, never
        on the process or the time: the order of a shuffled pass, and so a
        resume, is a function of it.

        Returns:
            An int64 array, ascending, starting at 0, every entry below the
            shard's ``num_samples`` (empty for an empty shard). The default:
            blocks of :attr:`block_samples` samples.
        """
        n = self.shards()[shard_id].num_samples
        return np.arange(0, n, max(1, int(self.block_samples)), dtype=np.int64)

    def locate(self, shard_id: int, local_id: int) -> str:
        """Where a sample lives, for error messages (``"a.jsonl line 17"``)."""
        shard = self.shards()[shard_id]
        return f"{shard.path or self.name} sample {local_id}"

    def sample_bytes(self, shard_id: int, local_ids: np.ndarray) -> int:
        """Bytes of storage that reading ``local_ids`` of a shard covers (for ``stats()``).

        The default is 0 (an in-memory dataset reads no storage). File
        datasets answer from what they already know (line offsets, row-group
        sizes, file sizes), without reading anything.
        """
        return 0

    def content_signatures(self) -> list[tuple[int, str] | None]:
        """Per shard: ``(size in bytes, content digest)``, or None where unknown.

        The digest must depend on the content only (not on a path or a
        time), and should be cheap: file datasets hash the first and last few
        KiB and what they index anyway. The default (in-memory data) knows
        nothing.
        """
        return [None] * len(self.shards())

    def describe(self) -> dict[str, Any]:
        """The fingerprint part of this dataset: kind, name, shard names and sizes.

        ``"content"`` is the :func:`content_table` of the shards: what a
        resume compares to notice data rewritten since the checkpoint.
        """
        shards = self.shards()
        return {
            "kind": self.kind,
            "name": self.name,
            "component_id": self.component_id,
            "passes": self.passes,
            "shards": [[s.name, s.num_samples] for s in shards],
            "content": content_table(shards, self.content_signatures()),
        }

    def __len__(self) -> int:
        return sum(s.num_samples for s in self.shards())


# ---------------------------------------------------------------- content tables


class ContentEntry(NamedTuple):
    """One shard in a :func:`content_table`.

    Attributes:
        name_tag: :func:`name_tag` of the shard's name.
        samples: Its sample count.
        size: Its size in bytes, or None when unknown.
        digest: Its content digest, or None when unknown.
    """

    name_tag: str
    samples: int
    size: int | None
    digest: str | None


def name_tag(name: str) -> str:
    """8 hex digits standing for a shard name (a table holds tags, not names)."""
    return hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()


def content_table(shards: Sequence[Shard], signatures: Sequence[tuple[int, str] | None]) -> str:
    """A compact text table of the shards: ``"tag:samples:size:digest"`` each, space-separated.

    It goes into every checkpoint state, so it is one string (cheap to copy,
    hash and pickle, about 40 bytes per shard) holding just enough to say
    which shard of a dataset changed and how. ``-`` stands for an unknown
    size or digest. Example: ``"1f2e3d4c:10:1234:0123456789abcdef"``.
    """
    entries = []
    for shard, signature in zip(shards, signatures):
        size, digest = ("-", "-") if signature is None else signature
        entries.append(f"{name_tag(shard.name)}:{shard.num_samples}:{size}:{digest}")
    return " ".join(entries)


def parse_content_table(table: str) -> list[ContentEntry]:
    """The entries of a :func:`content_table` (raises ValueError if it is malformed)."""
    entries = []
    for item in table.split():
        tag, samples, size, digest = item.split(":")
        entries.append(ContentEntry(tag, int(samples), None if size == "-" else int(size),
                                    None if digest == "-" else digest))
    return entries
