"""Data-path messages: batches and KV operations down the pipeline, hidden states back.
Each carries ``txn`` so every stage applies them in one order."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...core.jobs import DecodeJob
from ...core.kv import KV_OPS, SLOT_OPS, KvOp
from .base import DTYPES, INT32_MAX, WireError, WireMessage


@dataclass(frozen=True)
class Forward(WireMessage):
    """One batch down the pipeline: token ids (to the first stage) or hidden states (later).

    ``inputs``: [n] i32 token ids, or [n, n_embd] f32/f16 hidden states.
    ``positions``, ``seq_ids``: [n] i32. ``outputs``: [n] u8, rows whose logits the head
    computes (every stage still computes every row: later layers need them all). ``skip``: the
    group was cancelled upstream; nothing is computed, order is kept.
    """

    TYPE = "forward"
    ARRAYS = ("inputs", "positions", "seq_ids", "outputs")
    txn: int
    group: int
    skip: bool
    inputs: np.ndarray = field(repr=False)
    positions: np.ndarray = field(repr=False)
    seq_ids: np.ndarray = field(repr=False)
    outputs: np.ndarray = field(repr=False)

    @classmethod
    def from_job(cls, txn: int, job: DecodeJob, inputs: np.ndarray | None = None) -> Forward:
        """``job`` as transaction ``txn``; ``inputs`` replaces its inputs (a stage's output)."""
        return cls(
            txn=txn,
            group=job.group,
            skip=False,
            inputs=job.inputs if inputs is None else inputs,
            positions=job.positions.astype("<i4", copy=False),
            seq_ids=job.seq_ids.astype("<i4", copy=False),
            outputs=job.outputs.astype("u1", copy=False),
        )

    def skipped(self) -> Forward:
        """The empty message a cancelled group still sends downstream (keeps txn order)."""
        empty = np.zeros(0, dtype="<i4")
        return Forward(self.txn, self.group, True, empty, empty, empty, np.zeros(0, dtype="u1"))

    def job(self) -> DecodeJob:
        inputs = self.inputs if self.is_tokens else self.inputs.astype(np.float32, copy=False)
        return DecodeJob(self.group, inputs, self.positions, self.seq_ids, self.outputs.astype(bool))

    @property
    def is_tokens(self) -> bool:
        return self.inputs.dtype == DTYPES["i32"]

    def check(self) -> None:
        if self.txn < 1 or self.group < 0:
            raise WireError("txn must be >= 1 and group >= 0")
        n = self.positions.shape[0] if self.positions.ndim == 1 else -1
        for name in ("positions", "seq_ids"):
            a = getattr(self, name)
            if a.dtype != DTYPES["i32"] or a.ndim != 1 or a.shape[0] != n:
                raise WireError(f"{name} must be an i32 array [n]")
        if self.outputs.dtype != DTYPES["u8"] or self.outputs.shape != (n,):
            raise WireError("outputs must be a u8 array [n]")
        if self.skip:
            return
        if n < 1:
            raise WireError("a batch needs at least one token")
        x = self.inputs
        if x.dtype == DTYPES["i32"]:
            if x.shape != (n,):
                raise WireError("token ids must be [n]")
        elif x.dtype in (DTYPES["f32"], DTYPES["f16"]):
            if x.ndim != 2 or x.shape[0] != n or x.shape[1] < 1:
                raise WireError("hidden states must be [n, n_embd]")
        else:
            raise WireError("inputs must be i32 token ids or f32/f16 hidden states")
        if self.positions.min() < 0 or self.seq_ids.min() < 0:
            raise WireError("positions and sequence ids must be >= 0")
        if not self.outputs.any():
            raise WireError("a batch must request at least one output row")
        if ((self.outputs != 0) & (self.outputs != 1)).any():
            raise WireError("outputs must be 0 or 1 per row")


@dataclass(frozen=True)
class KvApply(WireMessage):
    """A :class:`~potluck.engine.core.kv.KvOp` applied on every stage in pipeline order."""

    TYPE = "kv"
    txn: int
    group: int
    op: str
    seq: int
    dst: int
    p0: int
    p1: int
    delta: int

    @classmethod
    def from_op(cls, txn: int, op: KvOp, group: int = 0) -> KvApply:
        return cls(txn, group, op.op, op.seq, op.dst, op.p0, op.p1, op.delta)

    def kv_op(self) -> KvOp:
        return KvOp(self.op, self.seq, self.dst, self.p0, self.p1, self.delta)

    def check(self) -> None:
        if self.txn < 1 or self.group < 0:
            raise WireError("txn must be >= 1 and group >= 0")
        if self.op not in KV_OPS + SLOT_OPS:
            raise WireError(f"kv op must be one of {KV_OPS + SLOT_OPS}")
        if self.seq < 0 or self.dst < -1 or self.p0 < -1 or self.p1 < -1:
            raise WireError("negative sequence id or position")
        # llama.cpp takes these as int32: refuse what would wrap around before anything else
        if max(self.seq, self.dst, self.p0, self.p1, abs(self.delta)) > INT32_MAX:
            raise WireError("kv sequence id, position or shift beyond int32")
        if self.op in SLOT_OPS and (self.dst < 0 or (self.p0, self.p1, self.delta) != (-1, -1, 0)):
            raise WireError(f"kv {self.op} takes a sequence and a slot >= 0, nothing else")


@dataclass(frozen=True)
class Reset(WireMessage):
    """Clear every sequence of every stage (a new conversation)."""

    TYPE = "reset"
    txn: int

    def check(self) -> None:
        if self.txn < 1:
            raise WireError("txn must be >= 1")


@dataclass(frozen=True)
class Result(WireMessage):
    """Last worker -> head: the hidden states [n, n_embd] (f32, or f16 with ``hidden_dtype``
    f16) of every row of transaction ``txn``; the head runs its own last layer(s) and the
    output layer on them. Every row, not only output rows: the head's layer keeps a KV cache."""

    TYPE = "result"
    ARRAYS = ("hidden",)
    txn: int
    group: int
    skip: bool
    hidden: np.ndarray = field(repr=False)

    def check(self) -> None:
        if self.hidden.dtype not in (DTYPES["f32"], DTYPES["f16"]) or self.hidden.ndim != 2:
            raise WireError("hidden states must be f32 or f16 [n, n_embd]")


DATA: tuple[type[WireMessage], ...] = (Forward, KvApply, Reset, Result)
