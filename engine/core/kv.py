"""KV cache operations as data: the runtime applies them, the wire protocol carries them.

Keeping them as values (not method calls) is what lets a pipeline apply the same operations,
in the same order relative to the decodes, on every stage (PipeInfer's "transactions").
Positions: ``p0`` inclusive, ``p1`` exclusive, ``-1`` an open end.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_OPS = ("rm", "cp", "keep", "add")
# Kept conversations (core/prompt_cache): a sequence's cells saved under a slot number on every
# stage where they live (a cluster's workers keep their own layers' cells), put back (into the
# same sequence or another one: several conversations decoded together, core/lanes.py), forgotten.
SLOT_OPS = ("save", "load", "drop")
MAX_SLOT = (1 << 31) - 1


@dataclass(frozen=True)
class KvOp:
    """``rm``: drop ``seq`` [p0, p1); ``cp``: copy ``seq`` -> ``dst`` (whole sequences only
    across KV streams); ``keep``: drop every sequence but ``seq``; ``add``: shift ``seq``
    [p0, p1) by ``delta``; ``save`` / ``load``: sequence ``seq``'s cells as slot ``dst``
    (:class:`~.stage.Stage` keeps them), ``drop``: forget slot ``dst``."""

    op: str
    seq: int
    dst: int = -1
    p0: int = -1
    p1: int = -1
    delta: int = 0

    def __post_init__(self) -> None:
        if self.op not in KV_OPS + SLOT_OPS:
            raise ValueError(f"kv op must be one of {KV_OPS + SLOT_OPS}, got {self.op!r}")
        if self.op in SLOT_OPS and (self.seq < 0 or not 0 <= self.dst <= MAX_SLOT):
            raise ValueError(f"kv {self.op}: a sequence and a slot in 0..{MAX_SLOT}, got {self.seq} and {self.dst}")

    @property
    def is_slot_op(self) -> bool:
        return self.op in SLOT_OPS

    @classmethod
    def rm(cls, seq: int, p0: int = -1, p1: int = -1) -> KvOp:
        return cls("rm", seq, p0=p0, p1=p1)

    @classmethod
    def cp(cls, src: int, dst: int, p0: int = -1, p1: int = -1) -> KvOp:
        return cls("cp", src, dst=dst, p0=p0, p1=p1)

    @classmethod
    def keep(cls, seq: int) -> KvOp:
        return cls("keep", seq)

    @classmethod
    def add(cls, seq: int, p0: int, p1: int, delta: int) -> KvOp:
        return cls("add", seq, p0=p0, p1=p1, delta=delta)

    @classmethod
    def save(cls, slot: int, seq: int = 0) -> KvOp:
        return cls("save", seq, dst=slot)

    @classmethod
    def load(cls, slot: int, seq: int = 0) -> KvOp:
        return cls("load", seq, dst=slot)

    @classmethod
    def drop(cls, slot: int) -> KvOp:
        return cls("drop", 0, dst=slot)
