"""The head's target: :class:`PipelineTarget`, a :class:`~potluck.engine.core.target.Target`
whose layers run on a chain of LAN workers and, last, on the head's own tail (:mod:`.tail`).

It sends every transaction to the first stage, files results by ticket as the tail finishes
them, sends cancels to every stage out of band, and names a lost worker, which
:class:`~.rebuild.ChainRebuild` replaces.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import zmq

from ..core.batch_exact import FREE, BatchExactness
from ..core.errors import PotluckError
from ..core.events import ClusterView, Event, NodeStatus, StageView
from ..core.jobs import CancelledGroups, DecodeJob, GroupCancelled, Ticket
from ..core.kv import KvOp
from ..core.prompt_cache import FREE_MEMORY_SHARE
from ..core.stage import Stage
from ..core.target import TargetBase
from . import wire
from .chain import HeadWorker, PipelineSetup
from .link import REQUEST_TIMEOUT_S, NodeFailedError, NodeLink, NodeLostError
from .plan import SplitPlan
from .rebuild import REPLAY_GROUP, ChainRebuild
from .recovery import TransactionLog
from .tail import HeadTail
from .transfer import TransferStats

log = logging.getLogger(__name__)

STALL_TIMEOUT_S = 60.0


@dataclass
class WireStats:
    """Traffic of one PipelineTarget (figures: bytes per token, per-batch latency)."""

    batches: int = 0
    tokens: int = 0
    replayed_batches: int = 0  # batches sent again to rebuild KV caches after a loss
    replayed_tokens: int = 0


class PipelineTarget(ChainRebuild, TargetBase):
    """A Target whose layers run on a chain of workers; sequence 0 is the conversation.

    Sockets belong to the thread that made the target; ``cancel`` from any other thread is
    queued and sent by that thread within one poll (50 ms). Tickets are the head's own
    numbers: a batch keeps its ticket when a recovery re-sends it under a new transaction.
    """

    def __init__(
        self,
        zctx: zmq.Context,
        links: Sequence[NodeLink],
        tail: HeadTail,
        *,
        n_vocab: int,
        n_ctx: int,
        n_batch: int,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        plan: SplitPlan | None = None,
        transfer: TransferStats | None = None,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        setup: PipelineSetup | None = None,
        recover: bool = True,
        head_fallback: bool = True,
        candidates: Callable[[], Sequence[str]] | None = None,
        exact: BatchExactness = FREE,
    ) -> None:
        super().__init__()
        self.exact = exact  # what every stage's weights on its CPU allow (chain.chain_exactness)
        self._zctx = zctx
        self.links = list(links)
        self.tail = tail  # the output layer (behind zeros: tail.py), here
        self.recurrent = tail.model.recurrent  # every stage's slice is of the same architecture
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.plan = plan
        self.transfer = transfer or TransferStats()
        self.stall_timeout_s = stall_timeout_s
        self.stats = WireStats()
        self.setup = setup
        self.recover = recover and setup is not None
        self.head_fallback = head_fallback  # load lost layers here when no worker can
        self.head_worker: HeadWorker | None = None
        self.candidates = candidates  # addresses of workers the plan may take in between replies
        self._retry_at: dict[str, float] = {}  # address -> when to ask it again
        self.recoveries = 0  # chains rebuilt after a lost worker (tests, figures)
        self.recovery_s: list[float] = []  # how long each rebuild and replay took
        self.log = TransactionLog(streams=not kv_unified and n_seq_max > 1, awaited=self._awaited)
        # slot -> the log its cells came from, and the sequence they were saved from
        self._kept_logs: dict[int, tuple[TransactionLog, int]] = {}
        self._tickets = itertools.count(1)
        self._txn = 0  # transactions sent to the current chain (each chain starts at 1)
        self._txn_ticket: dict[int, int] = {}  # txn of each batch sent to this chain -> its ticket
        self._txn_rows: dict[int, int] = {}  # txn of each batch sent to this chain -> hidden rows it returns
        self._rows: dict[int, int] = {}  # ticket of each batch not yet waited for -> logits rows it returns
        self._results: dict[int, np.ndarray] = {}  # by ticket: logits computed, not yet waited for
        self._awaiting = 0  # the ticket wait() is blocked on (0: none)
        self._refused: dict[int, str] = {}  # by ticket: why a stage refused it
        self._skipped: set[int] = set()  # tickets of batches of cancelled groups: skipped or aborted
        self._cancelled = CancelledGroups()
        self._recoveries_in_a_row = 0
        self._notices: list[Callable[[int], Event]] = []
        self._health: tuple[tuple[str, str, str], ...] = ()
        self._owner = threading.get_ident()
        self._cancel_requests: collections.deque[tuple[int, ...]] = collections.deque()
        self._broken: str | None = None
        self._poller = zmq.Poller()
        self._watch_links()

    @property
    def failure(self) -> str | None:
        """Why this pipeline stopped working (None while healthy)."""
        return self._broken

    # -- Target: job groups
    def submit(self, job: DecodeJob) -> Ticket:
        self._check_usable()
        if job.n_tokens > self.n_batch:
            raise ValueError(f"a batch of {job.n_tokens} tokens exceeds n_batch {self.n_batch}")
        self._flush_cancels()
        ticket = next(self._tickets)
        self._rows[ticket] = job.n_outputs
        self.stats.batches += 1
        self.stats.tokens += job.n_tokens
        self.log.batch(ticket, job)
        self._deliver(lambda: self._send_batch(ticket, job))
        return Ticket(job.group, ticket)

    def _wait(self, ticket: Ticket) -> np.ndarray:
        """Poll until the ticket's result arrives, filing any other result that comes first;
        a lost worker is replaced on the way (the ticket survives)."""
        t = ticket.seq_no
        if t not in self._rows:
            raise KeyError(f"no batch in flight with ticket {t}")
        deadline = time.monotonic() + self.stall_timeout_s
        self._awaiting = t  # its hidden states may be computed on this thread (HeadTail.arrived)
        try:
            while not self._filed(t):
                try:
                    self._check_usable()
                    self._flush_cancels()
                    if self._receive(timeout_ms=50):
                        deadline = time.monotonic() + self.stall_timeout_s  # the pipeline is moving
                    elif time.monotonic() > deadline:
                        raise self._stalled()
                except NodeLostError as e:
                    self._recover(e)
                    deadline = time.monotonic() + self.stall_timeout_s
                except NodeFailedError as e:
                    self._fail(str(e))
                    raise
        finally:
            self._awaiting = 0
        rows = self._rows.pop(t)
        if t in self._skipped:
            self._skipped.discard(t)
            raise GroupCancelled(f"job group {ticket.group} was cancelled")
        if t in self._refused:
            self._results.pop(t, None)
            raise PotluckError(self._refused.pop(t))
        logits = self._results.pop(t)
        if logits.shape != (rows, self.n_vocab):
            err = f"the head's output layer returned logits of shape {logits.shape}, expected ({rows}, {self.n_vocab})"
            self._fail(err)
            raise NodeFailedError(err)
        self._recoveries_in_a_row = 0
        return logits

    def poll(self, ticket: Ticket) -> bool:
        """Whether the ticket's result (or refusal) is here, after reading what arrived;
        a lost worker is replaced on the way, as in :meth:`wait`."""
        t = ticket.seq_no
        if not self._filed(t):
            try:
                self._check_usable()
                self._flush_cancels()
                self._receive(timeout_ms=0)
            except NodeLostError as e:
                self._recover(e)
            except NodeFailedError as e:
                self._fail(str(e))
                raise
        return self._filed(t)

    def _filed(self, t: int) -> bool:
        return t in self._results or t in self._refused or t in self._skipped

    @property
    def n_stages(self) -> int:  # type: ignore[override]
        return len(self.links) + 1  # the workers, then the head's tail

    @property
    def head_layers(self) -> tuple[int, int]:
        """The layers the head computes itself: none, ``(n_layer, n_layer)`` (it computes the
        output layer behind zeros: :mod:`.tail`)."""
        return self.tail.layers

    def cancel(self, group: int, *more: int) -> None:
        """Tell every stage to skip the runs' queued batches and abort the running one
        (one message: see :class:`wire.Cancel`)."""
        self.tail.cancel(group, *more)  # thread-safe: the head's own stage hears it at once
        self._cancel_requests.append((group, *more))
        if threading.get_ident() == self._owner:
            self._flush_cancels()

    def kv(self, op: KvOp, group: int = 0) -> None:
        self._check_usable()
        self.log.kv(op, group)
        self._deliver_kv(op, group)

    def _deliver_kv(self, op: KvOp, group: int = 0) -> None:
        self._deliver(lambda: self._send_op(lambda txn: wire.KvApply.from_op(txn, op, group), op))

    # -- kept conversations: each stage keeps its layers' cells; the head keeps their log
    def keep_kv(self, slot: int, seq: int = 0) -> bool:
        if self._broken is not None:
            return False
        self._kept_logs[slot] = (self.log.of_sequence(seq), seq)
        self._deliver_kv(KvOp.save(slot, seq))
        return slot in self._kept_logs  # a chain rebuilt meanwhile kept nothing

    def restore_kv(self, slot: int, n_past: int, seq: int = 0) -> bool:
        """Put ``slot`` back on every stage as sequence ``seq``; its log becomes that sequence's,
        so a later loss replays the conversation now in the context (a rebuild during this very
        load replays it too)."""
        kept = self._kept_logs.get(slot)
        if kept is None or self._broken is not None:
            return False
        self.log.restore(*kept, seq)
        self._deliver_kv(KvOp.load(slot, seq))
        if seq == 0:
            self._n_past = n_past
            self._spans.clear()
        return True

    def drop_kv(self, slot: int) -> None:
        if self._kept_logs.pop(slot, None) is None or self._broken is not None:
            return
        self._deliver_kv(KvOp.drop(slot))

    def kept_kv_budget(self) -> int | None:
        """What the tightest worker can keep beside its stage, a :data:`FREE_MEMORY_SHARE` of
        what its plan leaves free, scaled from its layers to the whole model's."""
        if self.plan is None:
            return None
        n_layer = self.plan.n_layer
        return int(min(
            FREE_MEMORY_SHARE * max(0.0, s.node.free_mb - s.mem_mb) * 1e6 * n_layer / max(1, s.hi - s.lo)
            for s in self.plan.stages
        ))

    def reset(self) -> None:
        """Clear every sequence on every stage (a new conversation)."""
        self._check_usable()
        self.log.reset()
        self._deliver(lambda: self._send_op(wire.Reset, Stage.clear))
        self._n_past = 0
        self._spans.clear()

    def truncate(self, n_past: int) -> None:
        if n_past >= self._n_past:
            return
        if self._broken is None:
            try:
                n_past = self._cut(n_past)
            except NodeFailedError:
                n_past = self._cut_point(n_past)  # recorded as the failure; the session's bookkeeping holds
        self._n_past = n_past

    def close(self) -> None:
        for link in reversed(self.links):
            link.close(release=True)
        self.links = []
        if self.head_worker is not None:
            self.head_worker.close()
            self.head_worker = None
        self.tail.close()
        self._zctx.term()

    # -- more than the Target protocol
    def node_status(self, run_id: int) -> list[NodeStatus]:
        state = "failed" if self._broken else "ok"
        return [
            NodeStatus(run_id=run_id, node=link.node_id or link.address, layers=link.layers or (0, 0),
                       state=state, detail=link.address)
            for link in self.links
        ]


    def notices(self, run_id: int) -> list[Event]:
        """What happened to the cluster since the last call (losses, new plans), for ``group``."""
        out = [make(run_id) for make in self._notices]
        self._notices.clear()
        return out

    def cluster_view(self) -> ClusterView:
        stages = tuple(
            StageView(lk.node_id or lk.address, lk.address, tuple(lk.layers or (0, 0)), lk.bytes_out + lk.bytes_in)
            for lk in self.links
        )
        experts = self.plan.experts if self.plan is not None else (0, 0, 0)
        return ClusterView(stages, self.head_layers, self.stats.tokens, experts=experts, health=self._health)

    def busy_ms(self) -> list[float]:
        """Computing time so far of each worker's stage in chain order, then the head's own
        stage (the output layer): what proves the stages overlap."""
        return [st.busy_ms for st in self.status()] + [self.tail.runner.counters.busy_s * 1e3]

    def status(self) -> list[wire.StatusReply]:
        """Each stage's state and counters (finished / aborted / skipped batches)."""
        self._check_usable()
        self._flush_cancels()
        replies: list[wire.StatusReply] = []
        for link in self.links:
            link.send(wire.Status())
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while True:
                msg = self._receive(timeout_ms=50, control_from=link)
                if isinstance(msg, wire.StatusReply):
                    replies.append(msg)
                    break
                if time.monotonic() > deadline:
                    raise NodeFailedError(f"{link.describe()} did not answer a status request")
        return replies

    # -- internals: sending
    def _next_txn(self) -> int:
        self._txn += 1
        return self._txn

    def _send_first(self, msg: wire.WireMessage) -> None:
        self.links[0].send(msg)

    def _send_batch(self, ticket: int, job: DecodeJob) -> None:
        txn = self._next_txn()
        self._txn_ticket[txn] = ticket
        self._txn_rows[txn] = job.n_tokens
        self._send_first(wire.Forward.from_job(txn, job))
        self.tail.expect(txn, ticket, job)

    def _send_op(self, message: Callable[[int], wire.WireMessage], work: KvOp | Callable[[Stage], object]) -> None:
        """A KV operation or a reset: down the chain, and to the tail in its place."""
        txn = self._next_txn()
        self._send_first(message(txn))
        self.tail.apply(txn, work)

    def _deliver(self, send: Callable[[], None]) -> None:
        """Send a logged transaction; after a loss the replay of the log carries it instead."""
        try:
            send()
        except NodeLostError as e:
            self._recover(e)
        except NodeFailedError as e:
            self._fail(str(e))
            raise

    def _flush_cancels(self) -> None:
        while self._cancel_requests:
            groups = self._cancel_requests.popleft()
            self._cancelled.add(groups)
            if self._broken is not None:
                continue
            for msg in wire.cancel_messages(groups):
                for link in self.links:
                    link.send_nowait(msg)

    # -- internals: receiving
    def _watch_links(self) -> None:
        self._poller = zmq.Poller()
        for link in self.links:
            self._poller.register(link.sock, zmq.POLLIN)
            self._poller.register(link.monitor, zmq.POLLIN)
        self._poller.register(self.tail.wake_fd, zmq.POLLIN)

    def _receive(self, timeout_ms: int, control_from: NodeLink | None = None) -> object:
        """Read what arrived within ``timeout_ms``: pass hidden states to the tail, file its
        logits and refusals by ticket; return True if anything came, or the first control
        reply from ``control_from``."""
        events = dict(self._poller.poll(timeout_ms))
        got: object = self._file_tail(self.tail.finished())
        for link in self.links:
            if link.monitor in events:
                lost = link.drain_events()
                if lost:
                    raise link.lost(lost)
            if link.sock not in events:
                continue
            while link.sock.poll(0):
                msg = link.read()
                got = got or True
                if isinstance(msg, wire.Result) and link is self.links[-1]:
                    self._file_result(msg)
                elif isinstance(msg, wire.Error):
                    self._check_links()  # a stage that cannot pass work on: is a node gone?
                    why = f"{link.describe()} refused: {msg.message}"
                    ticket = self._txn_ticket.get(msg.txn, 0)
                    if self._awaited(ticket):
                        self._refused.setdefault(ticket, why)
                        self.log.forget(ticket)
                    else:  # a KV operation, a reset or a replayed batch failed: the stages may disagree
                        raise NodeFailedError(why)
                elif link is control_from and not isinstance(msg, wire.Result):
                    return msg
        return self._file_tail(self.tail.finished()) or got

    def _file_tail(self, done: list[tuple[int, Future]]) -> bool:
        """File what the tail finished: logits, or why a batch has none."""
        for ticket, fut in done:
            err = fut.exception()
            if not ticket:  # a KV operation or a reset: the stages may now disagree
                if err is not None:
                    raise NodeFailedError(f"the head's own layers refused a cache operation: {err}")
                continue
            if not self._awaited(ticket):
                if err is not None:
                    raise NodeFailedError(f"a replayed batch failed on the head's own layers: {err}")
                continue  # a replayed batch whose result was delivered before
            if err is None:
                self._results[ticket] = fut.result()
            elif isinstance(err, GroupCancelled):  # skipped or aborted here: llama.cpp dropped its cells
                self._skipped.add(ticket)
                self.log.forget(ticket)
            else:
                self._refused.setdefault(ticket, f"the head's own layers refused it: {err}")
                self.log.forget(ticket)
        return bool(done)

    def _awaited(self, ticket: int) -> bool:
        """Whether ``ticket``'s result is still wanted (not yet arrived, refused or skipped)."""
        return ticket in self._rows and ticket not in self._results and ticket not in self._refused \
            and ticket not in self._skipped

    def _file_result(self, msg: wire.Result) -> None:
        """The last worker's hidden states of a batch: on to the tail, or why there are none."""
        ticket = self._txn_ticket.pop(msg.txn, 0)
        rows = self._txn_rows.pop(msg.txn, 0)  # replayed batches too
        if not ticket:
            return  # not a batch of this chain
        if not msg.skip:
            if msg.hidden.shape != (rows, self.tail.n_embd):
                # checked against this head's own width and the rows it sent, never the
                # worker's word: llama.cpp reads n_tokens * n_embd floats from the buffer
                raise NodeFailedError(
                    f"{self.links[-1].describe()} sent hidden states of shape {msg.hidden.shape} for "
                    f"transaction {msg.txn}, expected ({rows}, {self.tail.n_embd})"
                )
            self.tail.arrived(msg.txn, msg.hidden, now=ticket == self._awaiting)
            return
        sent_as = self.tail.drop(msg.txn)
        if self._awaited(ticket) and msg.group not in self._cancelled:
            # a stage refused it (its error may still be on the way) or the worker lies:
            # never a GroupCancelled for a group nobody cancelled
            self._refused.setdefault(
                ticket, f"{self.links[-1].describe()} skipped transaction {msg.txn} of job group {msg.group}, "
                "which was never cancelled"
            )
            self.log.forget(ticket)
            return
        if self._awaited(ticket):  # cancelled before it computed: it never touched a cache
            self._skipped.add(ticket)
            self.log.forget(ticket)
        elif sent_as == REPLAY_GROUP:  # refused ones were settled by their error already
            raise NodeFailedError(f"a replayed batch (transaction {msg.txn}) came back skipped")

    def _check_links(self) -> None:
        for link in self.links:
            lost = link.drain_events()
            if lost:
                raise link.lost(lost)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise NodeFailedError(self._broken)

    def _fail(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
            log.error("pipeline stopped: %s", why)

    def _stalled(self) -> NodeFailedError:
        """Name the stage that does not answer a ping (it is stuck computing)."""
        for i, link in enumerate(self.links):
            try:
                link.send(wire.Ping(i))
                if not link.sock.poll(1000):
                    return link.lost(f"stalled: no reply for {self.stall_timeout_s:g} s")
                self._receive(timeout_ms=0)
            except NodeFailedError as e:
                return e
        return NodeFailedError(f"the pipeline returned nothing for {self.stall_timeout_s:g} s")
