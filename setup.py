"""Build configuration beyond pyproject.toml: the optional C placement kernel.

``optional=True``: where no C compiler (or no Python headers) is found the
build goes on without it, and the packers use the pure-Python twin in
``zephon_torch/ops/_binpack.py`` (same decisions, slower; a one-time warning
says so). Editable installs (``pip install -e .``) build it in place.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "zephon_torch._native.binpack",
            sources=["zephon_torch/_native/binpack.c"],
            optional=True,
        )
    ]
)
