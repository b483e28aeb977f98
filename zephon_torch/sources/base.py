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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy as np

__all__ = ["POINTER", "Dataset", "Pointer", "Shard", "is_pointer"]


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

    def describe(self) -> dict[str, Any]:
        """The fingerprint part of this dataset: kind, name, shard names and sizes."""
        return {
            "kind": self.kind,
            "name": self.name,
            "component_id": self.component_id,
            "passes": self.passes,
            "shards": [[s.name, s.num_samples] for s in self.shards()],
        }

    def __len__(self) -> int:
        return sum(s.num_samples for s in self.shards())
