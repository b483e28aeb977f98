"""Operators: the operator contract, accumulators and the built-in operators."""

from zephon_torch.ops import accumulators
from zephon_torch.ops.base import (
    TOMBSTONE_REASON_TAG,
    Element,
    OpContext,
    Operator,
    OpTraits,
    check_elements,
    tombstone,
)

__all__ = [
    "TOMBSTONE_REASON_TAG",
    "Element",
    "OpContext",
    "OpTraits",
    "Operator",
    "accumulators",
    "check_elements",
    "tombstone",
]
