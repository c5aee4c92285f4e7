"""Reduction operators, named like torch.distributed.ReduceOp but importable without torch."""

from __future__ import annotations

from enum import Enum


# A public type, kept a (str, Enum) as it was (UP042 would make it a StrEnum: another base class).
class ReduceOp(str, Enum):  # noqa: UP042
    """How a reducing op (`all_reduce`, `reduce`, `reduce_scatter`) combines the ranks' tensors;
    torch.distributed's own `ReduceOp` (PREMUL_SUM included) and a name as a string ("sum") are
    taken too."""

    SUM = "SUM"
    AVG = "AVG"
    PRODUCT = "PRODUCT"
    MIN = "MIN"
    MAX = "MAX"
    BAND = "BAND"
    BOR = "BOR"
    BXOR = "BXOR"

    # The value Enum's own __hash__ gives (names equal values), computed in C: every reducing
    # op looks its options up by it.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return f"ReduceOp.{self.value}"
