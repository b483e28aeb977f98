"""Running a script under real ``torchrun`` (gloo on CPU) from a test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback TCP port free at the moment of asking."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(script: Path, nproc: int, *args: str,
             timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on ``nproc`` ranks; fail the test on a hang or a non-zero exit.

    The script's folder, not the current one, heads the ranks' ``sys.path``:
    this checkout goes first, so that they (and their engine processes) run
    the code under test rather than whichever copy of zephon_torch is installed.
    """
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *args]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                env=env)
    except subprocess.TimeoutExpired as exc:  # a rank stuck in a collective
        pytest.fail(f"torchrun {' '.join(args)} did not finish in {timeout} s:\n"
                    f"{exc.stdout}\n{exc.stderr}")
    assert result.returncode == 0, f"torchrun {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result
