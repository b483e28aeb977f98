"""The ``>>>`` examples in docs/*.md run as shown.

Each markdown file is one test. Its ```` ```python ```` blocks that contain
``>>>`` run with the standard doctest machinery, in order, in one shared
namespace (a later block uses the names an earlier one defined), inside a
fresh temporary working directory, with ``ELLIPSIS`` and
``NORMALIZE_WHITESPACE``.

A page may ask the reader to save a module first: a ```` ```python ```` block
whose first line is ``# path/name.py`` (``my_ops.py``, ``lit.py``). The test
writes every such block to that path in the working directory before the
examples run, and puts the working directory first on ``sys.path`` and
``PYTHONPATH``, so the examples and the worker processes they spawn import it
as the reader's would.
"""

from __future__ import annotations

import doctest
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_FILE_HEADER = re.compile(r"#\s*([\w./-]+\.py)\s*$")
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _blocks(text: str) -> list[tuple[int, str]]:
    """The python blocks of a page, each with the line number of its first line."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def _pages_with_examples() -> list[str]:
    return sorted(p.name for p in DOCS.glob("*.md")
                  if any(">>>" in b for _, b in _blocks(p.read_text(encoding="utf-8"))))


def _write_module_files(blocks: list[tuple[int, str]], where: Path) -> list[str]:
    """Write the blocks headed ``# name.py`` under ``where``; return their module names."""
    modules = []
    for _, block in blocks:
        first = block.split("\n", 1)[0]
        match = _FILE_HEADER.fullmatch(first)
        if match is None or ">>>" in block:
            continue
        target = where / match.group(1)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block, encoding="utf-8")
        modules.append(".".join(Path(match.group(1)).with_suffix("").parts))
    return modules


def test_every_page_with_examples_is_collected() -> None:
    """The pages the prose calls run-as-shown are the ones this module runs."""
    pages = _pages_with_examples()
    assert "how-pipelines-run.md" in pages
    assert "writing-an-operator.md" in pages


@pytest.mark.parametrize("page", _pages_with_examples())
def test_doc_examples_run_as_shown(page: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = DOCS / page
    blocks = _blocks(path.read_text(encoding="utf-8"))
    modules = _write_module_files(blocks, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Subprocesses (spawned workers, a script the page runs) import the
    # page's modules and this checkout's zephon_torch.
    paths = [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    report: list[str] = []
    globs: dict = {"__name__": f"docs.{path.stem}"}
    try:
        for i, (first_line, block) in enumerate(x for x in blocks if ">>>" in x[1]):
            # doctest reports test.lineno + example.lineno + 1: the page's line.
            test = parser.get_doctest(block, globs, f"{page}[block {i}]", str(path),
                                      first_line - 1)
            runner.run(test, out=report.append, clear_globs=False)
            globs = test.globs
    finally:
        for name in modules:
            sys.modules.pop(name, None)
        iterator = globs.get("it")
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
    failed, attempted = runner.failures, runner.tries
    assert attempted > 0, f"{page}: no examples found"
    assert failed == 0, f"{page}: {failed} of {attempted} examples failed\n" + "".join(report)
