"""KV cache operations as data: the runtime applies them, the wire protocol carries them.

Keeping them as values (not method calls) is what lets a pipeline apply the same operations,
in the same order relative to the decodes, on every stage (PipeInfer's "transactions").
Positions: ``p0`` inclusive, ``p1`` exclusive, ``-1`` an open end.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_OPS = ("rm", "cp", "keep", "add")


@dataclass(frozen=True)
class KvOp:
    """``rm``: drop ``seq`` [p0, p1); ``cp``: copy ``seq`` -> ``dst`` (whole sequences only
    across KV streams); ``keep``: drop every sequence but ``seq``; ``add``: shift ``seq``
    [p0, p1) by ``delta``."""

    op: str
    seq: int
    dst: int = -1
    p0: int = -1
    p1: int = -1
    delta: int = 0

    def __post_init__(self) -> None:
        if self.op not in KV_OPS:
            raise ValueError(f"kv op must be one of {KV_OPS}, got {self.op!r}")

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
