"""Reduction operators, named like torch.distributed.ReduceOp but importable without torch."""

from __future__ import annotations

from enum import Enum


class ReduceOp(str, Enum):
    SUM = "SUM"
    AVG = "AVG"
    PRODUCT = "PRODUCT"
    MIN = "MIN"
    MAX = "MAX"
    BAND = "BAND"
    BOR = "BOR"
    BXOR = "BXOR"

    def __str__(self) -> str:
        return f"ReduceOp.{self.value}"
