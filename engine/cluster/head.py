"""The head side: :class:`PipelineTarget`, a :class:`~potluck.engine.core.target.Target` whose layers
run on LAN workers, and :func:`open_pipeline`, which joins, plans, distributes and loads.

Data path: head -> stage 1 -> ... -> stage N -> head's tail (:mod:`.tail`). The head sends
every transaction (``forward`` batches, ``kv`` operations, ``reset``) to stage 1 only; each
stage applies it and passes it on, so KV operations and batches happen in the same order
everywhere. The last worker returns the hidden states of every row (n_embd floats a token,
not n_vocab: 2.3 kB instead of 196 kB for SmolLM2), and the head's tail, which holds the
model's last layer(s) and the output layer, takes them in transaction order with the KV
operations and resets, and computes the logits of the rows a batch asks for. Any number of
batches may be in flight: results are filed by ticket as the tail finishes them and handed
to whoever waits for that ticket, never dropped. ``cancel(group)`` goes to every stage out
of band, the tail included: queued batches of the run are skipped, a running one is aborted.

The head maps only the tail's slice of the target (the loader opens the target itself
vocab-only for the tokenizer and chat template), so a model too big for the head still
works in cluster mode.

Failure and recovery: every link has a ZeroMQ monitor; a worker that dies (socket closed),
freezes (heartbeats stop, 2.5 s), becomes unreachable or stays busy past ``stall_timeout_s``
is named as lost. The head then re-plans over the workers that still answer (and, when
they cannot hold the model, over a :class:`HeadWorker` of its own), sends them their new
slices, lets its tail finish what it holds, clears it, and replays its transaction log
(:mod:`.recovery`) verbatim through the new chain and the tail, so the KV caches and every
later result equal an uninterrupted run's; batches in flight are re-sent by the replay and
their tickets stay valid. The strategy never notices; the
session hears of it through :meth:`PipelineTarget.notices` (``NodeStatus``
"lost"/"recovering", ``PlanChanged``). Between replies :meth:`PipelineTarget.regroup` takes
in workers that joined or came back, the same way, when they make the plan faster. When no
plan fits what is left, or a worker refuses work, the target becomes unusable with a
:class:`NodeFailedError` naming the node, and the session keeps the conversation.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from ..core.errors import PotluckError
from ..core.events import ClusterView, Event, NodeStatus, PlanChanged, StageView
from ..core.gguf_tools import SPLITTABLE_ARCHS
from ..core.jobs import DecodeJob, GroupCancelled, Ticket
from ..core.kv import KvOp
from ..core.runner import CANCELLED_KEPT
from ..core.runtime import ContextParams
from ..core.spec import CurveKeys
from ..core.stage import Stage
from ..core.target import TargetBase
from . import wire
from .plan import NodeInfo, SplitPlan, layer_costs, manual_plan, plan_split
from .recovery import LoggedBatch, LoggedKv, TransactionLog
from .tail import HeadTail
from .transfer import CHUNK_BYTES, Progress, SliceCache, TransferStats, send_slice
from .transport import AUTH_FAILED_EVENTS, client_socket, endpoint, read_event

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 30.0
STALL_TIMEOUT_S = 60.0
SEND_TIMEOUT_MS = 3000
# A survivor may be blocked up to the worker's forward timeout (5 s) per batch it still tries
# to pass to the lost node before it reads our hello.
REJOIN_TIMEOUT_S = 15.0
# Between replies the head asks listed workers it does not use whether they are back: a
# short join, and an address that does not answer is asked again only this much later.
REGROUP_JOIN_TIMEOUT_S = 1.0
# The head's own worker (HeadWorker) is in this process: it can only be slow to accept, on a
# machine busy with everything else, never absent.
HEAD_WORKER_JOIN_TIMEOUT_S = 30.0
REGROUP_RETRY_S = 30.0
REGROUP_GAIN = 0.9  # a new plan is taken only if its slowest stage is this much faster
# Recoveries in a row without one result coming back: past this the cluster is flapping.
MAX_RECOVERIES_IN_A_ROW = 3
# A rebuild that keeps losing nodes (a head worker that cannot start, workers dying one by
# one) ends in one clear error instead of retrying forever.
MAX_REBUILDS = 4
RECOVERY_DEADLINE_S = 90.0
# Replayed batches whose results were already delivered run under this job group, which no
# caller ever gets from new_group(): a cancel sent meanwhile can never skip one of them.
REPLAY_GROUP = 0


class NodeFailedError(PotluckError):
    """A worker died, froze, went away or refused work; the message names it."""


class NodeLostError(NodeFailedError):
    """A worker stopped answering (died, froze, unreachable): the head may re-plan without it."""

    def __init__(self, message: str, address: str = "") -> None:
        super().__init__(message)
        self.address = address


class NodeBusyError(NodeFailedError):
    """The worker serves another head (it refused our hello with code ``busy``)."""


def max_result_bytes(n_batch: int, n_embd: int) -> int:
    """The largest message a worker may send this head: f32 hidden states of every row of
    the largest batch at the head's own width, plus headers (ZMQ_MAXMSGSIZE)."""
    return n_batch * n_embd * 4 + wire.MAX_HEADER_BYTES + (48 << 10) if n_embd > 0 else -1


def cancel_messages(groups: Sequence[int]) -> list[wire.Cancel]:
    """``groups`` as few Cancel messages as the wire allows (each names up to 257 job groups)."""
    step = wire.MAX_CANCEL + 1
    return [wire.Cancel(groups[i], np.array(groups[i + 1 : i + step], dtype="<i4"))
            for i in range(0, len(groups), step)]


class NodeLink:
    """One CURVE DEALER connection from the head to one worker, with its monitor."""

    def __init__(
        self, zctx: zmq.Context, keys: CurveKeys, address: str, head_id: bytes, max_msg_bytes: int = -1
    ) -> None:
        self.address = address
        self.node_id = ""
        self.layers: tuple[int, int] | None = None
        self.welcome: wire.Welcome | None = None
        self.handshaken = False
        self.auth_failed = False
        self.sock = client_socket(zctx, keys, head_id)
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)  # a bigger one drops the connection
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        self.sock.connect(endpoint(address))
        self.bytes_out = 0
        self.bytes_in = 0

    def describe(self) -> str:
        who = f"node {self.node_id} at {self.address}" if self.node_id else f"node at {self.address}"
        return f"{who} (layers {self.layers[0]}-{self.layers[1]})" if self.layers else who

    def drain_events(self) -> str | None:
        """Apply pending monitor events; the reason this link is lost, if it is."""
        lost = None
        while True:
            try:
                event, _ = read_event(self.monitor) if self.monitor.poll(0) else (None, "")
            except zmq.ZMQError:
                return lost
            if event is None:
                return lost
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshaken = True
            elif event in AUTH_FAILED_EVENTS:
                self.auth_failed = True
            elif self.handshaken and event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                lost = "disconnected (the worker stopped, crashed or froze)"

    def lost(self, why: str) -> NodeLostError:
        return NodeLostError(f"{self.describe()} {why}", self.address)

    def send(self, msg: wire.WireMessage) -> None:
        frames = wire.to_frames(msg)
        try:
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            self.drain_events()
            if not self.handshaken:  # IMMEDIATE: nothing queues before the CURVE handshake
                raise NodeLostError(self._silence_reason(SEND_TIMEOUT_MS / 1000), self.address) from None
            raise self.lost("is unreachable (send timed out)") from None
        self.bytes_out += wire.frames_nbytes(frames)

    def send_nowait(self, msg: wire.WireMessage) -> bool:
        """Best-effort send (cancels): never waits on a stage that stopped reading; a lost
        stage is named by the data path, not here."""
        try:
            frames = wire.to_frames(msg)
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        self.bytes_out += wire.frames_nbytes(frames)
        return True

    def read(self) -> wire.WireMessage:
        """The next message, refusals (``wire.Error``) included; a malformed one names the node."""
        frames = self.sock.recv_multipart(copy=False)
        self.bytes_in += sum(len(f.buffer) for f in frames)
        try:
            return wire.parse_frames(frames)
        except wire.WireError as e:
            raise NodeFailedError(f"{self.describe()} sent a malformed message: {e}") from None

    def recv(self) -> wire.WireMessage:
        """The next reply to a request; a refusal becomes :class:`NodeFailedError`."""
        msg = self.read()
        if isinstance(msg, wire.Error):
            cls = NodeBusyError if msg.code == "busy" else NodeFailedError
            raise cls(f"{self.describe()} refused: {msg.message}")
        return msg

    def request(self, msg: wire.WireMessage, timeout_s: float = REQUEST_TIMEOUT_S) -> wire.WireMessage:
        """Send ``msg`` and wait for this worker's reply, watching the connection meanwhile.
        Messages that are not that reply are late and dropped: a probe, a result of a chain
        being rebuilt, the welcome of a hello that timed out (a worker that was frozen)."""
        want = wire.REPLY_TO[type(msg)]
        self.send(msg)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                reply = self.recv()  # a refusal raises
                if isinstance(reply, want):
                    return reply
                log.debug("%s: dropped a late %s while waiting for a %s", self.describe(), reply.TYPE, want.TYPE)
                continue
            lost = self.drain_events()
            if lost:
                raise self.lost(lost)
        raise NodeLostError(self._silence_reason(timeout_s), self.address)

    def _silence_reason(self, timeout_s: float) -> str:
        self.drain_events()
        if self.auth_failed or not self.handshaken:
            return (
                f"{self.describe()} did not accept us within {timeout_s:g} s: not a potluck worker, "
                "not running, or started with a different cluster token"
            )
        return f"{self.describe()} did not answer within {timeout_s:g} s"

    def await_handshake(self, deadline: float) -> bool:
        """Wait until CURVE completes (or is refused): with IMMEDIATE, a send before that
        would wait only ``SEND_TIMEOUT_MS``, whatever the caller's deadline."""
        while not (self.handshaken or self.auth_failed):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return False
            self.monitor.poll(min(left_ms, 100))
            self.drain_events()
        return self.handshaken

    def join(self, head_id: str, version: str, timeout_s: float = JOIN_TIMEOUT_S) -> wire.Welcome:
        deadline = time.monotonic() + timeout_s
        if not self.await_handshake(deadline):
            raise NodeLostError(self._silence_reason(timeout_s), self.address)
        while True:  # a worker whose last head just vanished is busy until it notices (< 3 s)
            try:
                reply = self.request(wire.Hello(head_id, version), max(0.5, deadline - time.monotonic()))
                break
            except NodeBusyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
        return self._welcomed(reply)

    def rejoin(self, head_id: str, version: str) -> None:
        """Ask a worker of a broken chain to drop its stage and welcome us again (recovery): a
        hello from the head that owns the stage releases it. Sent without waiting:
        :meth:`await_welcome` then skips what the old chain still sends."""
        self.send(wire.Hello(head_id, version))

    def await_welcome(self, deadline: float) -> wire.Welcome:
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                msg = self.read()
                if isinstance(msg, wire.Welcome):
                    return self._welcomed(msg)
                if isinstance(msg, wire.Error) and not msg.txn:
                    raise self.lost(f"refused to rejoin: {msg.message}")
                continue  # results and refusals of the old chain's transactions
            lost = self.drain_events()
            if lost:
                raise self.lost(lost)
        raise NodeLostError(f"{self.describe()} did not answer a hello within {REJOIN_TIMEOUT_S:g} s", self.address)

    def _welcomed(self, reply: wire.WireMessage) -> wire.Welcome:
        if isinstance(reply, wire.Error):
            raise NodeFailedError(f"{self.describe()} refused: {reply.message}")
        if not isinstance(reply, wire.Welcome):
            raise NodeFailedError(f"{self.describe()} answered hello with {reply.TYPE}")
        self.welcome, self.node_id = reply, reply.node_id
        return reply

    def info(self) -> NodeInfo:
        assert self.welcome is not None
        return NodeInfo(self.node_id, self.address, self.welcome.free_mb, self.welcome.speed)

    def close(self, release: bool) -> None:
        if release and self.handshaken:
            try:
                self.sock.send_multipart(wire.to_frames(wire.Release()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.monitor.close(linger=0)
        self.sock.close(linger=100 if release else 0)


@dataclass
class WireStats:
    """Traffic of one PipelineTarget (figures: bytes per token, per-batch latency)."""

    batches: int = 0
    tokens: int = 0
    replayed_batches: int = 0  # batches sent again to rebuild KV caches after a loss
    replayed_tokens: int = 0


@dataclass(frozen=True)
class PipelineSetup:
    """How to build a chain over some workers; the target keeps it to re-plan after a loss."""

    model_path: Path
    keys: CurveKeys
    head_id: str
    n_ctx: int
    n_batch: int
    n_seq_max: int
    kv_unified: bool
    hidden_dtype: str
    potluck_version: str
    slice_cache: SliceCache
    progress: Progress | None = None
    split: tuple[int, ...] | None = None  # the user's fixed layer boundaries, if any


def plan_over(setup: PipelineSetup, links: Sequence[NodeLink], split: Sequence[int] | None = None) -> SplitPlan:
    """The layer plan over joined ``links`` (fixed boundaries, or by free memory and speed)."""
    costs = layer_costs(setup.model_path)
    nodes = [lk.info() for lk in links]
    return manual_plan(costs, nodes, split, setup.n_ctx) if split else plan_split(costs, nodes, setup.n_ctx)


def replan(setup: PipelineSetup, links: Sequence[NodeLink]) -> SplitPlan:
    """The plan after the workers changed: the user's fixed split while there is one worker
    per stage of it, else by free memory and speed."""
    if setup.split:
        try:
            return plan_over(setup, links, setup.split)
        except PotluckError:
            pass  # another number of workers than the split has stages
    return plan_over(setup, links)


def load_chain(
    setup: PipelineSetup, links: Sequence[NodeLink], plan: SplitPlan, stats: TransferStats
) -> list[wire.Loaded]:
    """Send each stage its slice (unless it holds it) and load it; ``links`` in plan order."""
    for lk, s in zip(links, plan.stages):
        lk.layers = (s.lo, s.hi)
    slices = setup.slice_cache.slices(setup.model_path, plan.bounds)
    for lk, sl in zip(links, slices):
        room = lk.welcome.max_message - (64 << 10)  # type: ignore[union-attr]
        send_slice(lk.request, sl, stats, setup.progress, chunk_bytes=max(1 << 16, min(CHUNK_BYTES, room)))
    loaded: list[wire.Loaded] = []
    for i, (lk, sl) in enumerate(zip(links, slices)):
        last = i == len(links) - 1
        reply = lk.request(
            wire.Load(
                sha256=sl.sha256,
                layer_lo=sl.lo,
                layer_hi=sl.hi,
                first=i == 0,
                last=last,
                n_ctx=setup.n_ctx,
                n_batch=setup.n_batch,
                n_seq_max=setup.n_seq_max,
                kv_unified=setup.kv_unified,
                hidden_dtype=setup.hidden_dtype,
                next_addr="" if last else endpoint(links[i + 1].address),
                upstream=setup.head_id if i == 0 else f"fwd-{links[i - 1].node_id}",
                reply_to=setup.head_id,
            ),
            REQUEST_TIMEOUT_S * 4,
        )
        if not isinstance(reply, wire.Loaded):
            raise NodeFailedError(f"{lk.describe()} answered load with {reply.TYPE}")
        loaded.append(reply)
    return loaded


class HeadWorker:
    """Layers no worker can take run on the head itself: a worker on loopback inside this
    process (its llama.cpp in a supervised child, like any worker's), joined like the others."""

    def __init__(self, keys: CurveKeys, cache_dir: Path, n_threads: int = 0) -> None:
        from .profile import measure_profile
        from .worker import Worker

        self.worker = Worker(keys, measure_profile(n_threads or 1), cache_dir, bind="127.0.0.1", n_threads=n_threads)
        self.address = f"127.0.0.1:{self.worker.port}"
        self._thread = threading.Thread(target=self.worker.serve_forever, name="head-worker", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.worker.stop()
        self._thread.join(10)


class PipelineTarget(TargetBase):
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
        plan: SplitPlan | None = None,
        transfer: TransferStats | None = None,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        setup: PipelineSetup | None = None,
        recover: bool = True,
        head_fallback: bool = True,
        candidates: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        super().__init__()
        self._zctx = zctx
        self.links = list(links)
        self.tail = tail  # the model's last layer(s) and the output layer, here
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
        self.log = TransactionLog()
        self._tickets = itertools.count(1)
        self._txn = 0  # transactions sent to the current chain (each chain starts at 1)
        self._txn_ticket: dict[int, int] = {}  # txn of each batch sent to this chain -> its ticket
        self._txn_rows: dict[int, int] = {}  # txn of each batch sent to this chain -> hidden rows it returns
        self._rows: dict[int, int] = {}  # ticket of each batch not yet waited for -> logits rows it returns
        self._results: dict[int, np.ndarray] = {}  # by ticket: logits computed, not yet waited for
        self._refused: dict[int, str] = {}  # by ticket: why a stage refused it
        self._skipped: set[int] = set()  # tickets of batches of cancelled groups: skipped or aborted
        self._cancelled: dict[int, None] = {}  # job groups cancelled, oldest first (as many as a runner keeps)
        self._recoveries_in_a_row = 0
        self._notices: list[Callable[[int], Event]] = []
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

    def wait(self, ticket: Ticket) -> np.ndarray:
        """Poll until the ticket's result arrives, filing any other result that comes first;
        a lost worker is replaced on the way (the ticket survives)."""
        t = ticket.seq_no
        if t not in self._rows:
            raise KeyError(f"no batch in flight with ticket {t}")
        deadline = time.monotonic() + self.stall_timeout_s
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
        """The layers the head computes itself (with the output layer), for the panels."""
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
        self._deliver(lambda: self._send_op(lambda txn: wire.KvApply.from_op(txn, op, group), op))

    def reset(self) -> None:
        """Clear every sequence on every stage (a new conversation)."""
        self._check_usable()
        self.log.reset()
        self._deliver(lambda: self._send_op(wire.Reset, Stage.clear))
        self._n_past = 0

    def truncate(self, n_past: int) -> None:
        if n_past >= self._n_past:
            return
        if self._broken is None:
            try:
                self.kv(KvOp.rm(0, n_past))
            except NodeFailedError:
                pass  # recorded as the failure; the bookkeeping below still holds for the session
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

    def regroup(self) -> None:
        """Between replies: take in workers that joined (or came back) since the plan was
        made, if the plan gets faster with them. Nothing is in flight then; the new chain
        gets the log replayed, exactly as after a loss."""
        setup = self.setup
        if setup is None or not self.recover or self._broken is not None or self._rows or self.candidates is None:
            return
        known = {lk.address for lk in self.links} | {self.head_worker.address if self.head_worker else ""}
        ids = {lk.node_id for lk in self.links}
        now = time.monotonic()
        new: list[NodeLink] = []
        for address in self.candidates():
            if address in known or self._retry_at.get(address, 0.0) > now:
                continue
            link = NodeLink(self._zctx, setup.keys, address, setup.head_id.encode(),
                            max_result_bytes(self.n_batch, self.tail.n_embd))
            try:
                link.join(setup.head_id, setup.potluck_version, REGROUP_JOIN_TIMEOUT_S)
            except PotluckError as e:
                log.info("%s stays out of the plan: %s", address, e)
                link.close(release=False)
                self._retry_at[address] = now + REGROUP_RETRY_S
                continue
            if link.node_id in ids:
                link.close(release=False)
                continue
            new.append(link)
        if not new:
            return
        try:
            better = replan(setup, [*self.links, *new])
        except PotluckError:
            better = None
        new_ids = {lk.node_id for lk in new}
        if better is None or self.plan is None or not any(s.node.name in new_ids for s in better.stages) or (
            max(s.cost for s in better.stages) >= REGROUP_GAIN * max(s.cost for s in self.plan.stages)
        ):
            for lk in new:
                lk.close(release=True)
                self._retry_at[lk.address] = now + REGROUP_RETRY_S
            return
        names = ", ".join(lk.describe() for lk in new)
        t0 = time.monotonic()
        self.links.extend(new)
        try:
            self._rebuild()
            self._replay()
        except NodeLostError as e:
            self._recover(e)  # one of them went away meanwhile: carry on without it
            return
        except PotluckError as e:
            self._give_up(NodeFailedError(f"taking in {names} failed"), str(e))
        stages = tuple((lk.node_id, *(lk.layers or (0, 0))) for lk in self.links)
        reason = (
            f"{names} joined; the plan now uses {len(self.links)} worker(s) (rebuilt in "
            f"{time.monotonic() - t0:.1f} s, replaying {self.log.n_rows} cached tokens)"
        )
        reason += self._f16_caveat()
        log.warning("%s", reason)
        self._notices.append(lambda run_id: PlanChanged(run_id, stages, reason))

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
        return ClusterView(stages, self.head_layers, self.stats.tokens)

    def busy_ms(self) -> list[float]:
        """Computing time so far of each worker's stage in chain order, then the head's own
        layers (the last layer and the output layer): what proves the stages overlap."""
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
            for group in groups:
                self._cancelled[group] = None
            while len(self._cancelled) > CANCELLED_KEPT:
                del self._cancelled[next(iter(self._cancelled))]
            if self._broken is not None:
                continue
            for msg in cancel_messages(groups):
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
            self.tail.arrived(msg.txn, msg.hidden)
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

    # -- internals: recovery
    def _recover(self, err: NodeLostError) -> None:
        """Replace the chain after ``err``: re-plan over the workers that still answer, load
        them, replay the log. Raises :class:`NodeFailedError` (target unusable) if it cannot."""
        if not self.recover or self.setup is None:
            self._fail(str(err))
            raise NodeFailedError(str(err)) from None
        self._recoveries_in_a_row += 1
        if self._recoveries_in_a_row > MAX_RECOVERIES_IN_A_ROW:
            self._give_up(err, f"{MAX_RECOVERIES_IN_A_ROW} recoveries in a row returned nothing")
        self._flush_cancels()
        first_reason = str(err)
        log.warning("%s; re-planning over the other workers", first_reason)
        old_stages = [(lk.node_id, *(lk.layers or (0, 0))) for lk in self.links]
        t0 = time.monotonic()
        for attempt in range(1, MAX_REBUILDS + 1):
            lost = [lk for lk in self.links if lk.address == err.address] or [
                lk for lk in self.links if lk.drain_events()
            ]
            for lk in lost:
                self._notice_node(lk, "lost", str(err))
                lk.close(release=False)
            self.links = [lk for lk in self.links if lk not in lost]
            for lk in self.links:
                self._notice_node(lk, "recovering", "rebuilding its KV cache from the head's log")
            try:
                self._rebuild()
                self._replay()
                break
            except NodeLostError as again:
                if attempt == MAX_REBUILDS or time.monotonic() - t0 > RECOVERY_DEADLINE_S:
                    self._give_up(again, f"the chain broke again {attempt} time(s) while being rebuilt")
                err = again
                log.warning("%s during recovery", again)
            except PotluckError as e:
                self._give_up(err, str(e))
        self.recoveries += 1
        self.recovery_s.append(time.monotonic() - t0)
        new_stages = tuple((lk.node_id, *(lk.layers or (0, 0))) for lk in self.links)
        reason = (
            f"{first_reason}; continued on {len(self.links)} worker(s) after "
            f"{time.monotonic() - t0:.1f} s, replaying {self.log.n_rows} cached tokens"
        )
        reason += self._f16_caveat()
        log.warning("recovered: %s (was %s)", reason, old_stages)
        self._notices.append(lambda run_id: PlanChanged(run_id, new_stages, reason))

    def _f16_caveat(self) -> str:
        """f16 hidden states round at every stage boundary: new boundaries, new roundings."""
        if self.setup is not None and self.setup.hidden_dtype != "f32":
            return f" ({self.setup.hidden_dtype} hidden states: the rest may differ from an uninterrupted run)"
        return ""

    def _give_up(self, err: NodeFailedError, why: str) -> None:
        message = f"{err}; recovery failed: {why}"
        for lk in self.links:
            lk.close(release=True)
        self.links = []
        self._watch_links()
        self._fail(message)
        raise NodeFailedError(message) from None

    def _notice_node(self, link: NodeLink, state: str, detail: str) -> None:
        node, layers = link.node_id or link.address, link.layers or (0, 0)
        self._notices.append(lambda run_id: NodeStatus(run_id, node, layers, state, detail))

    def _rebuild(self) -> None:
        """Bring the surviving workers back to idle, plan over them and load the new chain."""
        setup = self.setup
        assert setup is not None
        for lk in self.links:
            lk.rejoin(setup.head_id, setup.potluck_version)
        deadline = time.monotonic() + REJOIN_TIMEOUT_S
        for lk in self.links:
            lk.await_welcome(deadline)
        try:
            if not self.links:
                raise PotluckError("no worker is left to take over its layers")
            plan = replan(setup, self.links)
        except PotluckError as e:
            here = self.head_worker.address if self.head_worker else ""
            if not self.head_fallback or any(lk.address == here for lk in self.links):
                raise
            log.warning("%s; the head loads the layers itself", e)
            self.links.append(self._join_head_worker())
            plan = replan(setup, self.links)
        by_id = {lk.node_id: lk for lk in self.links}
        used = [by_id[s.node.name] for s in plan.stages]
        for lk in self.links:
            if lk not in used:
                lk.close(release=True)
        self.links = used
        self._watch_links()
        loaded = load_chain(setup, used, plan, self.transfer)
        if loaded[-1].n_embd != self.tail.n_embd or min(ld.n_ctx for ld in loaded) < self.n_ctx:
            raise PotluckError("the new chain's width or context differs from the old one's")
        self.plan = plan

    def _join_head_worker(self) -> NodeLink:
        setup = self.setup
        assert setup is not None
        if self.head_worker is None:
            self.head_worker = HeadWorker(setup.keys, setup.slice_cache.folder / "head-worker")
        link = NodeLink(self._zctx, setup.keys, self.head_worker.address, setup.head_id.encode(),
                        max_result_bytes(self.n_batch, self.tail.n_embd))
        try:
            link.join(setup.head_id, setup.potluck_version, HEAD_WORKER_JOIN_TIMEOUT_S)
        except NodeFailedError:
            link.close(release=False)
            self.head_worker.close()  # it does not answer: the next attempt starts a fresh one
            self.head_worker = None
            raise
        return link

    def _replay(self) -> None:
        """Send the log, in order, to the new chain's first stage and the cleared tail: each
        stage applies exactly what the old chain applied. Batches whose result is still
        awaited keep their ticket; what the tail finished before it was cleared is filed."""
        self._file_tail(self.tail.restart())
        self._txn = 0
        self._txn_ticket.clear()
        self._txn_rows.clear()
        for entry in self.log:
            if isinstance(entry, LoggedKv):
                op, group = entry.op, entry.group
                self._send_op(lambda txn, op=op, group=group: wire.KvApply.from_op(txn, op, group), op)
                continue
            assert isinstance(entry, LoggedBatch)
            job = entry.job
            if self._awaited(entry.ticket):
                if job.group in self._cancelled:  # the old chain would have skipped it
                    self._skipped.add(entry.ticket)
                    self.log.forget(entry.ticket)
                    continue
            else:
                job = dataclasses.replace(job, group=REPLAY_GROUP)
            self._send_batch(entry.ticket, job)
            self.stats.replayed_batches += 1
            self.stats.replayed_tokens += job.n_tokens
        # The new stages skip later batches of cancelled groups as the old ones did; replayed
        # batches run under REPLAY_GROUP, so these cancels cannot touch them.
        for msg in cancel_messages(tuple(self._cancelled)):
            for link in self.links:
                link.send_nowait(msg)


# --------------------------------------------------------------------------- open


def tail_threads(addresses: Sequence[str]) -> int:
    """Threads for the head's own layers when none are asked for: all cores, but one when a
    worker shares this machine. Between batches llama.cpp's OpenMP threads spin, and a
    spinning thread takes the core a local worker computes on. Measured with 2 loopback
    workers on 2 cores: the head's CPU fell from 13.3 to 5.0 ms a token, its layers took
    3.7 ms instead of 2.9, synchronous decoding held its speed and pipeinfer went from 51 to
    63 tok/s on code edits, 28 to 38 on chat."""
    return 1 if any(_on_this_machine(a) for a in addresses) else 0


def _on_this_machine(address: str) -> bool:
    """Loopback, or an address of one of this machine's interfaces (a worker found by
    zeroconf on the same PC is listed at its LAN address): only this machine can bind it.
    Host names other than localhost are not resolved (no DNS wait); they count as remote."""
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def open_pipeline(
    model_path: Path,
    addresses: Sequence[str],
    keys: CurveKeys,
    *,
    n_ctx: int = 4096,
    n_batch: int = 512,
    n_seq_max: int = 1,
    kv_unified: bool = True,
    split: Sequence[int] | None = None,
    hidden_dtype: str = "f32",
    potluck_version: str = "0",
    on_plan: Callable[[SplitPlan], None] | None = None,
    progress: Progress | None = None,
    slice_cache: SliceCache | None = None,
    join_timeout_s: float = JOIN_TIMEOUT_S,
    skip_failed_joins: bool = False,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    recover: bool = True,
    head_fallback: bool = True,
    candidates: Callable[[], Sequence[str]] | None = None,
    n_threads: int = 0,
) -> PipelineTarget:
    """Join the workers at ``addresses``, plan the split, send slices, load the stages, and
    load the head's own last layer(s) and output layer (``n_threads`` for those; 0: see
    :func:`tail_threads`).

    ``split``: fixed layer boundaries of the workers' stages (e.g. ``[0, 9, 18]``), one stage
    per address in order; the last stage ends where the head's layers begin, so an end of
    ``n_layer`` means that too (:func:`.plan.manual_plan`). None plans by free memory and speed.
    ``on_plan`` sees the plan before anything loads.
    ``skip_failed_joins`` (``--nodes auto``): a node that does not join is skipped with a
    warning instead of failing the pipeline (anyone can advertise a zeroconf record).
    ``recover``: re-plan over the other workers when one is lost (else the target just fails);
    ``head_fallback``: when what is left cannot hold the model, the head loads layers itself.
    ``candidates``: the workers that may join between replies (default: ``addresses``, so a
    lost worker restarted at its address is taken back when that makes the plan faster).
    """
    if not addresses:
        raise PotluckError("no workers given: pass --nodes host:port,... or start `potluck worker`s")
    model_path = Path(model_path)
    costs = layer_costs(model_path)
    if costs.arch not in SPLITTABLE_ARCHS:
        raise PotluckError(
            f"cannot split {model_path.name}: architecture {costs.arch!r} is not verified for "
            f"exact layer splitting (supported: {', '.join(sorted(SPLITTABLE_ARCHS))})"
        )
    zctx = zmq.Context()
    head_id = f"head-{os.urandom(16).hex()}"  # the routing id that owns our stages: unguessable
    setup = PipelineSetup(
        model_path, keys, head_id, n_ctx, n_batch, n_seq_max, kv_unified, hidden_dtype, potluck_version,
        slice_cache or SliceCache(), progress, tuple(split) if split else None,
    )
    max_msg = max_result_bytes(n_batch, costs.n_embd)
    links = [NodeLink(zctx, keys, addr, head_id.encode(), max_msg) for addr in addresses]
    tail: HeadTail | None = None
    try:
        for link in list(links):
            try:
                link.join(head_id, potluck_version, join_timeout_s)
            except NodeFailedError as e:
                if not skip_failed_joins:
                    raise
                log.warning("skipping %s: %s", link.address, e)
                link.close(release=False)
                links.remove(link)
        if not links:
            raise PotluckError("none of the discovered workers could be joined; see the warnings above")
        ids = [lk.node_id for lk in links]
        if len(set(ids)) != len(ids):
            raise PotluckError("the same worker is listed twice in --nodes")
        plan = plan_over(setup, links, split)
        if on_plan:
            on_plan(plan)
        by_id = {lk.node_id: lk for lk in links}
        used = [by_id[s.node.name] for s in plan.stages]
        for lk in links:
            if lk not in used:
                lk.close(release=True)
        links = used
        stats = TransferStats()
        loaded = load_chain(setup, links, plan, stats)
        (tail_slice,) = setup.slice_cache.slices(model_path, list(plan.head))
        params = ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max,
                               n_threads=n_threads or tail_threads([lk.address for lk in links]),
                               kv_unified=kv_unified)  # as a worker's stage (child.py)
        tail = HeadTail(tail_slice.path, plan.head, params)
        if loaded[-1].n_embd != tail.n_embd:
            raise NodeFailedError(
                f"{links[-1].describe()} loaded hidden states of width {loaded[-1].n_embd}; "
                f"the model has {tail.n_embd}"
            )
        return PipelineTarget(
            zctx,
            links,
            tail,
            n_vocab=costs.n_vocab,
            n_ctx=min(n_ctx, tail.n_ctx, *(ld.n_ctx for ld in loaded)),
            n_batch=n_batch,
            n_seq_max=n_seq_max,
            plan=plan,
            transfer=stats,
            stall_timeout_s=stall_timeout_s,
            setup=setup,
            recover=recover,
            head_fallback=head_fallback,
            candidates=candidates or (lambda: list(addresses)),
        )
    except BaseException:
        for lk in links:
            lk.close(release=True)
        if tail is not None:
            tail.close()
        zctx.term()
        raise
