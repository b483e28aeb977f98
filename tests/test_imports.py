"""The core must not pull in heavy frameworks at import time."""

import ast
import subprocess
import sys
from pathlib import Path


def test_import_zephon_torch_does_not_import_torch_lightning_or_ray() -> None:
    code = (
        "import sys, zephon_torch, zephon_torch.types, zephon_torch._training\n"
        "import zephon_torch.testing\n"
        "heavy = [m for m in ('torch', 'lightning', 'ray', 'torchdata') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == ""


def test_public_names_are_sorted_and_importable() -> None:
    import zephon_torch

    assert list(zephon_torch.__all__) == sorted(zephon_torch.__all__)
    for name in zephon_torch.__all__:
        assert hasattr(zephon_torch, name), name


def test_demo_runs_and_prints_training_tensors() -> None:
    result = subprocess.run([sys.executable, "-m", "zephon_torch.demo"], capture_output=True,
                            text=True, check=True)
    assert "labels: (4, 128) torch.int64" in result.stdout
    assert "cu_seqlens: (4, " in result.stdout
    assert "runner=threads x2 vs inline: identical output" in result.stdout
    assert "400 documents read" in result.stdout


_PACKAGE = Path(__file__).resolve().parent.parent / "zephon_torch"
#: The data model: ``types.py``, where its names are imported from, and the modules it
#: is written in (``_types_*.py``), all held to the same rules.
_DATA_MODEL = [_PACKAGE / "types.py", *sorted(_PACKAGE.glob("_types_*.py"))]
_DATA_MODEL_NAMES = tuple(f"zephon_torch.{path.stem}" for path in _DATA_MODEL)


def _imported(path: Path, *, at_import_only: bool = False) -> set[str]:
    """The absolute module names ``path`` imports (``from a import b`` gives ``a`` and ``a.b``).

    With ``at_import_only``, only what runs when the module is imported: not
    inside functions, not under ``if TYPE_CHECKING:``.
    """
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            if at_import_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if (at_import_only and isinstance(child, ast.If)
                    and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING"):
                continue
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def _offenders(paths: list[Path], forbidden: str, *, at_import_only: bool = False) -> list[str]:
    return [f"{path.relative_to(_PACKAGE.parent)} imports {name}"
            for path in paths for name in sorted(_imported(path, at_import_only=at_import_only))
            if name == forbidden or name.startswith(forbidden + ".")]


def test_lower_layers_never_import_the_layers_above_them() -> None:
    # The layering the package is built on: a lower module that imports a higher
    # one brings back the import circles the bottom-level modules were made to break.
    problems = [
        *_offenders(sorted((_PACKAGE / "sources").rglob("*.py")), "zephon_torch.ops"),
        *_offenders(sorted((_PACKAGE / "ops").rglob("*.py")), "zephon_torch.runners"),
        *_offenders([_PACKAGE / "accounting.py", _PACKAGE / "lane_progress.py",
                     _PACKAGE / "throughput.py"], "zephon_torch.runners"),
        *_offenders([_PACKAGE / "topology.py", _PACKAGE / "vocab.py"], "zephon_torch"),
        *_offenders(_DATA_MODEL, "zephon_torch._training", at_import_only=True),
        # The pipeline (a description) and the runners know no torch wrapper: lane
        # ownership for ranks and workers is topology.py's.
        *[problem for path in [_PACKAGE / "pipeline.py", *sorted((_PACKAGE / "runners").glob(
            "*.py"))] for layer in ("zephon_torch.torch", "zephon_torch.lightning",
                                    "zephon_torch._torch_hook")
          for problem in _offenders([path], layer, at_import_only=True)],
        # Lightning-specific code lives in lightning.py and its adapter, _lightning_compat.py:
        # the torch layer never imports lightning.py, not even inside a function (the
        # dependency points from lightning.py to the loader only), and the adapter imports
        # neither of them, nor Lightning itself.
        *_offenders(sorted((_PACKAGE / "torch").glob("*.py")), "zephon_torch.lightning"),
        *[problem for layer in ("zephon_torch.lightning", "zephon_torch.torch", "lightning",
                                "pytorch_lightning", "torch")
          for problem in _offenders([_PACKAGE / "_lightning_compat.py"], layer)],
    ]
    assert problems == []


def _frame_reads(path: Path) -> list[str]:
    """Where ``path`` reads the call stack: ``sys._getframe``, ``inspect.currentframe``,
    ``inspect.stack`` / ``inspect.getouterframes``, or a frame's ``f_back``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = None
        if isinstance(node, ast.Attribute) and node.attr in (
                "_getframe", "currentframe", "stack", "getouterframes", "f_back"):
            base = node.value.id if isinstance(node.value, ast.Name) else ""
            if node.attr in ("_getframe", "f_back") or base == "inspect":
                name = f"{base}.{node.attr}" if base else node.attr
        elif isinstance(node, ast.ImportFrom) and node.module in ("sys", "inspect"):
            name = next((f"{node.module}.{alias.name}" for alias in node.names if alias.name in
                         ("_getframe", "currentframe", "stack", "getouterframes")), None)
        if name is not None:
            found.append(f"{path.relative_to(_PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_no_module_walks_the_call_stack_lightning_is_followed_through_its_fit_loop() -> None:
    # How Lightning's fit loop stands with a loader is read from the loop itself
    # (_lightning_compat.py), never found on the call stack. The one exception is the
    # main-script guard, whose question is where the call comes from: whether the
    # main script's top-level code starts worker processes.
    allowed = {_PACKAGE / "_main_guard.py"}
    found = [read for path in sorted(_PACKAGE.rglob("*.py")) if path not in allowed
             for read in _frame_reads(path)]
    assert found == []
    assert _frame_reads(_PACKAGE / "_main_guard.py")  # the check sees what it looks for


def test_the_iter_keyword_list_is_pipeline_iters_signature() -> None:
    import inspect

    from zephon_torch.pipeline import Pipeline
    from zephon_torch.runners.iterator import ITER_KWARGS

    assert tuple(inspect.signature(Pipeline.iter).parameters)[1:] == ITER_KWARGS


def test_the_builder_the_data_model_and_the_checkpoints_reach_no_layer_above_them() -> None:
    # Every import counts here, inside functions and under TYPE_CHECKING too: a lower
    # module that imports a higher one in a function is the same circle, hidden.
    # The package root (zephon_torch/__init__.py) plugs the upper layers into the hooks
    # these modules declare (SampleBatch.to_training's conversion, the torch wrapper).
    problems = [
        *_offenders([_PACKAGE / "pipeline.py"], "zephon_torch.torch"),
        *_offenders([_PACKAGE / "pipeline.py"], "zephon_torch.lightning"),
        *_offenders(_DATA_MODEL, "zephon_torch._training"),
        # The data model stands on the vocabulary alone (its modules import each other).
        *[f"{path.relative_to(_PACKAGE.parent)} imports {name}"
          for path in _DATA_MODEL for name in sorted(_imported(path))
          if name.startswith("zephon_torch") and not name.startswith("zephon_torch.vocab")
          and not any(name == own or name.startswith(own + ".") for own in _DATA_MODEL_NAMES)],
        # Checkpoints know no operator's rules: each operator migrates its own states
        # (Operator.earlier_config / refuse_earlier_state), found through ops.base.
        *[f"zephon_torch/checkpoint.py imports {name}"
          for name in sorted(_imported(_PACKAGE / "checkpoint.py"))
          if name.startswith("zephon_torch.ops.") and not name.startswith("zephon_torch.ops.base")],
        # The fingerprint and its descriptions stand below the operators that use them.
        *_offenders([_PACKAGE / "fingerprint.py"], "zephon_torch.ops"),
        *_offenders([_PACKAGE / "fingerprint.py"], "zephon_torch.checkpoint"),
        # The planner and the replay filter read a pipeline's parts, not the builder.
        *[problem for path in (_PACKAGE / "planner.py", _PACKAGE / "replay.py")
          for layer in ("zephon_torch.pipeline", "zephon_torch.checkpoint",
                        "zephon_torch.runners")
          for problem in _offenders([path], layer)],
        *_offenders([_PACKAGE / "epochs.py"], "zephon_torch.pipeline", at_import_only=True),
    ]
    assert problems == []
    assert len(_DATA_MODEL) >= 4  # the check sees the data model's modules


def _runtime_import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports when it runs (inside functions too; not
    under ``if TYPE_CHECKING:``, which never runs)."""
    modules = {}
    for path in _PACKAGE.rglob("*.py"):
        parts = path.relative_to(_PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path

    def runtime(node: ast.AST) -> list[ast.AST]:
        found = []
        for child in ast.iter_child_nodes(node):
            if (isinstance(child, ast.If) and isinstance(child.test, ast.Name)
                    and child.test.id == "TYPE_CHECKING"):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            found.extend(runtime(child))
        return found

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in runtime(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif node.module and not node.level:
                named = [f"{node.module}.{alias.name}" for alias in node.names]
                if node.module != "zephon_torch":  # `from zephon_torch import x`: x alone
                    named.append(node.module)
            else:
                continue
            for target in named:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def test_the_package_imports_in_one_direction() -> None:
    # No import cycle anywhere in the package, counting imports inside functions
    # (the package root, which imports everything, is the top).
    graph = _runtime_import_graph()
    watched = set(graph) - {"zephon_torch"}
    assert len(watched) > 80  # the walk found the package's modules

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen and nxt != "zephon_torch":
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    assert sorted(m for m in watched if reaches(m, m)) == []
