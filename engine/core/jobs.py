"""Units of work a target runs: :class:`DecodeJob` (one batch) and the :class:`Ticket` that
redeems its result.

A job names everything llama.cpp needs and nothing else: its inputs (token ids, or hidden
states for a later pipeline stage), explicit positions, one sequence id per row and the rows
whose logits come back. Every job belongs to a job group (``group``; a reply's ``run_id`` is another thing):
cancelling a group skips its queued jobs and aborts the one computing, so speculative work that lost its reason to exist
stops costing time (PipeInfer's early cancellation).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np


class GroupCancelled(InterruptedError):
    """The job's group was cancelled before or while it computed; its KV cells are gone."""


class CancelledGroups:
    """Job groups cancelled lately, oldest forgotten first: a job of one of them that arrives
    later is skipped. Bounded, since groups are short-lived and numbered upward. One kind for
    a stage's runner, a worker (cancels and jobs come on different pipes) and a pipeline's head."""

    KEPT = 4096

    def __init__(self) -> None:
        self._groups: dict[int, None] = {}  # insertion order: oldest first

    def add(self, groups: Iterable[int]) -> None:
        for group in groups:
            self._groups[group] = None
        while len(self._groups) > self.KEPT:
            del self._groups[next(iter(self._groups))]

    def __contains__(self, group: object) -> bool:
        return group in self._groups

    def __iter__(self) -> Iterator[int]:
        """Oldest first (a rebuilt chain is told them again)."""
        return iter(self._groups)

    def clear(self) -> None:
        self._groups.clear()


@dataclass(frozen=True)
class DecodeJob:
    group: int
    inputs: np.ndarray = field(repr=False)  # [n] i32 token ids, or [n, n_embd] f32 hidden states
    positions: np.ndarray = field(repr=False)  # [n] i32
    seq_ids: np.ndarray = field(repr=False)  # [n] i32, one sequence per row
    outputs: np.ndarray = field(repr=False)  # [n] bool: rows whose logits come back, in order

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def n_outputs(self) -> int:
        return int(np.count_nonzero(self.outputs))

    @property
    def is_tokens(self) -> bool:
        return self.inputs.ndim == 1

    def rows(self, lo: int, hi: int) -> DecodeJob:
        """Rows ``lo:hi`` as a job of their own whose last row is its output (a rollback
        computes kept rows again: core/rollback.py)."""
        return DecodeJob(
            self.group, self.inputs[lo:hi], self.positions[lo:hi], self.seq_ids[lo:hi], output_mask(hi - lo, "last")
        )

    @classmethod
    def tokens(
        cls,
        group: int,
        tokens: Sequence[int] | np.ndarray,
        pos0: int,
        *,
        seq_id: int = 0,
        outputs: str | Sequence[bool] = "last",
    ) -> DecodeJob:
        """Tokens at positions ``pos0...`` of one sequence; ``outputs``: "last", "all" or a mask."""
        ids = np.asarray(tokens, dtype=np.int32)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("a decode job needs at least one token")
        return cls(
            group,
            ids,
            np.arange(pos0, pos0 + n, dtype=np.int32),
            np.full(n, seq_id, dtype=np.int32),
            output_mask(n, outputs),
        )


def output_mask(n: int, outputs: str | Sequence[bool]) -> np.ndarray:
    if outputs == "all":
        return np.ones(n, dtype=bool)
    if outputs == "last":
        mask = np.zeros(n, dtype=bool)
        mask[-1] = True
        return mask
    mask = np.asarray(outputs, dtype=bool)
    if mask.shape != (n,):
        raise ValueError(f"output mask of shape {mask.shape} for {n} rows")
    return mask


@dataclass(frozen=True)
class Ticket:
    """Claim on one submitted job's result (``Target.wait``)."""

    group: int
    seq_no: int  # the target's submission counter (the pipeline's transaction number)


@dataclass
class InFlight:
    """Tokens sent to the target and not yet redeemed: the strategies that keep several
    batches in flight (pearl, pipeinfer) file each one's rows by position when it returns."""

    ticket: Ticket
    pos0: int  # position of its first token: its rows predict positions pos0+1 ..
    n: int
