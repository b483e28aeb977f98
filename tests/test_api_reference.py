"""The builder methods spell out their options, and the API reference shows them.

Every public builder of :class:`~zephon_torch.Pipeline` takes exactly its
operator's parameters (names, order, kinds, annotations and defaults), so
``help()``, an IDE and the API reference show what the operator accepts,
and no builder can drift from its operator. The reference itself is built
with pdoc from the docstrings (``scripts/api_docs.py``), offline.
"""

from __future__ import annotations

import dataclasses
import doctest
import html
import inspect
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import zephon_torch
from zephon_torch import pipeline as pipeline_module
from zephon_torch import pipeline_sources
from zephon_torch.ops.batch import Batch
from zephon_torch.ops.io import DecodeText, Fetch
from zephon_torch.ops.mixture import EnsureMixture
from zephon_torch.ops.packing import PackFlat, PackSequences
from zephon_torch.ops.shuffle import Shuffle
from zephon_torch.ops.tokenize import Tokenize
from zephon_torch.ops.tokenize_chat import TokenizeChat
from zephon_torch.ops.transform import Filter, MapTransform
from zephon_torch.pipeline import Pipeline, SourceConfig
from zephon_torch.sources import datasets

ROOT = Path(__file__).resolve().parent.parent

#: Builder method -> the operator it appends.
BUILDERS: dict[str, type] = {
    "fetch": Fetch,
    "decode_text": DecodeText,
    "tokenize": Tokenize,
    "tokenize_chat": TokenizeChat,
    "map_transform": MapTransform,
    "filter": Filter,
    "pack_sequences": PackSequences,
    "pack_flat": PackFlat,
    "ensure_mixture": EnsureMixture,
    "shuffle": Shuffle,
    "batch": Batch,
}

#: Source constructor -> the dataset constructor it wraps (its own options only:
#: component ids, names and per-dataset passes belong to from_sources).
SOURCES: dict[str, Callable[..., Any]] = {
    "from_items": datasets.items,
    "from_jsonl": datasets.jsonl,
    "from_parquet": datasets.parquet,
    "from_text_files": datasets.text_files,
}
_MIXTURE_ONLY = ("component_id", "name", "passes")


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_each_builder_takes_exactly_its_operators_parameters_and_defaults(builder: str) -> None:
    ours = _params(getattr(Pipeline, builder))
    theirs = _params(BUILDERS[builder])
    assert ([(p.name, p.annotation, p.default) for p in ours]
            == [(p.name, p.annotation, p.default) for p in theirs])
    for mine, its in zip(ours, theirs):
        # A builder may make a parameter keyword-only where the operator does not.
        assert mine.kind == its.kind or (mine.kind is inspect.Parameter.KEYWORD_ONLY
                                         and its.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


@pytest.mark.parametrize("constructor", sorted(SOURCES))
def test_each_source_constructor_takes_its_datasets_and_the_source_options(
        constructor: str) -> None:
    ours = {p.name: p for p in _params(getattr(Pipeline, constructor))}
    assert not [p for p in ours.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    dataset_params = [p for p in _params(SOURCES[constructor]) if p.name not in _MIXTURE_ONLY]
    for p in dataset_params:
        assert p.name in ours, f"{constructor} lacks the dataset option {p.name!r}"
        assert (ours[p.name].default, ours[p.name].annotation) == (p.default, p.annotation)
    # lane_changes is set by Pipeline.change_lanes on a resume, never by a builder.
    options = [f for f in dataclasses.fields(SourceConfig)
               if f.name not in ("datasets", "weights", "lane_changes")]
    for f in options:
        assert f.name in ours, f"{constructor} lacks the source option {f.name!r}"
        if not (constructor == "from_items" and f.name == "shuffle"):  # items keep their order
            assert ours[f.name].default == f.default, (constructor, f.name)
    assert set(ours) == {p.name for p in dataset_params} | {f.name for f in options}
    assert ours["seed"].kind is inspect.Parameter.KEYWORD_ONLY


def test_from_sources_takes_its_defaults_from_the_source_config() -> None:
    ours = {p.name: p.default for p in _params(Pipeline.from_sources)}
    for f in dataclasses.fields(SourceConfig):
        if f.name not in ("datasets", "lane_changes"):  # lane_changes: set by change_lanes
            assert ours[f.name] == f.default, f.name


@pytest.mark.parametrize("name", sorted([*BUILDERS, *SOURCES, "from_sources", "iter"]))
def test_each_builder_documents_every_parameter_in_its_own_docstring(name: str) -> None:
    doc = inspect.getdoc(getattr(Pipeline, name)) or ""
    assert "ops/" not in doc, f"{name} sends the reader to the source code"
    args = doc.split("Args:", 1)[1].split("\n\n", 1)[0] if "Args:" in doc else ""
    documented = re.findall(r"^    (\w+):", args, re.M)
    assert documented == [p.name for p in _params(getattr(Pipeline, name))], name


@pytest.mark.parametrize("module", [pipeline_module, pipeline_sources])
def test_the_docstring_examples_of_the_builders_run(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_the_package_ships_its_type_hints() -> None:
    assert (Path(zephon_torch.__file__).parent / "py.typed").is_file()


@pytest.mark.slow
def test_the_api_reference_builds_offline_and_shows_every_builder_option(
        tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "api_docs.py"),
                             "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # pdoc warns of a name it cannot resolve (a lazily imported one) and leaves it out.
    assert "Warning" not in result.stderr, result.stderr
    page = tmp_path / "zephon_torch" / "pipeline.html"
    assert (tmp_path / "index.html").is_file() and page.is_file()
    for module in ("torch/loader", "lightning", "ops/tokenize", "ops/packing", "sources"):
        assert (tmp_path / "zephon_torch" / f"{module}.html").is_file(), module
    package = (tmp_path / "zephon_torch.html").read_text(encoding="utf-8")
    assert 'id="DataLoader"' in package  # zt.DataLoader, imported on first use
    text = page.read_text(encoding="utf-8")
    # Nothing the pages need comes from the network.
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)=["']https?://""", text)
    plain = html.unescape(re.sub(r"<[^>]+>", "", text))
    plain = " ".join(plain.split())
    for name in [*BUILDERS, *SOURCES]:
        for p in _params(getattr(Pipeline, name)):
            shown = p.name if p.default is p.empty else f"{p.name}: "
            assert shown in plain, (name, p.name)
            if p.default is not p.empty and isinstance(p.default, (int, str)):
                assert f"= {p.default!r}" in plain, (name, p.name, p.default)
    # Google-style sections are rendered, not shown raw.
    assert "Row length: the model's sequence length + 1" in plain
    assert "Args:" not in plain
