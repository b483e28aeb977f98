"""Optional C extensions, compiled at install time when a C compiler is present.

``binpack`` is the packers' placement kernel. Nothing here is imported
directly: :mod:`zephon_torch.ops._binpack` loads it when it was built and
falls back to its pure-Python twin (with a one-time warning) when it was not.
"""
