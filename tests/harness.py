"""Shared test harnesses: determinism matrix, elastic lanes, conservation, restores.

Every operator goes through these. They live in the package as
:mod:`zephon_torch.testing` (so a user runs the same contract on an operator
of their own); this module keeps the names the tests import from it.
"""

from __future__ import annotations

from zephon_torch.testing import (
    RUNNERS,
    assert_conserved,
    assert_deterministic,
    assert_elastic,
    assert_restores_everywhere,
    assert_same,
    check_operator_contract,
    closed_samples,
    collect,
    describe,
    lane_of,
    matrix,
    per_lane,
    small_microbatch_sizes,
    token_total,
)

__all__ = [
    "RUNNERS",
    "assert_conserved",
    "assert_deterministic",
    "assert_elastic",
    "assert_restores_everywhere",
    "assert_same",
    "check_operator_contract",
    "closed_samples",
    "collect",
    "describe",
    "lane_of",
    "matrix",
    "per_lane",
    "small_microbatch_sizes",
    "token_total",
]
