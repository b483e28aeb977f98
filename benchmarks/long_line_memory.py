"""Peak memory of one very long JSON line read through ``from_jsonl``.

Writes a JSONL file holding one line of about ``--mib`` MiB (between two small
ones), then, in a fresh process per runner, builds
``from_jsonl(...).fetch().decode_text()`` and reads it to the end, printing how
much the process's peak RSS grew, as a multiple of the line's size. The figure
quoted in ``docs/performance.md`` ("One very long line") comes from here::

    python benchmarks/long_line_memory.py --mib 40

Not a timed test: it takes a few seconds and needs about 4x the line in RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile


def write(path: str, mib: int) -> None:
    """A JSONL file: a small line, one of about ``mib`` MiB, a small line."""
    with open(path, "w") as f:
        f.write(json.dumps({"text": "small"}) + "\n")
        f.write(json.dumps({"text": "word " * ((mib << 20) // 5)}) + "\n")
        f.write(json.dumps({"text": "small"}) + "\n")


def _peak_mib() -> float:
    """This process's peak RSS in MiB (``VmHWM``; ``ru_maxrss`` where /proc is missing,
    which on Linux may still hold the parent's peak after a fork and exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    """Set the peak RSS back to the current RSS (Linux), so the figure is this run's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def measure(path: str, runner: str) -> float:
    """Growth of this process's peak RSS while the pipeline reads ``path``, in MiB."""
    from zephon_torch.pipeline import Pipeline

    _reset_peak()
    base = _peak_mib()
    pipe = Pipeline.from_jsonl(path, num_lanes=1, shuffle=False).fetch().decode_text()
    with pipe.iter(runner=runner) as it:
        chars = sum(len(r.payload["text"]) for r in it)
    assert chars > 0
    return _peak_mib() - base


def main() -> None:
    """Write the file, then measure each runner in a fresh interpreter."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=40, help="size of the long line (MiB)")
    parser.add_argument("--runners", default="inline,threads")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "RUNNER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(f"{measure(*args.child):.1f}")
        return
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "long.jsonl")
        write(path, args.mib)
        size = os.path.getsize(path) / 2**20
        env = {**os.environ, "ZEPHON_CACHE_DIR": os.path.join(folder, "cache")}
        for runner in args.runners.split(","):
            done = subprocess.run([sys.executable, __file__, "--child", path, runner],
                                  capture_output=True, text=True, env=env, check=True)
            grew = float(done.stdout.split()[-1])
            print(f"{runner}: a {size:.1f} MiB line: peak RSS grew {grew:.1f} MiB "
                  f"({grew / size:.2f}x the line)")


if __name__ == "__main__":
    main()
