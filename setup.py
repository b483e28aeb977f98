"""Build configuration beyond pyproject.toml: the optional C kernels.

``binpack`` is the packers' placement kernel, ``training`` the fused kernel of
``SampleBatch.to_training``. Both are ``optional=True``: where no C compiler
(or no Python headers) is found the build goes on without them, and the
code uses their pure-Python twins (``zephon_torch/ops/_binpack.py``, the numpy
code of ``zephon_torch/_training.py``: same results, slower; a one-time
warning says so). Editable installs (``pip install -e .``) build them in place.
"""

from setuptools import Extension, setup

setup(
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
