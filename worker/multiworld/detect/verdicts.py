"""A world's verdict, and the store keys where members write verdicts and epochs (no torch).

The first member to reach a verdict on a world writes it to the world's abort key, where the
others read it (see detector.py, rendezvous.py); the epoch key says which epoch is current.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class Verdict(BaseModel):
    """What a member writes to a world's abort key: why the world is broken."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    reason: str
    peer_rank: int | None = None
    by_rank: int
    # True when a member drops the world on purpose (leaves, closes, moves on): the others
    # break it too, but nothing failed, so nobody reports it.
    deliberate: bool = False

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: bytes) -> Verdict:
        try:
            return cls.model_validate_json(raw)
        except ValidationError:
            return cls(reason=raw.decode(errors="replace"), by_rank=-1)

    def describe(self) -> str:
        return self.reason if self.by_rank < 0 else f"{self.reason} (verdict of rank {self.by_rank})"


def abort_key(prefix: str) -> str:
    return f"{prefix}abort"


def epoch_key(world: str) -> str:
    """Outside the epoch prefix on purpose: it says which epoch is current. Used by worlds
    without a secret only (rendezvous.py says why)."""
    return f"{world}/epoch"
