"""Every built-in operator and every stage-adding builder method is in the contract registry.

The registry (``tests/contract_registry.py``) names small pipelines that put
each operator through :func:`zephon_torch.testing.check_operator_contract`;
the ``test_ops_*`` modules run them. These tests fail, naming what is
missing, when an operator class under ``zephon_torch.ops`` or a builder
method of ``Pipeline`` has no case, when a case does not run what it claims,
or when no test module runs an operator module's cases.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from contract_registry import CASES, NOT_STAGE_BUILDERS, ContractData, registry

import zephon_torch.ops
from zephon_torch.ops import Operator
from zephon_torch.ops.fused import FusedOperator
from zephon_torch.pipeline import Pipeline

TESTS = Path(__file__).resolve().parent


def builtin_operators() -> set[type[Operator]]:
    """Every concrete ``Operator`` subclass defined in a module of ``zephon_torch.ops``.

    A class that other operators derive from and that names no stage of its
    own (``_PackOperator``, ``TokenizerOperator``: no ``name`` of its own) is
    a shared base, not an operator.
    """
    found: set[type[Operator]] = set()
    for info in pkgutil.walk_packages(zephon_torch.ops.__path__, "zephon_torch.ops."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (issubclass(cls, Operator) and cls is not Operator
                    and cls.__module__ == module.__name__):
                found.add(cls)
    bases = {base for cls in found for base in cls.__mro__[1:]}
    return {cls for cls in found if not inspect.isabstract(cls)
            and not (cls in bases and "name" not in vars(cls))}


def builder_methods() -> set[str]:
    """The public ``Pipeline`` instance methods that return a new pipeline."""
    names = set()
    for name, member in vars(Pipeline).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue  # classmethods (the sources), properties and private helpers
        if inspect.signature(member).return_annotation in ("Pipeline", Pipeline):
            names.add(name)
    return names


def test_the_walk_finds_the_operators_of_every_module() -> None:
    names = {cls.__name__ for cls in builtin_operators()}
    assert {"Fetch", "DecodeText", "Tokenize", "TokenizeChat", "MapTransform", "Filter",
            "PackFlat", "PackSequences", "EnsureMixture", "Shuffle", "Batch",
            "FusedOperator"} <= names
    assert "_PackOperator" not in names


def test_every_builtin_operator_is_in_the_contract_registry() -> None:
    missing = {f"{cls.__module__}.{cls.__qualname__}" for cls in builtin_operators()} - {
        f"{op.__module__}.{op.__qualname__}" for op in registry() if not isinstance(op, str)}
    assert not missing, (f"operators with no case in tests/contract_registry.py: "
                         f"{sorted(missing)}; add a small pipeline that checks each")


def test_every_stage_adding_builder_method_is_in_the_contract_registry() -> None:
    missing = {f"Pipeline.{name}" for name in builder_methods() - NOT_STAGE_BUILDERS} - {
        key for key in registry() if isinstance(key, str)}
    assert not missing, (f"builder methods with no case in tests/contract_registry.py: "
                         f"{sorted(missing)}; add a small pipeline that calls each")


def test_the_builder_methods_said_to_add_no_stage_add_none() -> None:
    pipe = Pipeline.from_items(["a", "b"]).map_transform(str)
    assert builder_methods() >= NOT_STAGE_BUILDERS
    assert len(pipe.with_source(seed=3).ops) == len(pipe.ops)
    from zephon_torch.sources import datasets as zd

    mixture = Pipeline.from_sources([zd.items(["a", "b"]), zd.items(["c"], component_id=1)],
                                    weights=[1.0, 1.0], num_lanes=1, chunk_size=1).batch(1)
    with mixture.iter(runner="inline") as it:
        next(it)
        state = it.state_dict()
    assert len(mixture.change_weights([1.0, 3.0], state=state).ops) == len(mixture.ops)
    one = Pipeline.from_sources([zd.items(["a", "b"])], num_lanes=1, chunk_size=1,
                                passes=None).batch(1)
    with one.iter(runner="inline") as it:
        next(it)
        state = it.state_dict()
    assert len(one.append_shards(state=state).ops) == len(one.ops)


def _calls_at_the_top(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the builder methods called from outside ``Pipeline`` (a builder that
    appends through ``apply`` counts once)."""
    called: list[str] = []
    depth = [0]

    def spy(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                called.append(name)
            depth[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name in builder_methods():
        monkeypatch.setattr(Pipeline, name, spy(name, getattr(Pipeline, name)))
    return called


def _compiled_operator_types(pipe: Pipeline) -> Iterator[type[Operator]]:
    for stage in pipe.compile():
        if stage.name == "replay_filter":
            continue
        yield type(stage.op)
        if isinstance(stage.op, FusedOperator):
            yield from (type(op) for op in stage.op.ops)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case_runs_the_operators_and_builders_it_names(
        name: str, contract_data: ContractData, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    called = _calls_at_the_top(monkeypatch)
    pipe = case.build(contract_data)
    assert set(called) == case.builders, f"{name} calls {sorted(set(called))}"
    ran = set(_compiled_operator_types(pipe))
    assert ran == case.operators, f"{name} runs {sorted(c.__name__ for c in ran)}"
    assert case.checks <= case.operators


def test_every_operator_module_has_a_test_module_that_runs_its_cases() -> None:
    run: set[str] = set()
    for path in sorted(TESTS.glob("test_*.py")):
        for call in re.findall(r"cases_for\(([^)]*)\)", path.read_text(encoding="utf-8")):
            run.update(re.findall(r"\"(zephon_torch\.[\w.]+)\"", call))
    missing = {cls.__module__ for cls in builtin_operators()} - run
    assert not missing, (f"no test module runs the contract cases of {sorted(missing)}: "
                         "add a test that runs contract_registry.cases_for(<module>)")
