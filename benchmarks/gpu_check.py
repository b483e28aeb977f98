"""Checks zephon_torch.DataLoader's CUDA placement on a machine with a GPU.

Run through ``benchmarks/gpu_check.sh``. Without CUDA it prints ``SKIP`` and
exits 0. With CUDA it checks, printing ``PASS``/``FAIL`` for each and exiting
1 if any fails:

1. ``device="cuda"`` (engine process and in process): every tensor is on the
   current CUDA device, with the dtype and values of the CPU path;
   ``pin_memory`` defaulted to True;
2. ``pin_memory=True`` without a device: the CPU tensors are pinned;
3. the host-to-device copies read pinned memory (the profiler's memcpy
   kinds are all ``Pinned -> Device``), so ``non_blocking=True`` is real;
4. ``next()`` does not synchronize the device: with a long kernel queued on
   the caller's stream, batches are handed over at once, and their values
   are right once that stream has run (the stream waits on the copy's event);
5. many batches through a small prefetch queue keep their values (the
   caching allocator does not reuse a batch's memory under the caller).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np


def _pipe(n: int = 256) -> Any:
    import zephon_torch as zt

    rng = np.random.default_rng(0)
    items = [{"input_ids": rng.integers(0, 50_000, size=1025).astype(np.int32),
              "text": f"doc {i}"} for i in range(n)]
    return zt.Pipeline.from_items(items, num_lanes=4, chunk_size=8).shuffle(16, seed=1).batch(4)


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]], device: Any) -> str | None:
    import torch

    if len(got) != len(want):
        return f"{len(got)} batches instead of {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g["ids"] != w["ids"]:
            return f"batch {i}: other samples"
        for key, value in w.items():
            if not isinstance(value, torch.Tensor):
                continue
            t = g[key]
            if t.device != device:
                return f"batch {i} {key!r} is on {t.device}, not {device}"
            if t.dtype != value.dtype or not torch.equal(t.cpu(), value):
                return f"batch {i} {key!r} differs from the CPU path"
    return None


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    from zephon_torch.torch.loader import DataLoader

    device = torch.device("cuda", torch.cuda.current_device())
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    pipe = _pipe()
    options = {"return_labels": True}
    want = list(DataLoader(pipe, to_training=options, in_process=True))
    failures = 0

    def report(name: str, problem: str | None) -> None:
        nonlocal failures
        print(f"{'PASS' if problem is None else 'FAIL'}: {name}"
              + ("" if problem is None else f": {problem}"))
        failures += problem is not None

    for in_process in (False, True):
        loader = DataLoader(pipe, to_training=options, device="cuda", num_workers=1,
                            in_process=in_process)
        problem = None if loader.pin_memory else "pin_memory did not default to True"
        got = list(loader)
        torch.cuda.synchronize()
        report(f"device='cuda' (in_process={in_process}): placement and values",
               problem or _same(got, want, device))

    pinned = list(DataLoader(pipe, to_training=options, pin_memory=True, in_process=True))
    report("pin_memory=True: CPU tensors are pinned",
           None if all(b["input_ids"].is_pinned() and b["labels"].is_pinned() for b in pinned)
           else "a tensor is not pinned")

    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            list(DataLoader(pipe, to_training=options, device="cuda", in_process=True))
            torch.cuda.synchronize()
        kinds = sorted({e.name for e in prof.events() if "Memcpy HtoD" in e.name})
        if not kinds:
            print("WARN: the profiler recorded no host-to-device copy (no CUPTI?); "
                  "pinned-source check skipped")
        else:
            report(f"copies read pinned memory ({', '.join(kinds)})",
                   None if all("Pinned" in k for k in kinds) else "a copy read pageable memory")
    except Exception as exc:  # a profiler problem is not a loader problem
        print(f"WARN: profiler unavailable ({exc}); pinned-source check skipped")

    report("next() does not synchronize the device", _no_sync(pipe, options, want, device))
    many = DataLoader(_pipe(1024), to_training=options, device="cuda", prefetch_factor=1,
                      num_workers=2)
    reference = list(DataLoader(_pipe(1024), to_training=options, in_process=True))
    got = []
    for batch in many:
        got.append(batch)
        # Work on the caller's stream that allocates and frees, as a model step would.
        _ = (batch["input_ids"].float() @ torch.ones(batch["input_ids"].shape[1], 64,
                                                      device=device)).sum()
    torch.cuda.synchronize()
    report("256 batches through a prefetch queue of one keep their values",
           _same(got, reference, device))
    print("PASS" if not failures else f"FAIL ({failures} check(s) failed)")
    return 1 if failures else 0


def _no_sync(pipe: Any, options: dict[str, Any], want: list[dict[str, Any]],
             device: Any) -> str | None:
    import torch

    from zephon_torch.torch.loader import DataLoader

    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return None  # cannot queue a long kernel without it; the value checks still ran
    loader = DataLoader(pipe, to_training=options, device="cuda", in_process=True,
                        prefetch_factor=4)
    it = iter(loader)
    first = [next(it)]
    time.sleep(1.0)  # let the prefetch thread fill its queue
    torch.cuda.synchronize()
    sleep(int(2e9))  # about a second of GPU time on the caller's stream
    start = time.perf_counter()
    got = [next(it) for _ in range(3)]
    handed = time.perf_counter() - start
    copies = [b["input_ids"] + 0 for b in got]  # queued after the long kernel
    torch.cuda.synchronize()
    it.close()
    if handed > 0.2:
        return f"3 ready batches took {handed:.3f} s to hand over while the GPU was busy"
    for batch, copy, ref in zip(got, copies, want[1:4]):
        if not torch.equal(copy.cpu(), ref["input_ids"]):
            return "values wrong after the caller's stream ran"
        del batch
    del first
    return None


if __name__ == "__main__":
    sys.exit(main())
