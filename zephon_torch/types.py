"""The data model every stage of a pipeline speaks.

Two kinds of element travel between stages: a :class:`SampleRecord` (one
sample: its :class:`SampleMeta` and its payload) and, after ``batch()``, a
:class:`SampleBatch` of records of one lane.

Identity and order live in the meta. A base sample is named by
``sample_id = (dataset_id, shard_id, local_sample_id)`` and placed by
``(lane_id, chunk_id, chunk_offset)``. When an operator splits one record into
several, output ``i`` gets ``meta.child(i)``, which appends ``i`` to the
``lineage``. The cursor key ``(chunk_id, chunk_offset, lineage, sample_id)``
then sorts records exactly as a single-threaded run emits them::

    doc at chunk 3, offset 7      -> key (3, 7, (),   sid)
    ...its first piece            -> key (3, 7, (0,), sid)
    ...its second piece           -> key (3, 7, (1,), sid)
    next doc, chunk 3, offset 8   -> key (3, 8, (),   sid')

Control information rides in ``meta.tags`` under reserved keys (see
:data:`CONTRIBUTORS_TAG` and its neighbours): the contributors of a packed
record, the tombstone marker of a dropped sample, the flush-sentinel marker,
and the packing metadata (trailing padding length) written by ``pack_flat``.

Every class here is a frozen dataclass. They are created once per sample, so
constructors do no validation and no copying: containers handed in are kept
as they are and must not be mutated afterwards.

This module is the data model's home, where its names are imported from; the
classes are written in ``_types_meta.py`` (cursors, contributor references,
metas), ``_types_records.py`` (records, and records made from columns) and
``_types_batch.py`` (batches and ``to_training``). Like this module, those
import nothing from the package but ``vocab`` and each other.
"""

from __future__ import annotations

from typing import Any, Union

# The classes are written in three modules (metas, records, batches) and live here
# (see the end of this module). The helpers are re-exported as well (``as`` names).
from zephon_torch._types_batch import SampleBatch
from zephon_torch._types_batch import install_training_converter as install_training_converter
from zephon_torch._types_meta import _NO_TAGS as _NO_TAGS  # pickles of tagless metas name it
from zephon_torch._types_meta import ContributorRef, SampleCursor, SampleMeta, _NoTags
from zephon_torch._types_records import SampleRecord
from zephon_torch._types_records import metas_from_columns as metas_from_columns
from zephon_torch._types_records import payloads_equal as payloads_equal
from zephon_torch._types_records import records_from_columns as records_from_columns

# The reserved tags live in the vocabulary module; they are public names here too.
from zephon_torch.vocab import (
    CONTRIBUTORS_TAG,
    FLUSH_SENTINEL_TAG,
    PACKING_METADATA_TAG,
    TOMBSTONE_TAG,
)

__all__ = [
    "CONTRIBUTORS_TAG",
    "FLUSH_SENTINEL_TAG",
    "PACKING_METADATA_TAG",
    "TOMBSTONE_TAG",
    "ChunkId",
    "ChunkOffset",
    "ComponentId",
    "ContributorRef",
    "CursorKey",
    "DatasetId",
    "LaneId",
    "LineageIndex",
    "LocalSampleId",
    "SampleBatch",
    "SampleCursor",
    "SampleId",
    "SampleMeta",
    "SamplePayload",
    "SamplePayloadArray",
    "SampleRecord",
    "ShardId",
]

ChunkId = int
ChunkOffset = int
ComponentId = int
DatasetId = int
LaneId = int
LineageIndex = int
LocalSampleId = int
ShardId = int
#: A 1-D array of token ids: a numpy array, a torch tensor or a list of ints.
SamplePayloadArray = Any
#: ``(dataset_id, shard_id, local_sample_id)``.
SampleId = tuple[int, int, int]
#: ``(chunk_id, chunk_offset, lineage, sample_id)``: the canonical cursor key.
CursorKey = tuple[int, int, tuple[int, ...], SampleId]
SamplePayload = Union[  # a recursive alias: Union[...] takes the string forms
    bytes,
    memoryview,
    str,
    int,
    float,
    complex,
    SamplePayloadArray,
    "list[SamplePayload]",
    "dict[Any, SamplePayload]",
]

# This module is the classes' home: reprs, pickles and the API reference name them here.
# (The one name string for all: pickles then hold it once, as when they were written here.)
for _cls in (_NoTags, SampleCursor, ContributorRef, SampleMeta, SampleRecord, SampleBatch):
    _cls.__module__ = __name__
del _cls
