"""Session fixtures: generated corpora and a tokenizer trained at fixture time.

Also a leak check: every test module must leave no child process (running
or zombie) and no shared-memory segment behind. So that the check sees only
this session's segments (other jobs on the machine share ``/dev/shm``), the
session puts its segments in a folder of its own under ``/dev/shm``
(``ZEPHON_SHM_DIR``, inherited by every process the tests start).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

if not os.environ.get("ZEPHON_SHM_DIR"):
    _base = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else tempfile.gettempdir()
    os.environ["ZEPHON_SHM_DIR"] = tempfile.mkdtemp(prefix="zt-tests-", dir=_base)
    _OWN_SHM_DIR: str | None = os.environ["ZEPHON_SHM_DIR"]
else:
    _OWN_SHM_DIR = None

from contract_registry import ContractData, write_contract_corpus
from corpus import documents, write_jsonl, write_token_parquet
from fixtures_tokenizer import train_test_tokenizer


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two components of JSONL (web: 3 files, one gzipped; code: 2 files) and a Parquet set."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "web").mkdir()
    (root / "code").mkdir()
    (root / "tokens").mkdir()
    for i in range(3):
        texts = documents(60, seed=i, empty_every=25)
        write_jsonl(root / "web" / f"part-{i}.jsonl", texts)
    write_jsonl(root / "web" / "part-3.jsonl.gz", documents(30, seed=9), compress=True)
    for i in range(2):
        write_jsonl(root / "code" / f"part-{i}.jsonl",
                    documents(50, seed=100 + i, mean_words=20, prefix="def "))
    for i in range(2):
        write_token_parquet(root / "tokens" / f"part-{i}.parquet", 120, seed=200 + i)
    return root


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A byte-level BPE trained on generated text (ids 0..3 are the special tokens)."""
    tok, _ = train_test_tokenizer(tmp_path_factory.mktemp("tok"))
    return tok


@pytest.fixture(scope="session")
def contract_data(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> ContractData:
    """The small corpus and the tokenizer of the contract registry's pipelines."""
    return ContractData(write_contract_corpus(tmp_path_factory.mktemp("contract")), tokenizer)


# Long-lived helpers that are not ours to stop: multiprocessing's resource tracker
# and fork server, and the daemons of a Ray instance a test module may share.
_HELPERS = re.compile(r"resource_tracker|forkserver|raylet|gcs_server|ray::|[/ ]ray[/ ]")


def _children() -> dict[int, Any]:
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            status = child.status()
        except psutil.Error:
            continue
        if status == psutil.STATUS_ZOMBIE or not _HELPERS.search(cmdline):
            found[child.pid] = child
    return found


def _segments() -> set[str]:
    from zephon_torch.runners import shm

    try:
        return {n for n in os.listdir(shm.segment_dir()) if n.startswith(shm.SEGMENT_PREFIX)}
    except OSError:
        return set()


def leaks(before_children: set[int], before_segments: set[str], *,
          grace: float = 15.0) -> tuple[list[str], list[str]]:
    """Child processes and segments that appeared since ``before_*`` and are still
    there after ``grace`` seconds (pools and engines stop asynchronously)."""
    import psutil

    deadline = time.monotonic() + grace
    while True:
        procs = []
        for pid, proc in _children().items():
            if pid in before_children and proc.status() != psutil.STATUS_ZOMBIE:
                continue
            try:
                procs.append(f"pid {pid} ({proc.status()}): {' '.join(proc.cmdline())[:120]}")
            except psutil.Error:
                continue
        segments = sorted(_segments() - before_segments)
        if (not procs and not segments) or time.monotonic() > deadline:
            return procs, segments
        time.sleep(0.2)


@pytest.fixture(scope="module", autouse=True)
def no_leaked_processes_or_segments(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the module if it leaves a child process (or zombie) or a segment behind."""
    children = set(_children())
    segments = _segments()
    yield
    procs, left = leaks(children, segments)
    if procs or left:
        for pid in [int(p.split()[1]) for p in procs]:  # do not let a leak spread
            try:
                os.kill(pid, 9)
                os.waitpid(pid, os.WNOHANG)
            except (OSError, ChildProcessError):
                pass
        pytest.fail(f"{request.module.__name__} left behind child processes {procs} and "
                    f"shared-memory segments {left}", pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove this session's segment folder."""
    if _OWN_SHM_DIR is not None:
        shutil.rmtree(_OWN_SHM_DIR, ignore_errors=True)
