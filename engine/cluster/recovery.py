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

With one KV stream per sequence (several conversations decoded together, core/lanes.py) a
sequence's cells depend on its own rows only (docs/facts.md §4, §32), so the log is also kept
by sequence: an ``rm`` that empties a sequence drops that sequence's rows from every batch
(a batch of several conversations keeps the others' rows; one whose result is still awaited
stays whole), and a kept conversation's log is its sequence's rows and operations alone,
put back under the sequence it is restored into.

Otherwise the log holds every row computed since the last reset, rejected draft rows
included: a replay costs about what computing the conversation cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
    """Every batch and KV operation since the last reset, in the order the stages saw them.

    ``streams``: the stages keep one KV stream per sequence (``kv_unified`` off), so the log
    may forget one sequence's rows without changing another's cells. ``awaited(ticket)``: a
    batch whose result is still awaited (its rows are never dropped: a replay resends it whole)."""

    def __init__(self, streams: bool = False, awaited: Callable[[int], bool] = lambda ticket: False) -> None:
        self._entries: list[Logged] = []
        self.streams = streams
        self.awaited = awaited

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
        other = TransactionLog(self.streams, self.awaited)
        other._entries = list(self._entries)
        return other

    def of_sequence(self, seq: int) -> TransactionLog:
        """What sequence ``seq``'s cells came from (a kept conversation): the whole log, or with
        one stream per sequence, that sequence's rows and operations alone."""
        if not self.streams:
            return self.copy()
        other = TransactionLog(self.streams, self.awaited)
        for e in self._entries:
            if isinstance(e, LoggedKv):
                if _touches(e.op, seq):
                    other._entries.append(e)
                continue
            rows = e.job.seq_ids == seq
            if rows.all():
                other._entries.append(e)
            elif rows.any():
                other._entries.append(LoggedBatch(e.ticket, _rows(e.job, rows)))
        return other

    def restore(self, kept: TransactionLog, from_seq: int, seq: int) -> None:
        """Sequence ``seq`` now holds the cells ``kept`` (:meth:`of_sequence` of ``from_seq``)
        came from: the whole log becomes ``kept``, or with one stream per sequence, ``seq``'s
        own history is replaced by ``kept``'s, renumbered."""
        if not self.streams:
            self._entries = list(kept._entries)
            return
        self._forget_sequence(seq)
        for e in kept._entries:
            if isinstance(e, LoggedKv):
                dst = seq if e.op.op == "cp" and e.op.dst == from_seq else e.op.dst
                self._entries.append(LoggedKv(dataclasses.replace(e.op, seq=seq, dst=dst), e.group))
            else:
                self._entries.append(LoggedBatch(e.ticket, dataclasses.replace(
                    e.job, seq_ids=np.full_like(e.job.seq_ids, seq))))

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
            if self._empties_sequence(op):
                self._forget_sequence(op.seq)
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

    def _empties_sequence(self, op: KvOp) -> bool:
        """Whether ``rm`` ``op`` empties its sequence's own stream, which no other sequence's
        cells ever came from: the sequence's history can go (a stream that was never filled
        equals one emptied)."""
        if not self.streams or op.p0 > 0 or op.p1 >= 0:
            return False
        return not any(isinstance(e, LoggedKv) and e.op.op in ("cp", "keep") and _touches(e.op, op.seq)
                       for e in self._entries)

    def _forget_sequence(self, seq: int) -> None:
        """Drop ``seq``'s rows (and operations) from the log, except from batches still awaited."""
        kept: list[Logged] = []
        for e in self._entries:
            if isinstance(e, LoggedKv):
                if not (_touches(e.op, seq) and e.op.op not in ("cp", "keep")):
                    kept.append(e)
                continue
            mine = e.job.seq_ids == seq
            if not mine.any() or self.awaited(e.ticket):
                kept.append(e)
            elif not mine.all():
                kept.append(LoggedBatch(e.ticket, _rows(e.job, ~mine)))
        self._entries = kept

    def _drop_removed_tail(self, op: KvOp) -> None:
        while self._entries:
            last = self._entries[-1]
            if not isinstance(last, LoggedBatch) or not _removes_all(op, last.job):
                return
            self._entries.pop()


def _touches(op: KvOp, seq: int) -> bool:
    """Whether ``op`` reads or changes sequence ``seq``'s cells (``keep`` changes every sequence's)."""
    return op.seq == seq or op.op == "keep" or (op.op == "cp" and op.dst == seq)


def _rows(job: DecodeJob, mask: np.ndarray) -> DecodeJob:
    """The rows of ``job`` where ``mask`` holds, as a job of its own (a batch shared by several
    conversations, cut to one of them: each row computes alone, docs/facts.md §32)."""
    outputs = job.outputs[mask]
    if not outputs.any():  # a stage refuses a batch without an output row; which rows return changes no cell
        outputs[-1] = True
    return DecodeJob(job.group, job.inputs[mask], job.positions[mask], job.seq_ids[mask], outputs)


def _removes_all(op: KvOp, job: DecodeJob) -> bool:
    """Whether ``rm`` ``op`` removes every row ``job`` put in the cache."""
    if not np.all(job.seq_ids == op.seq):
        return False
    lo = 0 if op.p0 < 0 else op.p0
    hi = np.iinfo(np.int32).max if op.p1 < 0 else op.p1
    return bool(np.all((job.positions >= lo) & (job.positions < hi)))
