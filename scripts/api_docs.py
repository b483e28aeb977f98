"""Build the API reference: HTML pages made by pdoc from the package's docstrings.

Run as ``bash scripts/api-docs [OUT]`` (which sets up ``.venv`` first), or
with any Python that has the package and its ``dev`` extra:
``python scripts/api_docs.py [--out OUT]``. The default output folder is
``docs/api/`` (not committed: the pages are made from the code, so they
cannot fall behind it). Nothing is fetched from the network: pdoc renders
the pages from the imported modules and ships its own templates, scripts
and styles.

Every public module is documented, including the integrations
(``zephon_torch.torch``, ``zephon_torch.lightning``); building therefore
imports torch and Lightning, as the ``dev`` extra installs them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What is documented, one page each: the package and the modules a user imports from
#: or meets in tracebacks and type hints. pdoc follows a package's ``__all__``, which
#: names few submodules, so the operator and runner modules are listed here.
MODULES = (
    "zephon_torch",
    "zephon_torch.pipeline",
    "zephon_torch.types",
    "zephon_torch.checkpoint",
    "zephon_torch.checks",
    "zephon_torch.testing",
    "zephon_torch.epochs",
    "zephon_torch.length",
    "zephon_torch.logs",
    "zephon_torch.ops",
    "zephon_torch.ops.io",
    "zephon_torch.ops.tokenize",
    "zephon_torch.ops.tokenize_chat",
    "zephon_torch.ops.chat_templates",
    "zephon_torch.ops.transform",
    "zephon_torch.ops.packing",
    "zephon_torch.ops.mixture",
    "zephon_torch.ops.shuffle",
    "zephon_torch.ops.batch",
    "zephon_torch.ops.placement",
    "zephon_torch.runners.iterator",
    "zephon_torch.torch",
    "zephon_torch.torch.loader",
    "zephon_torch.torch.dataset",
    "zephon_torch.torch.node",
    "zephon_torch.lightning",
)


def _resolve_lazy_names() -> None:
    """Import the names the packages import on first use (``zephon_torch.DataLoader``).

    pdoc looks a name of ``__all__`` up in the module's namespace, where a
    lazily imported one is not until it is first used: use each once.
    """
    import importlib

    for name in MODULES:
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):
            getattr(module, public)


def build(out: Path) -> Path:
    """Write the reference into ``out``; return the path of its index page.

    Raises:
        ImportError: pdoc is not installed (``pip install -e '.[dev]'``).
    """
    try:
        import pdoc
        import pdoc.render
    except ImportError as exc:
        raise ImportError("the API reference is built with pdoc, which is not installed; "
                          "install it with: pip install -e '.[dev]' (or pip install pdoc)"
                          ) from exc
    # Docstrings are Google style; the source view would double the pages' size.
    pdoc.render.configure(docformat="google", show_source=False,
                          footer_text="zephon_torch API reference")
    _resolve_lazy_names()
    out.mkdir(parents=True, exist_ok=True)
    pdoc.pdoc(*MODULES, output_directory=out)
    return out / "index.html"


def main(argv: list[str] | None = None) -> int:
    """Command line: ``api_docs.py [--out OUT]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "api",
                        help="output folder (default: docs/api)")
    args = parser.parse_args(argv)
    index = build(args.out)
    print(f"API reference -> {index}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's package, when run from anywhere
    sys.exit(main())
