"""Optional dependencies: each belongs to an extra of the package, named in the error.

The core installs numpy, cloudpickle, tokenizers and torch; everything else
is an extra (``pip install 'zephon-torch[parquet]'``). A module that needs an
optional package imports it with :func:`require` (or, at module level,
re-raises through :func:`missing`), so that a user without it reads which
pip package and which extra to install rather than a bare
``ModuleNotFoundError``. ``tests/test_install.py`` checks that every entry of
:data:`EXTRAS` names a real extra of ``pyproject.toml`` holding that package.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "missing", "require"]

#: Importable top-level module -> (pip package, extra of zephon-torch that installs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "pyarrow": ("pyarrow", "parquet"),
    "zstandard": ("zstandard", "zstd"),
    "fsspec": ("fsspec", "fsspec"),
    "ray": ("ray", "ray"),
    "lightning": ("lightning", "lightning"),
    "torchdata": ("torchdata", "torchdata"),
}


def missing(module: str, why: str) -> ImportError:
    """The error to raise when ``module`` (a key of :data:`EXTRAS`) is not installed.

    Args:
        module: The top-level module that failed to import.
        why: What needs it, as the start of a sentence (``"reading Parquet files"``).
    """
    package, extra = EXTRAS[module]
    return ImportError(f"{why} needs the {package!r} package, which is not installed; install "
                       f"it with: pip install 'zephon-torch[{extra}]' (or pip install {package})")


def require(module: str, why: str) -> ModuleType:
    """Import ``module`` (``"pyarrow.parquet"``), or say which extra installs it.

    Raises:
        ImportError: Its package is not installed (the message names the pip
            package and the extra). An error raised while an installed
            package imports propagates as it is.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if (exc.name or "").split(".")[0] != top:
            raise  # the package is there but something it imports is not
        raise missing(top, why) from exc
