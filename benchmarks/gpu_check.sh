#!/usr/bin/env bash
# Checks zephon_torch.DataLoader's CUDA path (pinned memory, device="cuda",
# non_blocking copies) on a machine with a GPU; prints PASS/FAIL and exits
# non-zero on failure. Without CUDA it prints SKIP and exits 0.
#
#   benchmarks/gpu_check.sh            # uses .venv/bin/python, else python3
#   PYTHON=/path/to/python benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
if [ ! -x "$python" ]; then
    python="$(command -v python3)"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 540 "$python" benchmarks/gpu_check.py "$@"
