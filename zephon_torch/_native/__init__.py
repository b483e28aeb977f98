"""Optional C extensions, compiled at install time when a C compiler is present.

``binpack`` is the packers' placement kernel and ``training`` the fused kernel
of ``SampleBatch.to_training``. Nothing here is imported directly:
:mod:`zephon_torch.ops._binpack` and :mod:`zephon_torch._training_native` load
them when they were built and fall back to their twins (pure Python, numpy),
with a one-time warning, when they were not.
"""
