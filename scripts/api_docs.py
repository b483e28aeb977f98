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
#: What is documented: the package; pdoc walks its public submodules itself.
MODULES = ("zephon_torch",)


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
