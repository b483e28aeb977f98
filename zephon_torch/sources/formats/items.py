"""In-memory items: a list of payloads as one shard, read inline.

``items(["a b", {"text": "c"}])`` is one shard of 2 samples; sample ``(d, 0, 1)``
is ``{"text": "c"}`` (the caller's own dict, not a copy) and ``locate(0, 1)``
says ``"items[1]"``. A str becomes ``{"text": s}`` as it is read; an array of
token ids stays as it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from zephon_torch.sources.base import Dataset, Shard
from zephon_torch.sources.formats.common import (
    OnError,
    check_component_id,
    check_name,
    check_on_error,
    check_passes,
)
from zephon_torch.sources.formats.registry import SourceFormat, register
from zephon_torch.vocab import texts_present

__all__ = ["ItemsDataset", "items"]


#: What ``ItemsDataset`` accepts as an item.
_ITEM_KINDS = (dict, str, list, tuple, np.ndarray)


class ItemsDataset(Dataset):
    """An in-memory list of payloads: one shard, read inline.

    Args:
        items: A sequence of payloads. A dict is used as it is (not copied);
            a str ``s`` becomes ``{"text": s}``; a 1-D array or list of token
            ids is kept as it is.
        component_id: The mixture component this dataset feeds.
        name: Name for messages and the fingerprint.
        passes: Trips over this dataset (None: the pipeline's ``passes``).
        on_error: ``"raise"`` or ``"skip"`` for later stages' bad samples.

    Raises:
        ValueError: ``items`` is a single str/dict/bytes instead of a sequence.
        TypeError: An item is not a dict, str or array of token ids.
    """

    kind = "items"
    raw_format = "dict"

    def __init__(self, items: Sequence[Any], *, component_id: int = 0, name: str = "items",
                 passes: int | None = None, on_error: OnError = "raise") -> None:
        if isinstance(items, (str, bytes, dict)):
            raise ValueError(f"items must be a sequence of payloads, got one "
                             f"{type(items).__name__}; wrap it in a list: items([...])")
        if not isinstance(items, Sequence):
            try:
                items = list(items)
            except TypeError:
                raise ValueError(f"items must be a sequence of payloads (dicts or str), "
                                 f"got {type(items).__name__}") from None
        # One sweep in C over the items' types; the item-by-item check only names
        # the culprit when a type is not one of the accepted kinds.
        if not all(issubclass(kind, _ITEM_KINDS) for kind in set(map(type, items))):
            for i, item in enumerate(items):
                if not isinstance(item, _ITEM_KINDS):
                    raise TypeError(f"items[{i}] is a {type(item).__name__}; each item must be "
                                    "a dict payload, a str (becomes {'text': s}) or an array "
                                    "of token ids")
        self._items = items
        self.on_error = check_on_error(on_error)
        self.component_id = check_component_id(component_id)
        self.passes = check_passes(passes)
        self.name = check_name(name, "items")
        self._shard = Shard(shard_id=0, num_samples=len(items), name=self.name, path=None,
                            access="inline")

    def shards(self) -> list[Shard]:
        """A single in-memory shard."""
        return [self._shard]

    def read(self, shard_id: int, local_ids: Sequence[int]) -> list[Any]:
        """The payloads of ``local_ids`` (dicts are the caller's own objects)."""
        return self.read_checked(shard_id, local_ids)[0]

    def read_checked(self, shard_id: int, local_ids: Sequence[int]) -> tuple[list[Any], bool]:
        """:meth:`read`, and whether every payload is a dict with a non-blank text.

        When it is (``vocab.texts_present``, one sweep), no item needed
        wrapping and no row is an empty text: the source's emptiness check has
        nothing to look for.
        """
        if shard_id != 0:
            raise IndexError(f"{self.name}: shard {shard_id} does not exist (1 shard)")
        items = self._items
        if type(local_ids) is range and local_ids.step == 1 and type(items) is list:
            out = items[local_ids.start:local_ids.stop]  # a run of ids: one slice
            if len(out) != len(local_ids):  # past the end: the indexing below says so
                out = list(map(items.__getitem__, local_ids))
        else:
            out = list(map(items.__getitem__, local_ids))
        if texts_present(out):  # all dicts: no str to wrap
            return out, True
        return [{"text": item} if isinstance(item, str) else item for item in out], False

    def stream(self, shard_id: int) -> Iterator[Any]:
        """The payloads in order."""
        return iter(self.read(shard_id, range(len(self._items))))

    def locate(self, shard_id: int, local_id: int) -> str:
        """``"items[17]"``."""
        return f"{self.name}[{local_id}]"


def items(items: Sequence[Any], *, component_id: int = 0, name: str = "items",
          passes: int | None = None, on_error: OnError = "raise") -> ItemsDataset:
    """An in-memory dataset (see :class:`ItemsDataset`).

    Example:
        >>> len(items(["a", {"text": "b"}]))
        2
    """
    return ItemsDataset(items, component_id=component_id, name=name, passes=passes,
                        on_error=on_error)


register(SourceFormat(name="items", factory=items, builder="from_items"))
