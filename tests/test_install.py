"""What an install brings: the core dependencies, the extras, and what the wheel ships.

The core install is what ``import zephon_torch`` and the documented default
path need; every integration's package is an extra, and a user without it
reads which pip package and which extra to install. The tests run the code
with the other packages made unimportable (a finder on ``sys.meta_path``
that answers as if they were not installed), in a fresh interpreter.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from corpus import documents, write_jsonl
from fixtures_tokenizer import train_test_tokenizer

from zephon_torch._extras import EXTRAS

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

pytestmark = pytest.mark.timeout(300)


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _extra_names(requirement: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", requirement.split(";")[0])
    return [e.strip() for e in match.group(1).split(",")] if match else []


def _core() -> set[str]:
    return {_name(r) for r in PROJECT["dependencies"]}


def _extra(extra: str) -> set[str]:
    """The distributions an extra of zephon-torch installs (self-references followed)."""
    names: set[str] = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        if _name(requirement) == "zephon-torch":
            for inner in _extra_names(requirement):
                names |= _extra(inner)
        else:
            names.add(_name(requirement))
    return names


def _closure(names: set[str]) -> set[str]:
    """``names`` and everything they require when installed (extras' requirements aside)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo.extend(_name(r) for r in requires if "extra ==" not in r.replace('"', "'"))
    return seen


def _modules_of(distributions: set[str]) -> set[str]:
    """The top-level import names the installed ``distributions`` provide."""
    return {module for module, dists in metadata.packages_distributions().items()
            if any(_name(d) in distributions for d in dists)}


# A finder that answers for the hidden packages as if they were not installed.
_HIDE = """\
import sys
HIDDEN = set({hidden!r})
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
for _m in [m for m in sys.modules if m.split(".")[0] in HIDDEN]:
    del sys.modules[_m]
sys.meta_path.insert(0, _NotInstalled())
"""


def _run(code: str, hidden: set[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    script = cwd / "script.py"
    script.write_text(_HIDE.format(hidden=sorted(hidden)) + code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=cwd, timeout=240)


# --------------------------------------------------------------------------- the core


def _demo_extras() -> list[str]:
    found = re.search(r"^ZEPHON_EXTRAS=(\S*)$", (ROOT / "scripts" / "demo").read_text(), re.M)
    assert found, "scripts/demo names no ZEPHON_EXTRAS"
    return [e for e in found.group(1).split(",") if e]


_DEFAULT_PATH = """
import json
import zephon_torch as zt
from zephon_torch import cli


def pipe():
    return (zt.Pipeline.from_jsonl("data/*.jsonl", num_lanes=2, chunk_size=16)
            .fetch().decode_text().tokenize("tokenizer.json", special_tokens="eos")
            .pack_flat(65, pad_token_id=0).shuffle(buffer_size=8, seed=1).batch(2))


if __name__ == "__main__":
    for runner in ("threads", "process"):
        with pipe().iter(runner=runner, num_workers=2) as it:
            rows = [b.to_training(return_labels=True, return_cu_seqlens=True)["input_ids"].shape
                    for b in it]
        assert rows and all(tuple(r) == (2, 64) for r in rows), rows
    loader = zt.DataLoader(pipe(), to_training={"return_labels": True})
    assert [tuple(b["labels"].shape) for b in loader] == [tuple(r) for r in rows]
    assert cli.main(["demo", "--docs", "300", "--seq-len", "64", "--runner", "process",
                     "--out", "demo"]) == 0
    print("IMPORTED", json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


@pytest.mark.slow
def test_the_default_path_and_the_demo_run_with_only_the_core_and_the_demos_extras(
        tmp_path: Path) -> None:
    allowed = _core() | {d for e in _demo_extras() for d in _extra(e)}
    every_extra = {d for e in PROJECT["optional-dependencies"] if e != "dev" for d in _extra(e)}
    hidden = _modules_of(every_extra - _closure(allowed))
    assert {"lightning", "torchdata", "ray", "pyarrow"} <= hidden  # what a user may lack
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", documents(120, seed=1))
    shutil.copy(train_test_tokenizer(tmp_path / "tok")[1], tmp_path / "tokenizer.json")

    result = _run(_DEFAULT_PATH, hidden, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resume: identical" in result.stdout
    imported = set(json.loads(result.stdout.rsplit("IMPORTED ", 1)[1]))
    third_party = imported - set(sys.stdlib_module_names) - {"zephon_torch"}
    mapping = metadata.packages_distributions()
    used = {_name(d) for m in third_party for d in mapping.get(m, [])} - {"zephon-torch"}
    # Everything the path imported is installed by the core (or what the core requires) ...
    assert used <= _closure(allowed), used - _closure(allowed)
    # ... and it uses what the core installs for it.
    assert {"numpy", "cloudpickle", "tokenizers", "torch"} <= used, used


# --------------------------------------------------------------------------- extras

_TRIGGERS = {
    "pyarrow": ("open('x.parquet', 'wb').write(b'PAR1')\n"
                "import zephon_torch as zt\nzt.Pipeline.from_parquet('x.parquet')"),
    "zstandard": ("open('x.jsonl.zst', 'wb').write(b'junk')\n"
                  "import zephon_torch as zt\nzt.Pipeline.from_jsonl('x.jsonl.zst')"),
    "fsspec": "import zephon_torch as zt\nzt.Pipeline.from_jsonl('memory://data/x.jsonl')",
    "ray": ("import zephon_torch as zt\n"
            "zt.Pipeline.from_items(['a']).map_transform(dict, placement='remote').iter()"),
    "lightning": "import zephon_torch.lightning",
    "torchdata": "from zephon_torch.torch import PipelineNode",
}


def test_every_optional_package_has_a_trigger_here() -> None:
    assert set(_TRIGGERS) == set(EXTRAS)


@pytest.mark.parametrize("module", sorted(_TRIGGERS))
def test_a_missing_optional_package_names_its_pip_package_and_extra(
        module: str, tmp_path: Path) -> None:
    package, extra = EXTRAS[module]
    assert _name(package) in _extra(extra), f"the {extra!r} extra does not install {package}"
    code = f"try:\n{_indent(_TRIGGERS[module])}\nexcept ImportError as exc:\n    print(exc)\n"
    result = _run(code, {module}, tmp_path)
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    assert f"pip install 'zephon-torch[{extra}]'" in message, message
    assert "not installed" in message and package in message, message


def _indent(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())


def test_the_core_does_not_install_the_integrations() -> None:
    for integration in ("lightning", "torchdata", "ray", "pyarrow", "zstandard", "fsspec"):
        assert integration not in _core(), integration


def test_the_dev_extra_installs_every_other_extra() -> None:
    extras = set(PROJECT["optional-dependencies"]) - {"dev"}
    for extra in extras:
        assert _extra(extra) <= _extra("dev"), extra


# --------------------------------------------------------------------------- the wheel


def test_the_license_file_is_the_apache_license_pyproject_declares() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert " ".join(text.split()[:5]) == "Apache License Version 2.0, January"
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.slow
def test_the_wheel_ships_the_type_hints_and_the_license(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "zephon_torch", source / "zephon_torch",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "dist").glob("zephon_torch-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert "zephon_torch/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")
               for n in names), names
    requires = [line.split(":", 1)[1].strip() for line in meta.decode().splitlines()
                if line.startswith("Requires-Dist:")]
    assert {_name(r) for r in requires if "extra ==" not in r} == _core()
