"""The head side: :class:`PipelineTarget`, a :class:`~potluck.engine.target.Target` whose layers
run on LAN workers, and :func:`open_pipeline`, which joins, plans, distributes and loads.

Data path: head -> stage 1 -> ... -> stage N -> head. The head sends every transaction
(``forward`` batches, ``kv`` operations, ``reset``) to stage 1 only; each stage applies it and
passes it on, so KV operations and batches happen in the same order everywhere. Any number of
batches may be in flight: the last stage's results are filed by transaction number as they
arrive and handed to whoever waits for that ticket, never dropped. ``cancel(run_id)`` goes
to every stage out of band: queued batches of the run are skipped, a running one is aborted.

The head needs the target's vocabulary and chat template only: the loader opens the target
vocab-only, so a model too big for the head still works in cluster mode.

Failure: every link has a ZeroMQ monitor; a worker that dies (socket closed) or freezes
(heartbeats stop, 2.5 s) or refuses a transaction is reported by name as a
:class:`NodeFailedError`, the target becomes unusable and the session keeps the
conversation. A stage that stays busy past ``stall_timeout_s`` is named the same way.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from ..errors import PotluckError
from ..events import NodeStatus
from ..gguf_tools import SPLITTABLE_ARCHS
from ..jobs import DecodeJob, RunCancelled, Ticket
from ..kv import KvOp
from ..target import TargetBase
from . import wire
from .plan import NodeInfo, SplitPlan, layer_costs, manual_plan, plan_split
from .transfer import CHUNK_BYTES, Progress, SliceCache, TransferStats, send_slice
from .transport import AUTH_FAILED_EVENTS, CurveKeys, client_socket, endpoint, read_event

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 30.0
STALL_TIMEOUT_S = 60.0
SEND_TIMEOUT_MS = 3000


class NodeFailedError(PotluckError):
    """A worker died, froze, went away or refused work; the message names it."""


class NodeBusyError(NodeFailedError):
    """The worker serves another head (it refused our hello with code ``busy``)."""


def max_result_bytes(n_batch: int, n_vocab: int) -> int:
    """The largest message a worker may send this head: a result of every row of the
    largest batch at the head's own vocabulary width, plus headers (ZMQ_MAXMSGSIZE)."""
    return n_batch * n_vocab * 4 + (1 << 20) if n_vocab > 0 else -1


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

    def send(self, msg: wire.WireMessage) -> None:
        frames = wire.to_frames(msg)
        try:
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            self.drain_events()
            if not self.handshaken:  # IMMEDIATE: nothing queues before the CURVE handshake
                raise NodeFailedError(self._silence_reason(SEND_TIMEOUT_MS / 1000)) from None
            raise NodeFailedError(f"{self.describe()} is unreachable (send timed out)") from None
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
        """Send ``msg`` and wait for this worker's reply, watching the connection meanwhile."""
        self.send(msg)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                reply = self.recv()
                if isinstance(reply, wire.Pong) and reply.nonce == wire.PROBE_NONCE:
                    continue  # the worker checking we are still here
                return reply
            lost = self.drain_events()
            if lost:
                raise NodeFailedError(f"{self.describe()} {lost}")
        raise NodeFailedError(self._silence_reason(timeout_s))

    def _silence_reason(self, timeout_s: float) -> str:
        self.drain_events()
        if self.auth_failed or not self.handshaken:
            return (
                f"{self.describe()} did not accept us within {timeout_s:g} s: not a potluck worker, "
                "not running, or started with a different cluster token"
            )
        return f"{self.describe()} did not answer within {timeout_s:g} s"

    def join(self, head_id: str, version: str, timeout_s: float = JOIN_TIMEOUT_S) -> wire.Welcome:
        deadline = time.monotonic() + timeout_s
        while True:  # a worker whose last head just vanished is busy until it notices (< 3 s)
            try:
                reply = self.request(wire.Hello(head_id, version), max(0.5, deadline - time.monotonic()))
                break
            except NodeBusyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
        if not isinstance(reply, wire.Welcome):
            raise NodeFailedError(f"{self.describe()} answered hello with {reply.TYPE}")
        self.welcome, self.node_id = reply, reply.node_id
        return reply

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


class PipelineTarget(TargetBase):
    """A Target whose layers run on a chain of workers; sequence 0 is the conversation.

    Sockets belong to the thread that made the target; ``cancel`` from any other thread is
    queued and sent by that thread within one poll (50 ms).
    """

    def __init__(
        self,
        zctx: zmq.Context,
        links: Sequence[NodeLink],
        *,
        n_vocab: int,
        n_ctx: int,
        n_batch: int,
        n_seq_max: int = 1,
        plan: SplitPlan | None = None,
        transfer: TransferStats | None = None,
        stall_timeout_s: float = STALL_TIMEOUT_S,
    ) -> None:
        super().__init__()
        self._zctx = zctx
        self.links = list(links)
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.plan = plan
        self.transfer = transfer or TransferStats()
        self.stall_timeout_s = stall_timeout_s
        self.stats = WireStats()
        self._txn = 0
        self._expected: dict[int, int] = {}  # txn of each batch in flight -> rows it returns
        self._results: dict[int, wire.Result] = {}  # arrived, not yet waited for
        self._refused: dict[int, str] = {}  # txn -> why a stage refused it
        self._owner = threading.get_ident()
        self._cancel_requests: collections.deque[int] = collections.deque()
        self._broken: str | None = None
        self._poller = zmq.Poller()
        for link in self.links:
            self._poller.register(link.sock, zmq.POLLIN)
            self._poller.register(link.monitor, zmq.POLLIN)

    @property
    def failure(self) -> str | None:
        """Why this pipeline stopped working (None while healthy)."""
        return self._broken

    # -- Target: runs
    def submit(self, job: DecodeJob) -> Ticket:
        self._check_usable()
        if job.n_tokens > self.n_batch:
            raise ValueError(f"a batch of {job.n_tokens} tokens exceeds n_batch {self.n_batch}")
        self._flush_cancels()
        txn = self._next_txn()
        self._send_first(wire.Forward.from_job(txn, job))
        self._expected[txn] = job.n_outputs
        self.stats.batches += 1
        self.stats.tokens += job.n_tokens
        return Ticket(job.run_id, txn)

    def wait(self, ticket: Ticket) -> np.ndarray:
        """Poll until the ticket's result arrives, filing any other result that comes first."""
        txn = ticket.seq_no
        if txn not in self._expected:
            raise KeyError(f"no batch in flight with transaction {txn}")
        deadline = time.monotonic() + self.stall_timeout_s
        try:
            while txn not in self._results and txn not in self._refused:
                self._check_usable()
                self._flush_cancels()
                if self._receive(timeout_ms=50):
                    deadline = time.monotonic() + self.stall_timeout_s  # the pipeline is moving
                elif time.monotonic() > deadline:
                    raise NodeFailedError(self._stalled_reason())
        except NodeFailedError as e:
            self._fail(str(e))
            raise
        rows = self._expected.pop(txn)
        if txn in self._refused:
            self._results.pop(txn, None)
            raise PotluckError(self._refused.pop(txn))
        res = self._results.pop(txn)
        if res.skip:
            raise RunCancelled(f"run {res.run_id} was cancelled")
        if res.logits.shape != (rows, self.n_vocab):
            err = f"the last stage returned logits of shape {res.logits.shape}, expected ({rows}, {self.n_vocab})"
            self._fail(err)
            raise NodeFailedError(err)
        return res.logits

    def cancel(self, run_id: int) -> None:
        """Tell every stage to skip ``run_id``'s queued batches and abort its running one."""
        self._cancel_requests.append(run_id)
        if threading.get_ident() == self._owner:
            self._flush_cancels()

    def kv(self, op: KvOp, run_id: int = 0) -> None:
        self._check_usable()
        self._send_first(wire.KvApply.from_op(self._next_txn(), op, run_id))

    def reset(self) -> None:
        """Clear every sequence on every stage (a new conversation)."""
        self._check_usable()
        self._send_first(wire.Reset(self._next_txn()))
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
        self._zctx.term()

    # -- more than the Target protocol
    def node_status(self, run_id: int) -> list[NodeStatus]:
        state = "failed" if self._broken else "ok"
        return [
            NodeStatus(run_id=run_id, node=link.node_id or link.address, layers=link.layers or (0, 0),
                       state=state, detail=link.address)
            for link in self.links
        ]

    def wire_bytes(self) -> tuple[int, int]:
        """(bytes the head sent, bytes it received) on the data path and control so far."""
        return sum(lk.bytes_out for lk in self.links), sum(lk.bytes_in for lk in self.links)

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

    # -- internals
    def _next_txn(self) -> int:
        self._txn += 1
        return self._txn

    def _send_first(self, msg: wire.WireMessage) -> None:
        try:
            self.links[0].send(msg)
        except NodeFailedError as e:
            self._fail(str(e))
            raise

    def _flush_cancels(self) -> None:
        while self._cancel_requests:
            run_id = self._cancel_requests.popleft()
            if self._broken is not None:
                continue
            for link in self.links:
                link.send_nowait(wire.Cancel(run_id))

    def _receive(self, timeout_ms: int, control_from: NodeLink | None = None) -> object:
        """Read what arrived within ``timeout_ms``: file results and refusals by txn; return
        True if anything came, or the first control reply from ``control_from``."""
        events = dict(self._poller.poll(timeout_ms))
        got: object = False
        for link in self.links:
            if link.monitor in events:
                lost = link.drain_events()
                if lost:
                    raise NodeFailedError(f"{link.describe()} {lost}")
            if link.sock not in events:
                continue
            while link.sock.poll(0):
                msg = link.read()
                got = got or True
                if isinstance(msg, wire.Result) and link is self.links[-1] and msg.txn in self._expected:
                    rows = self._expected[msg.txn]
                    if not msg.skip and msg.logits.shape != (rows, self.n_vocab):
                        # checked against this head's own vocabulary, never the worker's word
                        raise NodeFailedError(
                            f"{link.describe()} sent logits of shape {msg.logits.shape} for transaction "
                            f"{msg.txn}, expected ({rows}, {self.n_vocab})"
                        )
                    self._results[msg.txn] = msg
                elif isinstance(msg, wire.Error):
                    why = f"{link.describe()} refused: {msg.message}"
                    if msg.txn in self._expected:
                        self._refused.setdefault(msg.txn, why)
                    else:  # a KV operation or reset failed: the stages may disagree now
                        raise NodeFailedError(why)
                elif link is control_from and not isinstance(msg, wire.Result):
                    return msg
        return got

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise NodeFailedError(self._broken)

    def _fail(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
            log.error("pipeline stopped: %s", why)

    def _stalled_reason(self) -> str:
        """Name the stage that does not answer a ping (it is stuck computing)."""
        for i, link in enumerate(self.links):
            try:
                link.send(wire.Ping(i))
                if not link.sock.poll(1000):
                    return f"{link.describe()} stalled: no reply for {self.stall_timeout_s:g} s"
                self._receive(timeout_ms=0)
            except NodeFailedError as e:
                return str(e)
        return f"the pipeline returned nothing for {self.stall_timeout_s:g} s"


# --------------------------------------------------------------------------- open


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
) -> PipelineTarget:
    """Join the workers at ``addresses``, plan the split, send slices, load the stages.

    ``split``: fixed layer boundaries (e.g. ``[0, 9, 18]``), one stage per address in order;
    None plans by free memory and speed score. ``on_plan`` sees the plan before anything loads.
    ``skip_failed_joins`` (``--nodes auto``): a node that does not join is skipped with a
    warning instead of failing the pipeline (anyone can advertise a zeroconf record).
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
    max_msg = max_result_bytes(n_batch, costs.n_vocab)
    links = [NodeLink(zctx, keys, addr, head_id.encode(), max_msg) for addr in addresses]
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
        nodes = [
            NodeInfo(lk.node_id, lk.address, lk.welcome.free_mb, lk.welcome.speed)  # type: ignore[union-attr]
            for lk in links
        ]
        plan = manual_plan(costs, nodes, split, n_ctx) if split else plan_split(costs, nodes, n_ctx)
        if on_plan:
            on_plan(plan)
        by_id = {lk.node_id: lk for lk in links}
        used = [by_id[s.node.name] for s in plan.stages]
        for lk in links:
            if lk not in used:
                lk.close(release=True)
        links = used
        for lk, s in zip(links, plan.stages):
            lk.layers = (s.lo, s.hi)
        cache = slice_cache or SliceCache()
        slices = cache.slices(model_path, plan.bounds)
        stats = TransferStats()
        for lk, sl in zip(links, slices):
            room = lk.welcome.max_message - (64 << 10)  # type: ignore[union-attr]
            send_slice(lk.request, sl, stats, progress, chunk_bytes=max(1 << 16, min(CHUNK_BYTES, room)))
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
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    n_seq_max=n_seq_max,
                    kv_unified=kv_unified,
                    hidden_dtype=hidden_dtype,
                    next_addr="" if last else endpoint(links[i + 1].address),
                    upstream=head_id if i == 0 else f"fwd-{links[i - 1].node_id}",
                    reply_to=head_id,
                ),
                REQUEST_TIMEOUT_S * 4,
            )
            if not isinstance(reply, wire.Loaded):
                raise NodeFailedError(f"{lk.describe()} answered load with {reply.TYPE}")
            if reply.n_vocab != costs.n_vocab:
                raise NodeFailedError(
                    f"{lk.describe()} loaded a vocabulary of {reply.n_vocab} tokens; the model has {costs.n_vocab}"
                )
            loaded.append(reply)
        return PipelineTarget(
            zctx,
            links,
            n_vocab=costs.n_vocab,
            n_ctx=min(n_ctx, *(ld.n_ctx for ld in loaded)),
            n_batch=n_batch,
            n_seq_max=n_seq_max,
            plan=plan,
            transfer=stats,
            stall_timeout_s=stall_timeout_s,
        )
    except BaseException:
        for lk in links:
            lk.close(release=True)
        zctx.term()
        raise
