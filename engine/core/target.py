"""The model a strategy verifies against: groups of decode jobs over KV sequences.

Strategies see the :class:`Target` protocol only, so one strategy runs on a local llama.cpp
context, on stages chained in this process (:mod:`.split`) or on a pipeline of LAN workers.

- Work is submitted as :class:`~.jobs.DecodeJob`s (``submit`` -> ticket, ``wait`` -> logits)
  and several may be in flight; ``cancel(group)`` skips or aborts a job group's jobs. KV
  operations (:class:`~.kv.KvOp`) are queued in order with the jobs.
- Sequence 0 is the canonical conversation. ``decode``/``truncate`` are small helpers over
  the above for it: ``n_past`` tokens sit at positions ``0..n_past-1`` and, because rejected
  tails are always trimmed from the end, in the KV cells plain decoding would use
  (docs/facts.md §3).
- With ``n_seq_max > 1`` and ``kv_unified=False`` each sequence has its own KV stream, so
  work in a side sequence never changes the canonical sequence's numbers (docs/facts.md §4).
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol, TypeVar

import numpy as np

from .batch_exact import FREE, UNLIMITED, BatchExactness
from .errors import ContextFullError, PotluckError
from .events import ClusterView, Event, NodeStatus
from .jobs import DecodeJob, GroupCancelled, Ticket
from .kv import KvOp
from .rollback import KEEP_BATCHES
from .runner import StageRunner
from .runtime import ContextParams, Model
from .stage import Stage
from .staged_prefill import MIN_ROWS as PREFILL_TWIN_MIN_ROWS

log = logging.getLogger(__name__)

T = TypeVar("T")

# A k-token batch computes each row exactly like k single-token steps only up to 48 tokens
# (flash attention, docs/facts.md §3): verification batches must stay at or below this size,
# and below what the model's weight types allow (``Target.exact.max_rows``, core/batch_exact.py).
MAX_EXACT_BATCH = UNLIMITED


class Target(Protocol):
    n_vocab: int
    n_ctx: int  # tokens per sequence
    n_batch: int
    n_seq_max: int
    n_stages: int  # stages a batch passes through in turn (1: one context; more: a pipeline)
    exact: BatchExactness  # the longest exact verify batch; single steps as 2 rows or not
    longest_verify_rows: int  # the most rows of any verify batch so far (tests, figures)
    recurrent: bool  # layers with a recurrent state: see truncate

    # -- job groups
    def new_group(self) -> int:
        """A fresh job group id (every job belongs to one group; cancelling one stops its jobs)."""
        ...

    def submit(self, job: DecodeJob) -> Ticket:
        """Queue ``job`` behind everything submitted before it; returns at once."""
        ...

    def wait(self, ticket: Ticket) -> np.ndarray:
        """The job's logits [n_outputs, vocab] (owned). Raises :class:`GroupCancelled` if its group
        was cancelled first. Tickets may be redeemed in any order, each once."""
        ...

    def poll(self, ticket: Ticket) -> bool:
        """Whether ``wait(ticket)`` would return (or raise) without waiting: lets a strategy
        keep working while results are on the way (PipeInfer's continuous speculation)."""
        ...

    def cancel(self, group: int, *more: int) -> None:
        """Skip the groups' queued jobs and abort the running one; any thread. Groups cancelled
        together are cancelled in one step on every stage (name them in one call)."""
        ...

    def kv(self, op: KvOp) -> None:
        """Queue a KV operation, applied after every job submitted before it."""
        ...

    def reset(self) -> None:
        """Forget every sequence (a new conversation)."""
        ...

    def keep_kv(self, slot: int, seq: int = 0) -> bool:
        """Save sequence ``seq``'s cells as ``slot`` on every stage, after the work queued so
        far (a kept conversation, :mod:`.prompt_cache`); False if they could not be kept."""
        ...

    def restore_kv(self, slot: int, n_past: int, seq: int = 0) -> bool:
        """Replace sequence ``seq`` with ``slot``'s cells, which hold ``n_past`` tokens (the
        canonical sequence's length becomes ``n_past`` when ``seq`` is 0); False (and nothing
        changed) if the slot is gone: a cluster that rebuilt its chain lost them."""
        ...

    def drop_kv(self, slot: int) -> None:
        """Forget ``slot`` on every stage."""
        ...

    def kept_kv_budget(self) -> int | None:
        """Bytes of kept conversations (over every layer) the stages can hold, where that is less
        than this machine's share (a cluster's workers); None: no limit but this machine's."""
        ...

    # -- the canonical sequence
    @property
    def n_past(self) -> int: ...

    def decode(self, tokens: Sequence[int], *, all_logits: bool = False, group: int | None = None) -> np.ndarray:
        """Append ``tokens`` to sequence 0: logits [n_rows, vocab] for every row or the last one."""
        ...

    def append(self, tokens: Sequence[int], group: int) -> Ticket:
        """Queue ``tokens`` after sequence 0 without waiting (logits for every row); ``n_past``
        grows now. For strategies that keep several verify batches in flight: what they do
        not keep, they cancel and ``truncate``."""
        ...

    def truncate(self, n_past: int) -> None:
        """Forget every token of sequence 0 at position >= ``n_past``. A target with a
        recurrent state (``recurrent``) keeps it restorable only a few batches back: asked
        for more, it forgets the whole sequence; read ``n_past`` after."""
        ...

    def settle(self) -> None:
        """Every stage puts sequence 0 back in its BF16 cache (after a prompt ``decode``
        computed in F16 twins: core/staged_prefill.py)."""
        ...

    def set_threads(self, n_threads: int) -> None:
        """CPU threads for this machine's decodes from the next job on (no-op for workers)."""
        ...

    def on_compute_thread(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the thread that computes this target's batches here, in order after
        the work queued before it (or on the caller's, where none computes here)."""
        ...

    def node_status(self, run_id: int) -> list[NodeStatus]:
        """Health of the machines behind this target (empty on one machine)."""
        ...

    def notices(self, run_id: int) -> list[Event]:
        """What happened to those machines since the last call (a node lost, a new plan)."""
        ...

    def cluster_view(self) -> ClusterView | None:
        """The stages and their traffic in cluster mode; None on one machine."""
        ...

    def regroup(self) -> None:
        """Between replies: take in machines that joined if that makes the target faster."""
        ...

    def close(self) -> None: ...


class TargetBase(ABC):
    """The canonical-sequence helpers, written once over submit / wait / cancel / kv."""

    n_vocab: int
    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_stages: int = 1
    # what keeps verify batches exact on this model (core/batch_exact.py); strategies read
    # exact.max_rows, decode and append run single steps as 2 rows where it says so
    exact: BatchExactness = FREE
    # layers with a recurrent state (core/rollback.py): a tail can be dropped only as far as
    # the last KEEP_BATCHES batches of sequence 0 reach
    recurrent: bool = False

    def __init__(self) -> None:
        self._n_past = 0
        self._groups = itertools.count(1)
        self._spare_rows: dict[int, int] = {}  # ticket -> trailing rows that were only padding
        self.longest_verify_rows = 0  # the most rows of any verify batch (decode all_logits, append)
        self.padded_steps = 0  # single steps run as 2 rows
        self._spans: deque[list[int]] = deque(maxlen=KEEP_BATCHES)  # [pos0, n] of sequence 0's last batches
        # (tokens computed, tokens in all) of the decode running now, one n_batch job at a time:
        # read from other threads (the chat's status line while a long prompt is read)
        self.decode_progress: tuple[int, int] = (0, 0)

    def new_group(self) -> int:
        return next(self._groups)

    # what each target implements (documented on :class:`Target`)
    @abstractmethod
    def submit(self, job: DecodeJob) -> Ticket: ...

    @abstractmethod
    def _wait(self, ticket: Ticket) -> np.ndarray:
        """The job's logits, every output row it computed."""

    def wait(self, ticket: Ticket) -> np.ndarray:
        spare = self._spare_rows.pop(ticket.seq_no, 0)
        rows = self._wait(ticket)
        return rows[: len(rows) - spare] if spare else rows

    @abstractmethod
    def poll(self, ticket: Ticket) -> bool: ...

    def on_compute_thread(self, fn: Callable[[], T]) -> T:
        """Where another llama.cpp context of this process (a draft model) computes, so
        that one OpenMP team serves both (Context.compute_threads). Here: the caller's."""
        return fn()

    @abstractmethod
    def cancel(self, group: int, *more: int) -> None: ...

    @abstractmethod
    def kv(self, op: KvOp) -> None: ...

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @property
    def n_past(self) -> int:
        return self._n_past

    def decode(self, tokens: Sequence[int], *, all_logits: bool = False, group: int | None = None) -> np.ndarray:
        n = len(tokens)
        if n == 0:
            raise ValueError("decode needs at least one token")
        if self._n_past + n > self.n_ctx:
            raise ContextFullError(
                f"the conversation needs {self._n_past + n} tokens but the context holds "
                f"{self.n_ctx}; start a new conversation or raise --ctx"
            )
        group = self.new_group() if group is None else group
        if all_logits:
            self.longest_verify_rows = max(self.longest_verify_rows, n)
        tickets = []
        for i in range(0, n, self.n_batch):
            chunk = tokens[i : i + self.n_batch]
            tickets.append(self._submit_tokens(group, chunk, self._n_past + i, all_logits))
            self._spans.append([self._n_past + i, len(chunk)])
        rows: list[np.ndarray] = []
        self.decode_progress = (0, n)
        try:
            for t in tickets:
                rows.append(self.wait(t))
                self.decode_progress = (min(n, len(rows) * self.n_batch), n)
        except BaseException:
            # Cancelled or failed mid-prompt: settle the group's other jobs, then drop whatever
            # part of it reached the cache, so sequence 0 holds exactly n_past tokens again.
            # Best effort: on a target that just broke, the original error is what matters.
            try:
                self.cancel(group)
                for t in tickets[len(rows) + 1 :]:
                    try:
                        self.wait(t)
                    except GroupCancelled:
                        pass
                self._n_past = self._cut(self._n_past)
            except PotluckError:
                pass
            raise
        self._n_past += n
        if n >= PREFILL_TWIN_MIN_ROWS:
            self.settle()
        if all_logits:
            return rows[0] if len(rows) == 1 else np.concatenate(rows)
        return rows[-1][-1:]

    def settle(self) -> None:
        """A prompt is in: every stage hands sequence 0 back from its F16 twin now
        (core/staged_prefill.py), so the reply's first step is not charged with it (the
        draft floor measures plain steps). A trim of nothing reaches every stage in pipeline
        order; a local target waits for it."""
        self.kv(KvOp.rm(0, self._n_past))

    def append(self, tokens: Sequence[int], group: int) -> Ticket:
        n = len(tokens)
        if not 0 < n <= self.n_batch:
            raise ValueError(f"append takes 1..{self.n_batch} tokens, got {n}")
        if self._n_past + n > self.n_ctx:
            raise ContextFullError(
                f"the conversation needs {self._n_past + n} tokens but the context holds "
                f"{self.n_ctx}; start a new conversation or raise --ctx"
            )
        self.longest_verify_rows = max(self.longest_verify_rows, n)
        ticket = self._submit_tokens(group, tokens, self._n_past, all_logits=True)
        self._spans.append([self._n_past, n])
        self._n_past += n
        return ticket

    def _submit_tokens(self, group: int, tokens: Sequence[int], pos0: int, all_logits: bool) -> Ticket:
        """One job of sequence 0. Where ``exact.two_row_steps``, every matrix product must see
        2 rows or more (llamafile's tinyBLAS; 1 row takes vec_dot and sums differently): a
        1-token job runs as 2 rows (the token again at the next position, its cell trimmed right
        after), and a job asks for 2 output rows at least, so the last layer (which computes only
        the output rows) multiplies 2 rows too. ``wait`` drops the spare row."""
        n = len(tokens)
        # a recurrent layer would take the spare token into its state, which no cell trim
        # undoes (core/rollback.py): hybrids keep 1-row steps (docs/facts.md §37)
        if not self.exact.two_row_steps or self.recurrent or (all_logits and n >= 2):
            return self.submit(DecodeJob.tokens(group, tokens, pos0, outputs="all" if all_logits else "last"))
        if n >= 2:  # the last row's logits, and the one before so that the last layer sees 2
            return self.submit(DecodeJob.tokens(group, tokens, pos0, outputs=[False] * (n - 2) + [True, True]))
        if pos0 + 2 > self.n_ctx:  # the context's last cell: no room for a spare row
            return self.submit(DecodeJob.tokens(group, tokens, pos0, outputs="all"))
        ticket = self.submit(DecodeJob.tokens(group, [tokens[0], tokens[0]], pos0, outputs="all"))
        self.kv(KvOp.rm(0, pos0 + 1))
        self._spare_rows[ticket.seq_no] = 1
        self.padded_steps += 1
        return ticket

    def set_threads(self, n_threads: int) -> None:
        """Workers and in-process stages keep the threads they were opened with."""

    def keep_kv(self, slot: int, seq: int = 0) -> bool:
        self.kv(KvOp.save(slot, seq))
        return True

    def restore_kv(self, slot: int, n_past: int, seq: int = 0) -> bool:
        self.kv(KvOp.load(slot, seq))
        if seq == 0:
            self._n_past = n_past
            self._spans.clear()
        return True

    def drop_kv(self, slot: int) -> None:
        self.kv(KvOp.drop(slot))

    def kept_kv_budget(self) -> int | None:
        return None

    def truncate(self, n_past: int) -> None:
        if n_past < self._n_past:
            self._n_past = self._cut(n_past)

    def _cut_point(self, n_past: int) -> int:
        """Where sequence 0 can end: ``n_past``, or 0 on a recurrent target whose stages
        keep no state that far back. Every stage keeps at least the last KEEP_BATCHES
        batches this head sent (a stage computes a subset of them: core/rollback.py)."""
        if self.recurrent and not (self._spans and n_past >= self._spans[0][0]):
            return 0
        return n_past

    def _cut(self, n_past: int) -> int:
        """Drop sequence 0 from ``n_past`` (or from where it can be cut) on every stage; the
        batches kept for a rollback end there too. Returns where it ends."""
        n_past = self._cut_point(n_past)
        self.kv(KvOp.rm(0, n_past))
        while self._spans and self._spans[-1][0] >= n_past:
            self._spans.pop()
        if self._spans and sum(self._spans[-1]) > n_past:
            self._spans[-1][1] = n_past - self._spans[-1][0]
        return n_past

    def node_status(self, run_id: int) -> list[NodeStatus]:
        return []

    def notices(self, run_id: int) -> list[Event]:
        return []

    def cluster_view(self) -> ClusterView | None:
        return None

    def regroup(self) -> None:
        """One machine: nothing joins."""


class LocalTarget(TargetBase):
    """A whole model in one llama.cpp context on this machine, computed on its own thread."""

    def __init__(self, model: Model, params: ContextParams | None = None) -> None:
        super().__init__()
        params = params or ContextParams()
        self.model = model
        self.stage = Stage(model, first=True, last=True, params=params)
        self.runner = StageRunner(self.stage, name="target")
        self.n_vocab = model.n_vocab
        self.n_ctx = self.stage.n_ctx
        self.n_batch = params.n_batch
        self.n_seq_max = self.stage.n_seq_max
        self.exact = model.batch_exact
        self.recurrent = model.recurrent
        self._pending: dict[int, Future] = {}
        self._seq = itertools.count(1)

    def submit(self, job: DecodeJob) -> Ticket:
        self.stage.check(job)
        seq_no = next(self._seq)
        self._pending[seq_no] = self.runner.submit(job)
        return Ticket(job.group, seq_no)

    def _wait(self, ticket: Ticket) -> np.ndarray:
        return self._pending.pop(ticket.seq_no).result()

    def poll(self, ticket: Ticket) -> bool:
        return self._pending[ticket.seq_no].done()

    def cancel(self, group: int, *more: int) -> None:
        self.runner.cancel(group, *more)

    def kv(self, op: KvOp) -> None:
        self.stage.ctx.check_kv(op)
        self.runner.submit(op)

    def on_compute_thread(self, fn: Callable[[], T]) -> T:
        return self.runner.submit(lambda _stage: fn()).result()

    def reset(self) -> None:
        self.runner.submit(Stage.clear)
        self._n_past = 0
        self._spans.clear()

    def set_threads(self, n_threads: int) -> None:
        self.runner.set_threads(n_threads)

    def settle(self) -> None:
        self.runner.submit(Stage.settle).result()

    def keep_kv(self, slot: int, seq: int = 0) -> bool:
        try:
            self.runner.submit(KvOp.save(slot, seq)).result()
        except PotluckError as e:  # no room: the conversation is not kept
            log.info("conversation not kept: %s", e)
            return False
        return True

    def restore_kv(self, slot: int, n_past: int, seq: int = 0) -> bool:
        """Waits for the load: a slot the stage no longer holds must be a miss, not the
        sequence's old cells taken for the slot's (docs/facts.md §32)."""
        try:
            self.runner.submit(KvOp.load(slot, seq)).result()
        except PotluckError:
            return False
        if seq == 0:
            self._n_past = n_past
            self._spans.clear()
        return True

    def observed(self, name: str) -> np.ndarray:
        """Rows of tensor ``name`` (``ContextParams.observe``) of sequence 0 by position,
        [n_ctx, width], valid below ``n_past`` once the jobs waited for have run."""
        try:
            return self.stage.observed[name]
        except KeyError:
            raise PotluckError(f"tensor {name!r} was not observed (ContextParams.observe)") from None

    def pos_max(self) -> list[int]:
        """Last position per sequence (-1: empty), once all work queued so far ran."""
        return self.runner.submit(Stage.pos_max).result()

    def close(self) -> None:
        self.runner.close()
        self.stage.close()
