"""Device placement for ``zephon_torch.DataLoader``: pin, copy, hand over.

The loader's prefetch thread places each batch while the caller trains on
the previous one; the caller's thread takes it over::

    prefetch thread (side CUDA stream)            caller's thread (its current stream)
    ──────────────────────────────────            ────────────────────────────────────
    t = t.pin_memory()          page-locked copy
    t = t.to(device, non_blocking=True)  ─ async ─►
    event.record(side stream)                     stream.wait_event(event)  (no host sync)
                                                  t.record_stream(stream)   (memory safety)

The copy overlaps the caller's kernels because it runs on a stream of its
own; the caller's stream waits for it on the device, never on the host; and
``record_stream`` tells the caching allocator that memory allocated on the
side stream is in use on the caller's, so it is not reused too early.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Placer", "with_index"]


def with_index(device: torch.device | None) -> torch.device | None:
    """``cuda`` as ``cuda:<current device>``, read on the caller's thread.

    The current CUDA device is per thread: the prefetch thread would see
    device 0, not the ``torch.cuda.set_device(local_rank)`` of the caller.
    """
    if device is not None and device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Placer:
    """Pins and copies a batch's tensors on the prefetch thread; hands them over.

    CUDA copies run on a side stream, so that they overlap the caller's
    kernels; the caller's stream waits on an event recorded after them.
    """

    def __init__(self, device: torch.device | None, pin_memory: bool) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self.cuda = device is not None and device.type == "cuda"
        self._stream: Any = None

    @property
    def active(self) -> bool:
        return self.device is not None or self.pin_memory

    def place(self, payload: Any) -> tuple[Any, Any]:
        """``(placed payload, CUDA event or None)``; runs on the prefetch thread."""
        if not self.active or not isinstance(payload, dict):
            return payload, None
        if not self.cuda:
            return self._move(payload), None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            placed = self._move(payload)
            event = torch.cuda.Event()
            event.record(self._stream)
        return placed, event

    def _move(self, payload: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in payload.items():
            if isinstance(value, torch.Tensor):
                if self.pin_memory and value.device.type == "cpu":
                    value = value.pin_memory()
                if self.device is not None:
                    value = value.to(self.device, non_blocking=True)
            out[key] = value
        return out

    def hand_over(self, payload: Any, event: Any) -> Any:
        """On the caller's thread: order its stream after the copy; keep memory safe."""
        if event is None:
            return payload
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for value in payload.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                # Allocated on the side stream, used on the caller's: the allocator must
                # not reuse the memory before the caller's queued work is done with it.
                value.record_stream(current)
        return payload
