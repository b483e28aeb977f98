"""Build configuration beyond pyproject.toml: the optional C kernels.

``binpack`` is the packers' placement kernel, ``training`` the fused kernel of
``SampleBatch.to_training``. Both are ``optional=True``: where no C compiler
(or no Python headers) is found the build goes on without them, and the
code uses their pure-Python twins (``zephon_torch/ops/_binpack.py``, the numpy
code of ``zephon_torch/_training_columns.py``: same results, slower; a one-time
warning says so). Editable installs (``pip install -e .``) build them in place.

The ``to_training`` kernel's row loops are written for the compiler to
vectorise, which gcc does at ``-O3`` (its ``-O2``, what some Pythons are built
with, vectorises much less: about 2x slower here), so GCC-style compilers get
``-O3`` for it.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: Extensions whose loops need the vectoriser at full strength.
_VECTORISED = {"zephon_torch._native.training"}


class _BuildExt(build_ext):
    """``build_ext`` adding ``-O3`` to :data:`_VECTORISED` for GCC-style compilers."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name in _VECTORISED and self.compiler.compiler_type == "unix":
            ext.extra_compile_args = [*ext.extra_compile_args, "-O3"]
        super().build_extension(ext)


setup(
    cmdclass={"build_ext": _BuildExt},
    ext_modules=[
        Extension(
            "zephon_torch._native.binpack",
            sources=["zephon_torch/_native/binpack.c"],
            optional=True,
        ),
        Extension(
            "zephon_torch._native.training",
            sources=["zephon_torch/_native/training.c"],
            optional=True,
        ),
    ]
)
