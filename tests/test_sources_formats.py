"""Source formats are registered modules, and the source options are one object.

Each format (items, JSONL, Parquet, text files) registers a ``SourceFormat``;
the ``Pipeline.from_*`` builders and the command line's ``--format`` are read
from the registry. The seven source options are defined, checked and
documented once, in ``SourceOptions``, and every builder takes exactly them.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from zephon_torch import _cli_inspect, cli
from zephon_torch.pipeline import Pipeline, SourceConfig
from zephon_torch.pipeline_sources import derived_builder
from zephon_torch.sources import SourceOptions
from zephon_torch.sources import datasets as zd
from zephon_torch.sources.formats import registry as formats_registry
from zephon_torch.sources.formats.registry import (
    CommandLineFormat,
    SourceFormat,
    command_line_formats,
    format_named,
    register,
    registered_formats,
)
from zephon_torch.sources.options import SOURCE_OPTION_NAMES, document_source_options

_MIXTURE_ONLY = ("component_id", "name", "passes")


def test_the_built_in_formats_are_registered_with_their_factories_and_builders() -> None:
    assert [(f.name, f.factory, f.builder) for f in registered_formats()] == [
        ("items", zd.items, "from_items"),
        ("jsonl", zd.jsonl, "from_jsonl"),
        ("parquet", zd.parquet, "from_parquet"),
        ("text_files", zd.text_files, "from_text_files"),
    ]
    assert list(command_line_formats()) == ["jsonl", "parquet", "text"]
    with pytest.raises(KeyError, match="no source format is named 'csv'"):
        format_named("csv")


@pytest.mark.parametrize("fmt", registered_formats(), ids=lambda f: f.name)
def test_each_builder_takes_its_formats_options_and_the_source_options(fmt: SourceFormat) -> None:
    assert fmt.builder is not None
    ours = [p.name for p in inspect.signature(getattr(Pipeline, fmt.builder)).parameters.values()
            if p.name != "cls"]
    own = [p.name for p in inspect.signature(fmt.factory).parameters.values()
           if p.name not in _MIXTURE_ONLY]
    assert ours == [*own, *SOURCE_OPTION_NAMES]


def test_a_builder_reads_what_its_format_makes(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    built = Pipeline.from_jsonl(str(path), num_lanes=2, cache_dir=tmp_path)
    mixed = Pipeline.from_sources([zd.jsonl(str(path), cache_dir=tmp_path)], num_lanes=2)
    assert built.fingerprint() == mixed.fingerprint()


def test_the_source_options_have_the_source_configs_defaults() -> None:
    config = {f.name: f.default for f in dataclasses.fields(SourceConfig)}
    assert {f.name: f.default for f in dataclasses.fields(SourceOptions)} == {
        name: config[name] for name in SOURCE_OPTION_NAMES}
    assert SourceOptions.collect({**SourceOptions().as_dict(), "paths": "x"}) == SourceOptions()


@pytest.mark.parametrize("bad", [
    {"num_lanes": 0}, {"num_lanes": True}, {"chunk_size": -1}, {"seed": 1.5},
    {"flush_every_k_chunks": -1}, {"passes": 0}, {"exhausted": "never"},
])
def test_the_source_options_refuse_what_the_source_config_refuses_in_the_same_words(
        bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as options_error:
        SourceOptions(**bad)
    with pytest.raises(ValueError) as config_error:
        SourceConfig(datasets=(zd.items(["a"]),), **bad)
    assert str(options_error.value) == str(config_error.value)
    with pytest.raises(ValueError, match=str(next(iter(bad)))):
        Pipeline.from_items(["a"], **bad)


def test_a_dataset_error_comes_before_an_option_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Pipeline.from_jsonl(str(tmp_path / "missing.jsonl"), num_lanes=0)


def test_the_fingerprint_of_a_builder_is_unchanged() -> None:
    # Pinned: a checkpoint written before the formats had modules of their own loads.
    pipe = Pipeline.from_items(["a", {"text": "b"}], num_lanes=2, seed=3, passes=None).batch(1)
    assert pipe.fingerprint() == {
        "datasets": [{"kind": "items", "name": "items", "component_id": 0, "passes": None,
                      "shards": [["items", 2]], "content": "fd800fe0:2:-:-"}],
        "weights": None, "num_lanes": 2, "chunk_size": 512, "seed": 3,
        "flush_every_k_chunks": 0, "passes": None, "shuffle": False, "exhausted": "repeat",
        "ops": [{"op": "zephon_torch.ops.batch.Batch", "microbatch_size": 1, "drop_last": True}],
    }
    assert pipe.fingerprint_digest() == "0949f206383e1a45"


def test_every_builder_documents_the_source_options_in_the_order_of_its_signature() -> None:
    for fmt in registered_formats():
        builder = getattr(Pipeline, fmt.builder or "")
        doc = inspect.getdoc(builder) or ""
        for name in SOURCE_OPTION_NAMES:
            assert f"    {name}: " in doc, (fmt.name, name)
    assert "A lane is the unit of" in (inspect.getdoc(Pipeline.from_sources) or "")
    assert "Read in a seeded order (default: the items' order)" in (
        inspect.getdoc(Pipeline.from_items) or "")


def test_a_builder_with_an_undocumented_parameter_is_refused_at_definition() -> None:
    def from_thing(paths: str, *, colour: str = "red", num_lanes: int = 8) -> None:
        """Things.

        Args:
            paths: Where.
        """

    with pytest.raises(ValueError, match=r"\['colour'\] are not documented"):
        document_source_options(from_thing)


def test_a_registered_format_is_offered_by_the_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(formats_registry, "_REGISTRY", dict(formats_registry._REGISTRY))
    register(SourceFormat(
        name="csv_lines", factory=zd.text_files,
        command_line=CommandLineFormat(name="csv", label="CSV", suffixes=(".csv",),
                                       endings=(".csv",), rank=-1)))
    (tmp_path / "a.csv").write_text("x,y\n")
    assert _cli_inspect._format_of("data/*.csv") == "csv"
    assert _cli_inspect._folder_files(tmp_path, "auto") == ("csv", [str(tmp_path / "a.csv")])
    source = _cli_inspect._source_for(str(tmp_path / "a.csv"), "auto", num_lanes=1)
    assert [d.kind for d in source.source.datasets] == ["text_files"]
    inspect_parser = cli._parser()._subparsers._group_actions[0].choices["inspect"]
    choices = next(a.choices for a in inspect_parser._actions if a.dest == "format")
    assert choices == ["auto", "csv", "jsonl", "parquet", "text"]
    with pytest.raises(ValueError, match="already named 'csv' on the command line"):
        register(SourceFormat(name="other", factory=zd.text_files,
                              command_line=CommandLineFormat(name="csv", label="CSV",
                                                             suffixes=(".csv",))))


@pytest.mark.parametrize("fmt", registered_formats(), ids=lambda f: f.name)
def test_a_derived_builder_reads_as_the_written_one(fmt: SourceFormat, tmp_path: Path) -> None:
    # The written builders stay for IDEs; what the registry derives takes the same
    # parameters and builds the same pipeline.
    derived = derived_builder(fmt).__get__(None, Pipeline)
    written = getattr(Pipeline, fmt.builder or "")
    assert list(inspect.signature(derived).parameters) == list(
        inspect.signature(written.__func__).parameters)[1:]
    if fmt.name == "items":
        what: Any = ["a", "b c", "d"]
    elif fmt.name == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa
        pq.write_table(pa.table({"text": ["a", "b c", "d"]}), tmp_path / "a.parquet")
        what = str(tmp_path / "a.parquet")
    else:
        (tmp_path / "a.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
        what = str(tmp_path / "a.jsonl")
    options = {"num_lanes": 2, "seed": 5, "shuffle": False}
    if fmt.name == "jsonl":
        options["cache_dir"] = tmp_path
    assert derived(what, **options).fingerprint() == written(what, **options).fingerprint()


def test_a_new_format_gets_its_builder_derived(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(formats_registry, "_REGISTRY", dict(formats_registry._REGISTRY))
    assert not hasattr(Pipeline, "from_notes")

    def notes(paths: str, *, component_id: int = 0, name: str | None = None,
              passes: int | None = None, field: str = "note") -> Any:
        """Notes: text files under another field."""
        return zd.text_files(paths, component_id=component_id, name=name, passes=passes,
                             field=field)

    register(SourceFormat(name="notes", factory=notes, builder="from_notes"))
    try:
        builder = Pipeline.from_notes
        assert list(inspect.signature(builder).parameters) == [
            "paths", "field", *SOURCE_OPTION_NAMES]
        doc = inspect.getdoc(builder) or ""
        assert "made by ``" in doc and "    field: Passed to" in doc
        assert "    num_lanes: Lanes the samples are dealt to" in doc
        (tmp_path / "n.txt").write_text("remember the milk")
        pipe = builder(str(tmp_path / "n.txt"), field="memo", num_lanes=1).fetch().decode_text()
        assert [r.payload for b in pipe.batch(1) for r in b] == [{"memo": "remember the milk"}]
        with pytest.raises(ValueError, match="num_lanes"):
            builder(str(tmp_path / "n.txt"), num_lanes=0)
        with pytest.raises(TypeError):
            builder(str(tmp_path / "n.txt"), colour="red")
    finally:
        delattr(Pipeline, "from_notes")


def test_the_typed_keywords_are_the_source_options() -> None:
    # SourceKwargs is what a type checker reads for **options; it must name the
    # options SourceOptions defines, with the same types.
    from zephon_torch.sources.options import SourceKwargs

    assert tuple(SourceKwargs.__annotations__) == SOURCE_OPTION_NAMES
    assert {k: getattr(v, "__forward_arg__", v)
            for k, v in SourceKwargs.__annotations__.items()} == {
        f.name: str(f.type) for f in dataclasses.fields(SourceOptions)}


@pytest.mark.parametrize("builder", ["from_items", "from_jsonl", "from_sources"])
def test_an_unknown_keyword_is_refused_in_pythons_words_before_anything_is_read(
        builder: str, tmp_path: Path) -> None:
    what: Any = {"from_items": ["a"], "from_jsonl": str(tmp_path / "missing.jsonl"),
                 "from_sources": [zd.items(["a"])]}[builder]
    with pytest.raises(TypeError, match=rf"^Pipeline\.{builder}\(\) got an unexpected "
                                        r"keyword argument 'num_lane'$"):
        getattr(Pipeline, builder)(what, num_lane=2)
    with pytest.raises(TypeError, match="positional argument"):
        getattr(Pipeline, builder)(what, None, 8)
