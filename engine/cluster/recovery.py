"""What the head needs to rebuild a pipeline after a lost worker: the transaction log.

A stage's KV cache is a function of every batch and KV operation it applied since the last
reset, in order, chunked exactly as they were (a different chunking or cell layout gives
different logits, docs/facts.md §3). So the head records, in order, every ``forward`` batch
it sent to the first stage (token ids, positions, sequence ids, output rows) and every KV
operation since the last ``reset``. After a loss it loads a new plan, replays the log
verbatim through the new first stage, and every stage ends up with the cache an
uninterrupted run would have. Layer ranges may differ: the split is exact (§5), so only the
transactions matter, not which node computes which layers.

Only the first stage's inputs are logged (token ids), so the log costs 13 bytes a row.
Two things keep it near the conversation's size:

- a batch whose group was cancelled before it computed (its result came back skipped, or it
  was refused) never touched a cache and leaves the log;
- a KV ``rm`` that removes whole batches at the tail of the log (a regenerated reply, a
  cancelled prompt) removes those batches from the log too. That replays identically:
  llama.cpp moves its free-cell head back to the first removed cell, so without the batches
  and their removal the next batch lands in the same cells (§3, §7);
- an ``rm`` that empties the cache (a new conversation sharing nothing with the last) starts
  the log over, as ``reset`` does.

Otherwise the log holds every row computed since the last reset, rejected draft rows
included: a replay costs about what computing the conversation cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.jobs import DecodeJob
from ..core.kv import KvOp


@dataclass(frozen=True)
class LoggedBatch:
    """A ``forward`` as the head sent it; ``ticket`` is the head's number for its result."""

    ticket: int
    job: DecodeJob


@dataclass(frozen=True)
class LoggedKv:
    op: KvOp
    group: int


Logged = LoggedBatch | LoggedKv


class TransactionLog:
    """Every batch and KV operation since the last reset, in the order the stages saw them."""

    def __init__(self) -> None:
        self._entries: list[Logged] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(list(self._entries))

    @property
    def n_rows(self) -> int:
        """Token rows the log holds (what a replay recomputes)."""
        return sum(e.job.n_tokens for e in self._entries if isinstance(e, LoggedBatch))

    def copy(self) -> TransactionLog:
        """What a kept conversation's cells came from: restored with them (PipelineTarget.restore_kv)."""
        other = TransactionLog()
        other._entries = list(self._entries)
        return other

    def reset(self) -> None:
        """A new conversation: a fresh stage already equals a cleared one."""
        self._entries.clear()

    def batch(self, ticket: int, job: DecodeJob) -> None:
        self._entries.append(LoggedBatch(ticket, job))

    def kv(self, op: KvOp, group: int) -> None:
        if op.op == "rm":
            if self._empties_cache(op):
                self._entries.clear()
                return
            self._drop_removed_tail(op)
        self._entries.append(LoggedKv(op, group))

    def forget(self, ticket: int) -> None:
        """The batch never changed a cache (skipped by a cancel, or refused)."""
        self._entries = [e for e in self._entries if not (isinstance(e, LoggedBatch) and e.ticket == ticket)]

    def _empties_cache(self, op: KvOp) -> bool:
        """Whether ``rm`` ``op`` leaves no cell in use: then the stages hold what a fresh one
        does (every cell free, the free-cell head at 0) and the log starts over."""
        if op.p0 > 0 or op.p1 >= 0:
            return False
        for e in self._entries:
            if isinstance(e, LoggedKv) and e.op.op != "rm":
                return False  # a copy or shift may have filled another sequence
            if isinstance(e, LoggedBatch) and not np.all(e.job.seq_ids == op.seq):
                return False
        return True

    def _drop_removed_tail(self, op: KvOp) -> None:
        while self._entries:
            last = self._entries[-1]
            if not isinstance(last, LoggedBatch) or not _removes_all(op, last.job):
                return
            self._entries.pop()


def _removes_all(op: KvOp, job: DecodeJob) -> bool:
    """Whether ``rm`` ``op`` removes every row ``job`` put in the cache."""
    if not np.all(job.seq_ids == op.seq):
        return False
    lo = 0 if op.p0 < 0 else op.p0
    hi = np.iinfo(np.int32).max if op.p1 < 0 else op.p1
    return bool(np.all((job.positions >= lo) & (job.positions < hi)))
