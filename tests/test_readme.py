"""The README's pipelines run as scripts, pasted as they are.

A reader copies the first pipeline into a file and runs it: it must work
without any ``if __name__ == "__main__":`` (it runs its stages on threads).
The worker-process example keeps the guard, and a script that starts worker
processes without it gets an error that names the missing guard.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from corpus import documents, write_jsonl
from fixtures_tokenizer import train_test_tokenizer

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _pipelines() -> list[str]:
    """The README's python blocks that build a pipeline from JSONL files, in order."""
    blocks = _FENCE.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    return [b for b in blocks if "Pipeline.from_jsonl(" in b]


@pytest.fixture(scope="module")
def reader_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the README assumes: JSONL files with a text field in data/, and tokenizer.json.

    Enough documents for every lane to fill a batch of 8 rows of 2049 tokens.
    """
    root = tmp_path_factory.mktemp("reader")
    (root / "data").mkdir()
    for i in range(4):
        write_jsonl(root / "data" / f"part-{i}.jsonl", documents(700, seed=i, mean_words=120))
    shutil.copy(train_test_tokenizer(root / "tok")[1], root / "tokenizer.json")
    return root


def _run_script(code: str, where: Path, name: str) -> subprocess.CompletedProcess[str]:
    script = where / name
    script.write_text(code, encoding="utf-8")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    return subprocess.run([sys.executable, name], cwd=where, env=env, capture_output=True,
                          text=True, timeout=240)


def test_the_first_pipeline_runs_pasted_into_a_script(reader_dir: Path) -> None:
    first = _pipelines()[0]
    assert "__main__" not in first
    result = _run_script(first, reader_dir, "first.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "torch.Size([8, 2048])"


def test_the_worker_process_pipeline_runs_as_a_script(reader_dir: Path) -> None:
    workers = next(b for b in _pipelines() if 'runner="process"' in b)
    assert 'if __name__ == "__main__":' in workers
    result = _run_script(workers, reader_dir, "workers.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "torch.Size([8, 2048])"


def test_workers_started_outside_the_main_guard_name_the_missing_guard(tmp_path: Path) -> None:
    # A stage (the filter) runs in the worker processes; batch() alone would need none.
    code = ('import zephon_torch as zt\n'
            '\n'
            'pipe = zt.Pipeline.from_items([f"doc {i}" for i in range(64)]).filter(bool).batch(4)\n'
            'for batch in pipe.iter(runner="process", num_workers=2):\n'
            '    pass\n')
    result = _run_script(code, tmp_path, "unguarded.py")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: zephon worker processes keep dying"), last
    assert (f"the main script {tmp_path / 'unguarded.py'} starts them at line 4, outside "
            '`if __name__ == "__main__":`') in last
    # Each worker stops with one line, not a traceback of its own.
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert "zephon: this worker process re-ran the main script" in result.stderr


def test_workers_started_under_the_main_guard_are_not_blamed_on_it(tmp_path: Path) -> None:
    # The same script, guarded, whose operator fails in every worker's setup():
    # the error is about the operator, not the guard.
    code = ('import zephon_torch as zt\n'
            'from zephon_torch.ops import Operator\n'
            '\n'
            'class Broken(Operator):\n'
            '    name = "broken"\n'
            '    def setup(self, ctx):\n'
            '        import os; os._exit(3)\n'
            '    def process_many(self, elems):\n'
            '        return elems\n'
            '\n'
            'if __name__ == "__main__":\n'
            '    pipe = zt.Pipeline.from_items([f"doc {i}" for i in range(64)]).apply(Broken())\n'
            '    for batch in pipe.iter(runner="process", num_workers=2):\n'
            '        pass\n')
    result = _run_script(code, tmp_path, "guarded.py")
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: zephon worker processes keep dying"), last
    assert "__main__" not in last and "setup()?" in last
