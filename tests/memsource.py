"""A minimal in-memory Dataset for engine tests that must not depend on the readers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zephon_torch.sources.base import Dataset, Shard


class MemDataset(Dataset):
    """Items split into shards of given sizes; access "inline" (or "pointer")."""

    kind = "items"
    raw_format = "dict"

    def __init__(self, items: Sequence[Any], *, shard_sizes: Sequence[int] | None = None,
                 component_id: int = 0, name: str = "mem", access: str = "inline",
                 passes: int | None = None) -> None:
        self.items = [{"text": x} if isinstance(x, str) else x for x in items]
        sizes = list(shard_sizes) if shard_sizes is not None else [len(self.items)]
        if sum(sizes) != len(self.items):
            raise ValueError("shard sizes must add up to the item count")
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = sizes
        self.component_id = component_id
        self.name = name
        self.access = access
        self.passes = passes

    def shards(self) -> list[Shard]:
        return [Shard(shard_id=i, num_samples=n, name=f"{self.name}-{i}", access=self.access)
                for i, n in enumerate(self.sizes)]

    def read(self, shard_id: int, local_ids: Sequence[int]) -> list[Any]:
        start = self.starts[shard_id]
        return [self.items[start + i] for i in local_ids]
