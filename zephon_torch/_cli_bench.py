"""``zephon-torch bench [NAME] [ARGS]``: a benchmark of a source checkout.

Part of the ``zephon-torch`` command (``cli.py``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(argv: Sequence[str]) -> int:
    """Run ``benchmarks/bench_<name>.py`` with the remaining arguments."""
    available = sorted(p.stem[len("bench_"):] for p in _BENCHMARKS.glob("bench_*.py"))
    if not available:
        print(f"zephon-torch bench runs the benchmarks of a source checkout, and there are "
              f"none at {_BENCHMARKS} (an installed package does not ship them). Clone the "
              f"repository and run it from there, or: python benchmarks/bench_pipeline.py",
              file=sys.stderr)
        return 2
    argv = list(argv)
    name = "pipeline"
    if argv and not argv[0].startswith("-"):
        name = argv.pop(0)
    if name not in available:
        print(f"no benchmark {name!r}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    script = _BENCHMARKS / f"bench_{name}.py"
    if argv in (["-h"], ["--help"]):
        print(f"zephon-torch bench [NAME] [ARGS...]: runs benchmarks/bench_NAME.py "
              f"(NAME: {', '.join(available)}; default pipeline) with ARGS. "
              f"Its own options:\n", flush=True)
    return subprocess.call([sys.executable, str(script), *argv])
