"""Shared test harnesses: determinism matrix, elastic lanes, conservation, restores.

Every operator goes through these. They live in the package as
:mod:`zephon_torch.testing` (so a user runs the same contract on an operator
of their own); this module keeps the names the tests import from it.
"""

from __future__ import annotations

# Every public name of the package's module, under the same list.
from zephon_torch.testing import *  # noqa: F403
from zephon_torch.testing import __all__  # noqa: F401
