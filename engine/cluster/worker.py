"""The worker side: one ROUTER socket serving a head's control requests and pipeline traffic.

Life of a worker: wait for a head (``hello``), receive or find its slice by sha256
(``offer``/``chunk``), ``load`` it as one :class:`~potluck.engine.core.stage.Stage`, then take
data-path transactions in ``txn`` order: ``forward`` (a batch: compute, pass hidden states to
the next stage, or back to the head from the last worker: the head computes the model's last
layer and the output layer itself), ``kv`` and ``reset`` (apply, pass on). ``release``
by its head, or that head going away, frees the stage and the worker waits again.

This process never runs llama.cpp: the stage lives in a supervised child (child.py), so a
slice that makes llama.cpp abort or segfault costs that child only; the head is told the
cause and the worker serves the next head. This thread owns every socket and answers
control messages at once; the child computes. So a ``cancel`` reaches a running batch
(aborted mid-compute through llama.cpp's abort flag) and queued batches of the run are
skipped; a skipped or refused batch still goes downstream, empty, so every stage sees every
transaction in order. The poller also watches the stage process's replies: this thread
reads them itself and sends finished work on at once.

Nothing a peer sends can crash or stall a worker: every message is validated by
:func:`.wire.parse_frames`, by ownership, and by the stage before use, refused with a log
line and an ``error`` reply; replies never wait on a peer that does not read them; load
settings are checked against this machine's memory and the architecture allow-list;
received slices live under a quota and are re-hashed before each load.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import zmq

from ..core.errors import PotluckError
from ..core.jobs import CancelledGroups, GroupCancelled
from ..core.spec import CurveKeys
from . import inbox, wire
from .child import StageCrashed, StageProcess
from .profile import NodeProfile, free_memory_mb
from .slice_store import SliceStore, SliceUploads
from .stage_host import Handback, LoadedStage, check_load, load_stage
from .transfer import LocalModels
from .transport import (
    AUTH_FAILED_EVENTS,
    check_next_stage,
    client_socket,
    on_this_machine,
    peer_address,
    raise_open_files_limit,
    read_event,
    server_socket,
    start_authenticator,
)

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_MS = 5000
DEFAULT_CACHE_QUOTA_MB = 20 * 1024
PROBE_INTERVAL_S = 1.0
SETUP_LEASE_S = 30.0  # an owner with no stage yet keeps the worker this long after its last request
DRAIN_MAX = 20_000  # messages read in one pass over the socket


class NotOwnerError(PotluckError):
    """A control request from a peer that does not own this worker's stage (code ``busy``)."""


class Worker:
    """Serves one head at a time on ``tcp://bind:port`` until :meth:`stop`.

    Ownership: the holder of the key in the ``hello`` that opened the session owns the
    worker; only requests signed with that key may offer, upload, load, release or cancel
    (never a routing id: any token holder may claim any). Pipeline traffic is taken only
    when signed with the key the owner's ``load`` named for this stage's upstream. While a
    stage is loaded, a ``hello`` with another key is refused (``busy``) unless the owner has
    gone away (a reply to it fails at once: ROUTER_MANDATORY). ``ping`` and ``status`` are
    open to any token holder: they change nothing. Peers other than the owner and the
    upstream get a budget of messages and bytes a second (:mod:`.inbox`).
    """

    def __init__(
        self,
        keys: CurveKeys,
        profile: NodeProfile,
        cache_dir: Path,
        *,
        bind: str = "0.0.0.0",
        port: int = 0,
        n_threads: int = 0,
        max_msg_bytes: int = wire.DEFAULT_MAX_BYTES,
        cache_quota_bytes: int = DEFAULT_CACHE_QUOTA_MB << 20,
        potluck_version: str = "0",
        models_dir: Path | None = None,
    ) -> None:
        self.keys = keys
        self.profile = profile
        self.store = SliceStore(Path(cache_dir), cache_quota_bytes)
        self.cache_dir = self.store.folder
        self.n_threads = n_threads
        self.max_msg_bytes = max_msg_bytes
        self.version = potluck_version
        self.open_files = raise_open_files_limit()
        self.zctx = zmq.Context()
        self.auth = start_authenticator(self.zctx, keys)
        self.sock = server_socket(self.zctx, keys, max_msg_bytes=max_msg_bytes)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        if port:
            self.sock.bind(f"tcp://{bind}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{bind}")
        self.bind = bind
        self._stop = False
        self.stage: LoadedStage | None = None
        self.owner: bytes = b""  # routing id of the connection the owner last proved itself on
        self.owner_key = b""  # the key of the owner's hello: its later requests are signed with it
        self.owner_local = False  # whether the owner's connection comes from this machine
        self.owner_name = ""
        self._probed_at = 0.0
        self.owner_seen = 0.0  # when the owner last proved itself (hello or a signed request)
        self.txn = 0
        self.upstream_key = b""  # signs the pipeline traffic this stage takes (from the Load)
        self.downstream_key = b""  # signs what it passes on
        self.upstream_ident = b""  # the connection the upstream's signed traffic came on
        self.budget = inbox.PeerBudget()  # what other peers may still send this second
        self._trimmed_at = 0  # dropped count when freed memory was last given back
        self.forward: zmq.Socket | None = None
        self.next_lost = ""  # why a forward was not taken: the order downstream is broken
        self.handback = Handback()  # finished stage work and crashes, sent on by this thread
        # job groups the owner cancelled: their jobs that arrive later go to the stage as
        # placeholders, so a cancel never depends on which of the stage's pipes is read first
        self.cancelled = CancelledGroups()
        self._poller = zmq.Poller()  # the socket, the monitor and the stage process's replies
        # --models: whole GGUFs this worker holds, hashed once; their slices are cut here
        models = LocalModels(models_dir, self.store.folder / "models-index") if models_dir else None
        self.uploads = SliceUploads(self.store, models)
        # A stage process that imports llama.cpp while no stage is loaded, so a load need not
        # wait for it. Never beside a loaded stage: it holds ~170 MB, which the free memory a
        # worker reports at join already counts once (docs/facts.md §17).
        self._spare: StageProcess | None = StageProcess()
        # The drain (numba) loads before the worker serves anyone: in a thread beside the
        # loop it held the GIL for most of a second, and a head joining then timed this
        # link's pings at 3-13 ms instead of 0.3 (and planned around a slow link).
        inbox.warm_up(self.zctx)
        self.rejected = 0  # messages refused (tests and logs)
        self.dropped_replies = 0  # replies to peers that do not read theirs
        self.unreachable_replies = 0  # replies to peers already gone
        self.crashes = 0
        self.forward_refused = 0  # forwards failed at once after the next stage was lost
        self.bytes_received = 0

    # -- lifetime
    @property
    def node(self) -> str:
        return f"{self.profile.node_id}@{self.bind}:{self.port}"

    def stop(self) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        poller = self._poller
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        log.info("worker %s waiting for a head", self.node)
        try:
            while not self._stop:
                events = dict(poller.poll(200))
                if self.monitor in events:
                    self._log_handshake_failures()
                if self.stage is not None and self.stage.proc.fileno() in events:
                    self._send_finished()
                if self.sock in events:
                    self._serve_pending()
                elif not events and self.budget.dropped > self._trimmed_at:
                    self._trimmed_at = self.budget.dropped
                    inbox.give_back_freed_memory()  # a flood is over: what libzmq queued goes back
        finally:
            self.close()

    def _serve_pending(self) -> None:
        """Drain the socket at once (libzmq's queue has no bound, see :mod:`.inbox`): serve
        the owner's and the upstream's messages as they are read. Once a pass finds a backlog
        (``inbox.UNMETERED`` messages), other peers are metered for the rest of the second:
        :meth:`~.inbox.PeerBudget.skim` drops what their budgets do not allow, unread, and
        what they do allow is kept for the end of the pass."""
        sock, budget = self.sock, self.budget
        budget.new_pass()
        budget.trust(self.owner, self.upstream_ident)
        others: list[tuple[bytes, list]] = []
        for i in range(DRAIN_MAX):  # bounded, so the stop flag and the monitor are checked
            if not budget.metering and i == inbox.UNMETERED:
                budget.metering = True
            if budget.metering:
                got = budget.skim(sock, between=self._send_finished)  # results go out meanwhile
                if got is None:
                    self._send_finished()
                    break
                ident, key = got
            else:
                try:
                    ident = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
            if ident and (ident == self.owner or ident == self.upstream_ident):
                self._serve(ident, self._rest())
                budget.trust(self.owner, self.upstream_ident)  # a hello or a load may name new ones
                continue
            rest = self._rest()
            size = sum(map(len, rest))
            self.bytes_received += size
            if not budget.metering or budget.spend(key, size):  # a new upstream proves itself with its first message
                self._serve(ident, rest)
                budget.trust(self.owner, self.upstream_ident)
            elif budget.keep(size):
                others.append((ident, rest))
        budget.log_drops()
        for ident, rest in others:
            self._serve(ident, rest)

    def _rest(self) -> list:
        """The frames after a routing id, zero-copy (a zmq.Frame knows its peer's address)."""
        frames = [self.sock.recv(copy=False)]
        while self.sock.getsockopt(zmq.RCVMORE):
            frames.append(self.sock.recv(copy=False))
        return frames

    def _serve(self, ident: bytes, frames: list) -> None:
        self.handle(ident, frames)
        self._send_finished()  # keep results flowing while a burst of requests arrives

    def _log_handshake_failures(self) -> None:
        while self.monitor.poll(0):
            try:
                event, _ = read_event(self.monitor)
            except zmq.ZMQError:
                return
            if event in AUTH_FAILED_EVENTS:
                self.rejected += 1
                log.warning("refused a connection that failed the CURVE handshake (no or wrong token)")

    def close(self) -> None:
        self._release()
        self.uploads.drop()
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.auth.stop()
        self.zctx.term()

    # -- dispatch
    def handle(self, ident: bytes, frames: list) -> None:
        try:
            msg, signature = wire.parse_signed(frames, max_bytes=self.max_msg_bytes)
        except wire.WireError as e:
            self._refuse(ident, "malformed", str(e))
            return
        try:
            if isinstance(msg, (wire.Forward, wire.KvApply, wire.Reset)):
                self._data(ident, msg, signature)
            else:
                self._control(ident, msg, signature, frames)
        except NotOwnerError as e:
            self._refuse(ident, "busy", str(e), getattr(msg, "txn", 0))
        except PotluckError as e:
            self._refuse(ident, "refused", str(e), getattr(msg, "txn", 0))
        except Exception as e:  # a bug must not take the worker down
            log.exception("error while serving %s", type(msg).__name__)
            self._refuse(ident, "internal", f"{type(e).__name__}: {e}", getattr(msg, "txn", 0))

    def _refuse(self, ident: bytes, code: str, why: str, txn: int = 0) -> None:
        self.rejected += 1
        log.warning("refused a message from %r: %s", ident[:24], why)
        self._send(ident, wire.Error(node=self.node, code=code, message=why, txn=txn))

    def _send(self, ident: bytes, msg: wire.WireMessage) -> bool:
        """Queue a reply without ever waiting: a peer that is gone or does not read its
        replies loses this one (counted), everyone else is served meanwhile."""
        try:
            self.sock.send_multipart([ident, *wire.to_frames(msg)], copy=False)
            return True
        except zmq.Again:
            self.dropped_replies += 1
            if self.dropped_replies % 1000 == 1:  # a flood must not become a flood of log lines
                log.warning("dropped a reply to %r: it does not read its replies (%d dropped so far)",
                            ident[:24], self.dropped_replies)
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY: EHOSTUNREACH)
            self.unreachable_replies += 1
            if self.unreachable_replies % 1000 == 1:
                log.info("could not reply to %r: %s (%d so far)", ident[:24], e, self.unreachable_replies)
        return False

    def _owner_present(self) -> bool:
        """Whether the owner's connection is still up (a probe it ignores; rate-limited)."""
        now = time.monotonic()
        if now - self._probed_at < PROBE_INTERVAL_S:
            return True
        self._probed_at = now
        try:
            self.sock.send_multipart([self.owner, *wire.to_frames(wire.Pong(wire.PROBE_NONCE))], copy=False)
        except zmq.Again:
            return True  # there, only not reading
        except zmq.ZMQError:
            return False
        return True

    def _control(self, ident: bytes, msg: wire.WireMessage, signature: str, frames: list) -> None:
        if isinstance(msg, wire.Ping):
            self._send(ident, wire.Pong(msg.nonce))
            return
        if isinstance(msg, wire.Status):
            self._send(ident, self._status())
            return
        if isinstance(msg, wire.Hello):
            self._hello(ident, msg)
            return
        if not self.owner_key and isinstance(msg, (wire.Release, wire.Cancel)):
            return  # nothing loaded, nothing running: nothing to refuse either
        if not wire.signed_by(msg, signature, self.owner_key):
            who = "another head" if self.owner_key else "no head (send hello first)"
            raise NotOwnerError(f"{msg.TYPE!r} refused: this worker is serving {who}")
        self.owner = ident  # replies go where the owner's proof came from
        self.owner_seen = time.monotonic()
        self.owner_local = on_this_machine(peer_address(frames))
        if isinstance(msg, wire.Offer):
            keep = {self.stage.load.sha256} if self.stage is not None else set()
            self._send(ident, self.uploads.offer(msg, keep))
        elif isinstance(msg, wire.Chunk):
            self._send(ident, self.uploads.chunk(msg))
        elif isinstance(msg, wire.Load):
            self._send(ident, self._load(msg))
        elif isinstance(msg, wire.Release):
            self._release()
            self.uploads.drop()
            self.owner, self.owner_key, self.owner_name = b"", b"", ""
        elif isinstance(msg, wire.Cancel):
            if self.stage is not None:
                self.stage.proc.cancel(*msg.groups)  # reaches a running batch, not only queued ones
                self.cancelled.add(msg.groups)
        else:
            raise PotluckError(f"a worker does not accept {msg.TYPE!r} messages")

    def _hello(self, ident: bytes, msg: wire.Hello) -> None:
        """The holder of the hello's key owns this worker from now on; while a stage is
        loaded only its owner's key (on any connection: a head reconnecting) is taken, unless
        the owner has gone away. Nobody is told who the owner is."""
        key = bytes.fromhex(msg.key)
        setting_up = bool(self.owner_key) and time.monotonic() - self.owner_seen < SETUP_LEASE_S
        if (self.stage is not None or setting_up) and key != self.owner_key:
            if self._owner_present():
                raise NotOwnerError(
                    "this worker is serving another head; it joins a new head once that one "
                    "releases it or goes away"
                )
            log.info("head %s went away without releasing; a new head takes over", self.owner_name)
        self._release()
        if key != self.owner_key:
            self.uploads.drop()
        self.owner, self.owner_key, self.owner_name = ident, key, msg.head_id
        self.owner_seen = time.monotonic()
        log.info("head %s joined", msg.head_id)
        p = self.profile
        # the free figure the head plans with: heap a past slice transfer freed goes back to
        # the system first (8-15 MB after an 8b stage's transfer, docs/facts.md §17)
        inbox.give_back_freed_memory()
        welcome = wire.Welcome(
            p.node_id, self.version, p.cores, free_memory_mb(), p.speed, "idle", self.max_msg_bytes
        )
        self._send(ident, welcome)

    # -- slice cache
    def cached_path(self, sha: str) -> Path:
        return self.store.path(sha)

    # -- stage
    def _load(self, msg: wire.Load) -> wire.Loaded:
        # the address literal the name resolved to and was checked as: what is connected
        next_endpoint = "" if msg.last else check_next_stage(msg.next_addr, self.port, self.owner_local)
        path = self.cached_path(msg.sha256)
        if not self.store.has(msg.sha256):  # here and intact: its seal (one stat), else a re-hash
            raise PotluckError(f"slice {msg.sha256[:12]} is not in this worker's cache")
        self._release()
        check_load(path, msg)
        self.store.touch(msg.sha256)
        t0 = time.perf_counter()
        proc, self._spare = self._spare or StageProcess(), None
        try:
            stage = load_stage(proc, path, msg, self.n_threads)
            self.forward = None if msg.last else self._connect_next(next_endpoint, stage)
        except Exception as e:
            self._spare = StageProcess()  # nothing loaded: the next load finds one warm
            if isinstance(e, StageCrashed):
                self.crashes += 1
                raise PotluckError(f"loading layers {msg.layer_lo}-{msg.layer_hi} crashed: {e}") from None
            raise
        proc.on_crash = lambda why, p=proc: self.handback.crashed(p, why)  # from take_replies, this thread
        self.stage = stage
        self._poller.register(proc.fileno(), zmq.POLLIN)
        self.upstream_key = bytes.fromhex(msg.upstream_key)
        self.downstream_key = bytes.fromhex(msg.downstream_key)
        self.txn = 0
        self.cancelled.clear()
        load_ms = (time.perf_counter() - t0) * 1000
        info = stage.info
        log.info("loaded layers %d-%d (%s) in %.0f ms", msg.layer_lo, msg.layer_hi, msg.sha256[:12], load_ms)
        return wire.Loaded(info.n_layer, info.n_embd, info.n_vocab, info.n_ctx, load_ms)

    def _connect_next(self, address: str, stage: LoadedStage) -> zmq.Socket:
        fwd = client_socket(self.zctx, self.keys)  # no chosen routing id: it proves nothing
        fwd.setsockopt(zmq.SNDTIMEO, FORWARD_TIMEOUT_MS)
        fwd.setsockopt(zmq.IPV6, address.startswith("tcp://["))
        try:
            fwd.connect(address)
        except zmq.ZMQError as e:
            fwd.close(linger=0)
            stage.close()
            raise PotluckError(f"bad next-stage address {address!r}: {e}") from None
        return fwd

    def _release(self) -> None:
        if self.stage is not None:
            self.stage.proc.on_crash = None
            self._poller.unregister(self.stage.proc.fileno())
            self.stage.close()  # ends its process: nothing more reaches the queue
            self.stage = None
            log.info("stage released; waiting for a head")
            self._spare = self._spare or StageProcess()
        self.handback.forget_finished()
        if self.forward is not None:
            self.forward.close(linger=0)
            self.forward = None
        self.next_lost = ""
        self.upstream_key = self.downstream_key = b""
        self.upstream_ident = b""
        self.txn = 0
        self.cancelled.clear()  # job groups are numbered per head

    def _status(self) -> wire.StatusReply:
        ld = self.stage
        if ld is None:
            return wire.StatusReply("idle", "0" * 64, 0, 0, self.txn, 0, 0, 0, -1, 0.0, np.zeros(0, dtype="<i4"))
        st = ld.proc.status()
        return wire.StatusReply(
            "loaded", ld.load.sha256, ld.load.layer_lo, ld.load.layer_hi, self.txn,
            st.finished, st.aborted, st.skipped, st.running, st.busy_s * 1e3, np.array(st.positions, dtype="<i4"),
        )

    # -- data path: this thread checks order, the stage process checks and computes
    def _data(self, ident: bytes, msg: wire.Forward | wire.KvApply | wire.Reset, signature: str) -> None:
        ld = self.stage
        if ld is None:
            raise PotluckError("no stage is loaded")
        if not wire.signed_by(msg, signature, self.upstream_key):
            raise PotluckError("pipeline traffic not signed by this stage's upstream")
        self.upstream_ident = ident  # its connection: served first from now on
        if msg.txn != self.txn + 1:
            raise PotluckError(f"transaction {msg.txn} out of order (expected {self.txn + 1})")
        self.txn = msg.txn  # in order: consumed whatever happens next, so later stages see it too
        if isinstance(msg, wire.Reset):
            fut = ld.proc.submit("reset")
        elif isinstance(msg, wire.KvApply):
            fut = ld.proc.submit("kv", msg.kv_op())
        elif msg.skip or msg.group in self.cancelled:  # cancelled: skipped here, in its place
            fut = ld.proc.submit("skip", msg.group)
        else:
            fut = ld.proc.submit("job", msg.job())  # checked by the stage, in its place in the order
        fut.add_done_callback(lambda f, m=msg: self.handback.finished(ld, m, f))

    def _send_finished(self) -> None:
        if self.stage is not None:
            self.stage.proc.take_replies()  # their callbacks hand the work back, in order
        done, crashed = self.handback.take()
        for ld, msg, fut in done:
            if ld is not self.stage:
                continue  # released meanwhile
            try:
                self._pass_on(ld, msg, fut)
            except PotluckError as e:
                log.warning("%s", e)
                self._send(self.owner, wire.Error(self.node, "failed", str(e), getattr(msg, "txn", 0)))
        for proc, why in crashed:
            if self.stage is None or self.stage.proc is not proc:
                continue
            self.crashes += 1
            ld = self.stage
            log.error("layers %d-%d: %s", ld.load.layer_lo, ld.load.layer_hi, why)
            self._send(self.owner, wire.Error(self.node, "crashed", f"layers {ld.load.layer_lo}-"
                                             f"{ld.load.layer_hi}: {why}", 0))
            self._release()  # the head keeps its session: it may load again

    def _pass_on(self, ld: LoadedStage, msg: wire.WireMessage, fut: Future) -> None:
        """Send a finished transaction on: the last worker's hidden states to the head,
        everything else downstream."""
        err = fut.exception()
        if isinstance(msg, wire.Forward):
            if err is not None and not isinstance(err, GroupCancelled):
                log.warning("batch of transaction %d refused or failed: %s", msg.txn, err)
                self.rejected += 1
                self._send(self.owner, wire.Error(self.node, "failed", f"{err}", msg.txn))
            out = None if err is not None else fut.result()
            hidden = out.astype(np.float16) if out is not None and ld.load.hidden_dtype == "f16" else out
            if ld.load.last:
                rows = hidden if hidden is not None else np.zeros((0, 1), dtype=np.float32)
                self._send(self.owner, wire.Result(msg.txn, msg.group, hidden is None, rows))
                return
            if hidden is None:
                self._forward(msg.skipped() if not msg.skip else msg)
                return
            self._forward(wire.Forward.from_job(msg.txn, msg.job(), hidden))
            return
        if err is not None:  # a KV operation refused or lost: the head must know
            self.rejected += 1
            self._send(self.owner, wire.Error(self.node, "failed", f"{err}", getattr(msg, "txn", 0)))
        if self.forward is not None:
            self._forward(msg)

    def _forward(self, msg: wire.WireMessage) -> None:
        """Pass ``msg`` to the next stage, signed with the key its stage takes from us."""
        assert self.forward is not None
        if self.next_lost:  # once one is lost the next stage refuses the rest: fail them at once
            self.forward_refused += 1
            raise PotluckError(self.next_lost)
        try:
            self.forward.send_multipart(wire.to_frames(msg, self.downstream_key), copy=False)
        except zmq.Again:
            self.next_lost = (
                f"next stage {self.stage.load.next_addr if self.stage else ''} is unreachable "
                f"(it took nothing for {FORWARD_TIMEOUT_MS / 1000:g} s)"
            )
            raise PotluckError(self.next_lost) from None
