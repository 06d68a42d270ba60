"""The worker side: one ROUTER socket serving a head's control requests and pipeline traffic.

Life of a worker: wait for a head (``hello``), receive or find its slice by sha256
(``offer``/``chunk``), ``load`` it as one :class:`~potluck.engine.core.stage.Stage`, then take
data-path transactions in ``txn`` order: ``forward`` (a batch: compute, pass hidden states to
the next stage, or back to the head from the last worker: the head computes the model's last
layer and the output layer itself), ``kv`` and ``reset`` (apply, pass on). ``release``
by its head, or that head going away, ends its session and the worker waits again. The stage
stays loaded a while (``--keep-stage-s``) if it was idle: a head that loads the same slice with
the same settings next (the same model again, a rebuilt chain) takes it over at once, reset, where
a cold load reads and repacks gigabytes; any other load, or the time running out, frees it.

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

import collections
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
from .child import CLOSE_WAIT_S, PENDING_FLOOR_BYTES, StageCrashed, StageProcess
from .profile import NodeProfile, free_memory_mb
from .slice_seal import Seal
from .slice_store import SliceStore, SliceUploads
from .stage_host import Handback, KeptStage, LoadedStage, check_load, held_mb, load_stage, stage_memory_mb
from .transfer import LocalModels
from .transport import (
    AUTH_FAILED_EVENTS,
    ZAP_BUSY,
    ConnectionGate,
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

FORWARD_TIMEOUT_MS = 5000  # a next stage that takes nothing this long is lost
FORWARD_SNDHWM = 32  # messages libzmq queues for the next stage; the rest wait in the worker's outbox
DEFAULT_CACHE_QUOTA_MB = 20 * 1024
PROBE_INTERVAL_S = 1.0
SETUP_LEASE_S = 30.0  # an owner with no stage yet keeps the worker this long after its last request
DRAIN_MAX = 20_000  # messages read in one pass over the socket
POLL_MS = 200  # the loop's longest wait (the stop flag is checked at least this often)
RETRY_MS = 5  # while replies to the owner wait for room: how soon to try again
OWNER_OUTBOX_BYTES = 64 << 20  # results an owner leaves unread past this are dropped, the owner cut off
REFUSAL_CHARS = 400  # a refusal sent to a peer is one line, not the 4 kB a message may hold
REFUSALS_LOGGED = 10  # refusals logged a second; the rest are counted in one line
TRIM_EVERY_S = 2.0  # freed heap goes back to the system at most this often during a flood
TRIM_AFTER_BYTES = 16 << 20  # ... once this much arrived (or was dropped) since the last time
KEEP_STAGE_S = 600.0  # how long a released, idle stage stays loaded for the next head (0: never)
KEEP_SETTLE_S = 2.0  # how long a released stage's last work may take to finish for it to be kept
MAX_CONNECTIONS = 1500  # handshakes beyond this many open TCP connections are refused (ZAP)
PEER_CONNECTIONS = 64  # ... or beyond this many from one address other than loopback


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
        keep_stage_s: float = KEEP_STAGE_S,
    ) -> None:
        self.keys = keys
        self.keep_stage_s = keep_stage_s
        self.profile = profile
        self.store = SliceStore(Path(cache_dir), cache_quota_bytes)
        self.cache_dir = self.store.folder
        self.n_threads = n_threads
        self.max_msg_bytes = max_msg_bytes
        self.version = potluck_version
        self.open_files = raise_open_files_limit()
        self.zctx = zmq.Context()
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
        # every connection holds buffers and a reply queue: a token holder's thousands of them
        # are refused at the handshake past a bound (issue 39 item 6)
        self.gate = ConnectionGate(self.port, MAX_CONNECTIONS, PEER_CONNECTIONS)
        self.auth = start_authenticator(self.zctx, keys, self.gate)
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
        # what the next stage has not taken yet (libzmq holds FORWARD_SNDHWM more), in order
        self.forward_outbox: collections.deque[list] = collections.deque()
        self.forward_outbox_bytes = 0
        self.forward_stuck_since = 0.0  # when the outbox last found the next stage full
        # replies to the owner its connection had no room for yet (results must never be lost)
        self.owner_outbox: collections.deque[tuple[bytes, list]] = collections.deque()
        self.owner_outbox_bytes = 0
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
        self._kept: KeptStage | None = None  # a released stage still loaded (never beside a spare)
        self.stages_reused = 0  # loads answered by the kept stage (tests, logs)
        # The drain (numba) loads before the worker serves anyone: in a thread beside the
        # loop it held the GIL for most of a second, and a head joining then timed this
        # link's pings at 3-13 ms instead of 0.3 (and planned around a slow link).
        inbox.warm_up(self.zctx)
        self.rejected = 0  # messages refused (tests and logs)
        self.dropped_replies = 0  # replies to peers that do not read theirs
        self.unreachable_replies = 0  # replies to peers already gone
        self.crashes = 0
        self.forward_refused = 0  # forwards failed at once after the next stage was lost
        self.forward_dropped = 0  # forwards that waited in the outbox until it was found lost
        self.overloaded = 0  # pipeline messages refused: the stage held all the work it may queue
        self.from_next_stage = 0  # messages the next stage sent back, dropped unread
        self.bytes_received = 0  # from peers other than the owner and the upstream
        self.bytes_read = 0  # from anyone
        self._free_mb = (0.0, 0)  # (when, MB): the free memory a welcome last reported
        self._trim_at = (0.0, 0)  # when freed memory was last given back, and what had arrived by then
        self._refusals_logged = (0.0, 0, 0)  # window start, lines logged in it, refusals not logged

    # -- lifetime
    @property
    def node(self) -> str:
        return f"{self.profile.node_id}@{self.bind}:{self.port}"

    def stop(self) -> None:
        self._stop = True

    def _stage_procs(self) -> list[StageProcess]:
        """Every stage process: the loaded stage's, a kept one's and the warm spare."""
        procs = (self.stage.proc if self.stage is not None else None, self._spare,
                 self._kept.stage.proc if self._kept is not None else None)
        return [p for p in procs if p is not None]

    def child_pids(self) -> list[int]:
        """The stage processes' ids."""
        return [p.proc.pid for p in self._stage_procs() if p.proc.poll() is None]

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (or an exception: a signal handler's, see the worker
        command). Nothing here waits on a peer or on the stage process: sends that find no
        room wait in outboxes, written when the poller says there is room."""
        poller = self._poller
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        log.info("worker %s waiting for a head", self.node)
        try:
            while not self._stop:
                self._register_writes()
                events = dict(poller.poll(RETRY_MS if self.owner_outbox else POLL_MS))
                if self.monitor in events:
                    self._log_handshake_failures()
                if self.forward is not None and self.forward in events:
                    self._from_next_stage(events[self.forward])
                if self.stage is not None and self.stage.proc.fileno() in events:
                    self._send_finished()
                if self.sock in events:
                    self._serve_pending()
                self._flush_outboxes()
                self._give_back_memory(quiet=not events)
                if self._kept is not None and time.monotonic() > self._kept.until:
                    self._drop_kept("its time ran out")
        finally:
            self.close()

    def _register_writes(self) -> None:
        """Poll for room where something waits for it: the stage process's pipe, the next stage."""
        if self.stage is not None:
            proc = self.stage.proc
            self._poller.register(proc.fileno(), zmq.POLLIN | (zmq.POLLOUT if proc.wants_write() else 0))
        if self.forward is not None:
            self._poller.register(self.forward, zmq.POLLIN | (zmq.POLLOUT if self.forward_outbox else 0))

    def _from_next_stage(self, flags: int) -> None:
        """The next stage answers nothing the worker waits for (its refusals of our forwards
        are for the logs): what it sends is dropped unread, so it cannot fill this process."""
        if flags & zmq.POLLIN:
            dropped = inbox.drop_all(self.forward)
            if dropped and self.from_next_stage // 1000 != (self.from_next_stage + dropped) // 1000 or (
                    dropped and not self.from_next_stage):
                log.warning("the next stage sent %d message(s) back (refusals of our forwards?); dropped unread",
                            self.from_next_stage + dropped)
            self.from_next_stage += dropped

    def _flush_outboxes(self) -> None:
        if self.stage is not None and self.stage.proc.wants_write():
            self.stage.proc.flush()
        if self.forward_outbox:
            self._flush_forward()
        while self.owner_outbox:
            ident, frames = self.owner_outbox[0]
            try:
                self.sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:  # the owner went away: what it would have read goes too
                self.owner_outbox.clear()
                self.owner_outbox_bytes = 0
                return
            self.owner_outbox.popleft()
            self.owner_outbox_bytes -= wire.frames_nbytes(frames)

    def _give_back_memory(self, quiet: bool) -> None:
        """Return the heap a flood freed (inbox.give_back_freed_memory): when the socket is
        quiet, and every TRIM_EVERY_S while floods go on, once TRIM_AFTER_BYTES came or went."""
        at, seen = self._trim_at
        now, arrived = time.monotonic(), self.bytes_read + self.budget.dropped * 64
        if arrived - seen < (1 if quiet else TRIM_AFTER_BYTES) or (not quiet and now - at < TRIM_EVERY_S):
            return
        if quiet and now - at < TRIM_EVERY_S / 4:
            return
        self._trim_at = (now, arrived)
        inbox.give_back_freed_memory()

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
            metered = budget.metering  # as this message was read (skim counted it)
            rest = self._rest()
            size = sum(map(len, rest))
            budget.read(size)
            self.bytes_read += size
            if ident and (ident == self.owner or ident == self.upstream_ident):
                if budget.trusted_request(ident, rest):
                    self._serve(ident, rest, timed=metered, trusted=True)
                budget.trust(self.owner, self.upstream_ident)  # a hello or a load may name new ones
                continue
            self.bytes_received += size
            if not metered or budget.spend(key, size):  # a new upstream proves itself with its first message
                self._serve(ident, rest, timed=True)
                budget.trust(self.owner, self.upstream_ident)
            elif budget.keep(size):
                others.append((ident, rest))
        budget.log_drops()
        for ident, rest in others:
            self._serve(ident, rest, timed=True)

    def _rest(self) -> list:
        """The frames after a routing id, zero-copy (a zmq.Frame knows its peer's address)."""
        frames = [self.sock.recv(copy=False)]
        while self.sock.getsockopt(zmq.RCVMORE):
            frames.append(self.sock.recv(copy=False))
        return frames

    def _serve(self, ident: bytes, frames: list, timed: bool = False, trusted: bool = False) -> None:
        """Serve one message; ``timed``: its time counts against the window's (inbox.WINDOW_SERVE_S),
        and against the owner's or upstream's own where ``trusted``."""
        t0 = time.perf_counter() if timed else 0.0
        self.handle(ident, frames)
        if timed:
            self.budget.served(time.perf_counter() - t0, trusted)
        self._send_finished()  # keep results flowing while a burst of requests arrives

    def _log_handshake_failures(self) -> None:
        while self.monitor.poll(0):
            try:
                event, value = read_event(self.monitor)
            except zmq.ZMQError:
                return
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value == int(ZAP_BUSY):
                continue  # refused by the connection gate, which logs its own
            if event in AUTH_FAILED_EVENTS:
                self.rejected += 1
                self._log_refusal(b"", "a connection failed the CURVE handshake (no or wrong token)")

    def close(self) -> None:
        """Stop serving, without waiting on anyone: both stage processes are told to end at
        once and given CLOSE_WAIT_S together (then killed), every socket closes unsent."""
        procs = self._stage_procs()
        if self.stage is not None:
            proc = self.stage.proc
            log.info("stopping with %d work item(s) queued for the stage process, %d byte(s) of them waiting "
                     "for room in its pipe", proc.queued_items, proc.unsent_bytes)
        for proc in procs:
            proc.on_crash = None
            proc.begin_close()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for proc in procs:
            proc.end_close(deadline)
        self._spare = self._kept = None
        self._release()
        self.uploads.drop()
        self.auth.stop()
        self.zctx.destroy(linger=0)  # every socket (monitor, forward, listener) and the context

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
        self._log_refusal(ident, why)
        why = why if len(why) <= REFUSAL_CHARS else why[: REFUSAL_CHARS - 1] + "…"
        self._send(ident, wire.Error(node=self.node, code=code, message=why, txn=txn))

    def _log_refusal(self, ident: bytes, why: str) -> None:
        """A line per refusal, but at most REFUSALS_LOGGED a second (a flood of bad messages
        must not become a flood of log lines): the rest are counted in the next line."""
        start, lines, quiet = self._refusals_logged
        now = time.monotonic()
        if now - start >= 1.0:
            start, lines = now, 0
        if lines >= REFUSALS_LOGGED:
            self._refusals_logged = (start, lines, quiet + 1)
            return
        more = f" ({quiet} more refused unlogged before this one)" if quiet else ""
        log.warning("refused a message from %r: %s%s", ident[:24], why[:REFUSAL_CHARS], more)
        self._refusals_logged = (start, lines + 1, 0)

    def _to_owner(self, msg: wire.WireMessage) -> bool:
        """Send the owner a result or a refusal of pipeline work: none is lost to a full
        connection (the head waits for each). What has no room yet waits, in order, in an
        outbox the loop writes when it can; an owner that leaves OWNER_OUTBOX_BYTES unread is
        cut off (it reads nothing: a flooder that said hello, not a head)."""
        frames = wire.to_frames(msg)
        if not self.owner_outbox:
            try:
                self.sock.send_multipart([self.owner, *frames], flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                pass
            except zmq.ZMQError:  # gone
                self.unreachable_replies += 1
                return False
        return self._owner_later(self.owner, frames)

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

    def _owner_later(self, ident: bytes, frames: list) -> bool:
        size = wire.frames_nbytes(frames)
        if self.owner_outbox_bytes + size > OWNER_OUTBOX_BYTES:
            self.dropped_replies += 1
            self.budget.cut_off(ident)
            if self.dropped_replies % 1000 == 1:
                log.warning("dropped a result for the owner, which read none of the last %d MB; its "
                            "connection is cut off for now", OWNER_OUTBOX_BYTES >> 20)
            return False
        self.owner_outbox.append((ident, frames))
        self.owner_outbox_bytes += size
        return True

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
            loaded = (self.stage, self._kept.stage if self._kept is not None else None)
            keep = {ld.load.sha256 for ld in loaded if ld is not None}
            self._send(ident, self.uploads.offer(msg, keep))
        elif isinstance(msg, wire.Chunk):
            self._send(ident, self.uploads.chunk(msg))
        elif isinstance(msg, wire.Load):
            self._send(ident, self._load(msg))
        elif isinstance(msg, wire.Release):
            self._release(keep=True)
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
        rejoined = key == self.owner_key and self.stage is None  # its hello again (a flood of them, or a retry)
        self._release(keep=True)
        if key != self.owner_key:
            self.uploads.drop()
        self.owner, self.owner_key, self.owner_name = ident, key, msg.head_id
        self.owner_seen = time.monotonic()
        if rejoined:
            log.debug("head %s said hello again", msg.head_id)
        else:
            log.info("head %s joined", msg.head_id)
        p = self.profile
        # the free figure the head plans with: heap a past slice transfer freed goes back to
        # the system first (8-15 MB after an 8b stage's transfer, docs/facts.md §17)
        if not rejoined:
            inbox.give_back_freed_memory()
        if not rejoined or time.monotonic() - self._free_mb[0] > 1.0:  # /proc and cgroup reads: not per hello
            self._free_mb = (time.monotonic(), free_memory_mb())
        # a kept stage is freed for any other load: its memory is on offer too
        free_mb = self._free_mb[1] + (int(self._kept.mb) if self._kept is not None else 0)
        welcome = wire.Welcome(p.node_id, self.version, p.cores, free_mb, p.speed, "idle", self.max_msg_bytes)
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
        self._release(keep=True)
        t0 = time.perf_counter()
        stage = self._take_kept(msg, path)
        if stage is None:
            check_load(path, msg)
        self.store.touch(msg.sha256)
        if stage is not None:
            stage.load = msg
            stage.proc.submit("renew")  # ahead of this head's work in the same pipe: nothing of the last head stays
            self.stages_reused += 1
        else:
            proc, self._spare = self._spare or StageProcess(), None
            try:
                stage = load_stage(proc, path, msg, self.n_threads)
            except Exception as e:
                self._spare = StageProcess()  # nothing loaded: the next load finds one warm
                if isinstance(e, StageCrashed):
                    self.crashes += 1
                    raise PotluckError(f"loading layers {msg.layer_lo}-{msg.layer_hi} crashed: {e}") from None
                raise
        proc = stage.proc
        try:
            self.forward = None if msg.last else self._connect_next(next_endpoint, stage)
        except Exception:
            self._spare = StageProcess()  # _connect_next closed the stage
            raise
        proc.on_crash = lambda why, p=proc: self.handback.crashed(p, why)  # from take_replies, this thread
        # work a stage may hold queued: a conversation's worth of its inputs, twice over (a
        # replay after a loss sends the whole conversation at once; rejected drafts add rows)
        proc.limit_bytes = max(PENDING_FLOOR_BYTES, 2 * msg.n_ctx * (16 + (0 if msg.first else 4 * stage.info.n_embd)))
        self.stage = stage
        self._poller.register(proc.fileno(), zmq.POLLIN)
        self.upstream_key = bytes.fromhex(msg.upstream_key)
        self.downstream_key = bytes.fromhex(msg.downstream_key)
        self.txn = 0
        self.cancelled.clear()
        load_ms = (time.perf_counter() - t0) * 1000
        info = stage.info
        log.info("loaded layers %d-%d (%s) in %.0f ms", msg.layer_lo, msg.layer_hi, msg.sha256[:12], load_ms)
        return wire.Loaded(info.n_layer, info.n_embd, info.n_vocab, info.n_ctx, load_ms,
                           info.max_rows, info.two_row_steps, info.exact_reason)

    def _take_kept(self, msg: wire.Load, path: Path) -> LoadedStage | None:
        """The kept stage if ``msg`` loads the same slice file, unchanged since it was loaded,
        with the same settings, and its process still runs; anything else kept is freed
        first, so a new load has its memory."""
        kept = self._kept
        if kept is None:
            return None
        old = kept.stage.load
        same = (old.sha256, old.first, old.n_ctx, old.n_batch, old.n_seq_max, old.kv_unified) == (
            msg.sha256, msg.first, msg.n_ctx, msg.n_batch, msg.n_seq_max, msg.kv_unified)
        try:
            unchanged = kept.stage.seal == Seal.of(path, msg.sha256)
        except OSError:
            unchanged = False
        if same and unchanged and kept.stage.proc.proc.poll() is None:
            self._kept = None
            log.info("layers %d-%d still loaded: taken over", msg.layer_lo, msg.layer_hi)
            return kept.stage
        self._drop_kept("another slice or other settings are loaded" if not same else
                        "its slice file changed" if not unchanged else "its process ended")
        return None

    def _drop_kept(self, why: str) -> None:
        if self._kept is None:
            return
        ld, self._kept = self._kept.stage, None
        ld.close()
        log.info("kept layers %d-%d freed: %s", ld.load.layer_lo, ld.load.layer_hi, why)
        self._spare = self._spare or StageProcess()

    def _connect_next(self, address: str, stage: LoadedStage) -> zmq.Socket:
        fwd = client_socket(self.zctx, self.keys)  # no chosen routing id: it proves nothing
        fwd.setsockopt(zmq.SNDHWM, FORWARD_SNDHWM)  # the rest waits in forward_outbox, bounded
        fwd.setsockopt(zmq.IPV6, address.startswith("tcp://["))
        try:
            fwd.connect(address)
        except zmq.ZMQError as e:
            fwd.close(linger=0)
            stage.close()
            raise PotluckError(f"bad next-stage address {address!r}: {e}") from None
        return fwd

    def _release(self, keep: bool = False) -> None:
        """End the session's stage. ``keep``: its head is done with it (released it, went
        away, or loads again), so an idle stage stays loaded for the next load of the same
        slice (:data:`KEEP_STAGE_S`); a stage with work queued, or after a crash, ends."""
        if self.stage is not None:
            ld, self.stage = self.stage, None
            ld.proc.on_crash = None
            self._poller.unregister(ld.proc.fileno())
            # its last replies (a reset, a trim) may still be on their way: a moment for them
            if keep and self.keep_stage_s > 0 and ld.proc.settle(KEEP_SETTLE_S) and ld.proc.proc.poll() is None:
                path = self.cached_path(ld.load.sha256)
                try:
                    mb = stage_memory_mb(path, ld.load)[0]
                except Exception:  # noqa: BLE001 - the slice went from the cache: count what the load did
                    mb = 0.0
                self._kept = KeptStage(ld, time.monotonic() + self.keep_stage_s, held_mb(ld, mb))
                log.info("stage released; layers %d-%d stay loaded for %.0f s for the next head",
                         ld.load.layer_lo, ld.load.layer_hi, self.keep_stage_s)
            else:
                ld.close()  # ends its process: nothing more reaches the queue
                log.info("stage released; waiting for a head")
                self._spare = self._spare or StageProcess()
        self.handback.forget_finished()
        if self.forward is not None:
            self._poller.unregister(self.forward)
            self.forward.close(linger=0)
            self.forward = None
        self.forward_outbox.clear()
        self.forward_outbox_bytes = 0
        self.owner_outbox.clear()
        self.owner_outbox_bytes = 0
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
        if ld.proc.over_limit(_input_bytes(msg)) or self.forward_outbox_bytes > ld.proc.limit_bytes:
            # the stage holds all the work it may queue (or the next stage takes nothing): a
            # head sends no more than a conversation's worth; this sender is cut off for now
            self.overloaded += 1
            self.budget.cut_off(ident)
            raise PotluckError(
                f"transaction {msg.txn} refused: this stage already holds {ld.proc.queued_bytes >> 20} MB of "
                f"work (at most {ld.proc.limit_bytes >> 20} MB) and the next stage "
                f"{self.forward_outbox_bytes >> 20} MB of its results"
            )
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
                self._to_owner(wire.Error(self.node, "failed", str(e), getattr(msg, "txn", 0)))
        for proc, why in crashed:
            if self.stage is None or self.stage.proc is not proc:
                continue
            self.crashes += 1
            ld = self.stage
            log.error("layers %d-%d: %s", ld.load.layer_lo, ld.load.layer_hi, why)
            self._to_owner(wire.Error(self.node, "crashed", f"layers {ld.load.layer_lo}-"
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
                self._to_owner(wire.Error(self.node, "failed", f"{err}", msg.txn))
            out = None if err is not None else fut.result()
            hidden = out.astype(np.float16) if out is not None and ld.load.hidden_dtype == "f16" else out
            if ld.load.last:
                rows = hidden if hidden is not None else np.zeros((0, 1), dtype=np.float32)
                self._to_owner(wire.Result(msg.txn, msg.group, hidden is None, rows))
                return
            if hidden is None:
                self._forward(msg.skipped() if not msg.skip else msg)
                return
            self._forward(wire.Forward.from_job(msg.txn, msg.job(), hidden))
            return
        if err is not None:  # a KV operation refused or lost: the head must know
            self.rejected += 1
            self._to_owner(wire.Error(self.node, "failed", f"{err}", getattr(msg, "txn", 0)))
        if self.forward is not None:
            self._forward(msg)

    def _forward(self, msg: wire.WireMessage) -> None:
        """Pass ``msg`` to the next stage, signed with the key its stage takes from us, without
        waiting: what libzmq has no room for waits in the outbox, in order."""
        assert self.forward is not None
        if self.next_lost:  # once one is lost the next stage refuses the rest: fail them at once
            self.forward_refused += 1
            raise PotluckError(self.next_lost)
        frames = wire.to_frames(msg, self.downstream_key)
        if not self.forward_outbox:
            self.forward_stuck_since = time.monotonic()
        self.forward_outbox.append(frames)
        self.forward_outbox_bytes += wire.frames_nbytes(frames)
        self._flush_forward()

    def _flush_forward(self) -> None:
        """Send what the next stage has room for; one that took nothing for FORWARD_TIMEOUT_MS
        is lost (what waits is dropped: the order downstream is broken, the head re-plans)."""
        assert self.forward is not None
        while self.forward_outbox:
            try:
                self.forward.send_multipart(self.forward_outbox[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if time.monotonic() - self.forward_stuck_since < FORWARD_TIMEOUT_MS / 1000:
                    return
                self.next_lost = (
                    f"next stage {self.stage.load.next_addr if self.stage else ''} is unreachable "
                    f"(it took nothing for {FORWARD_TIMEOUT_MS / 1000:g} s)"
                )
                log.warning("%s", self.next_lost)
                self.forward_dropped += len(self.forward_outbox)
                self.forward_outbox.clear()
                self.forward_outbox_bytes = 0
                self._to_owner(wire.Error(self.node, "failed", self.next_lost, self.txn))
                return
            self.forward_outbox_bytes -= wire.frames_nbytes(self.forward_outbox.popleft())
            self.forward_stuck_since = time.monotonic()


def _input_bytes(msg: wire.WireMessage) -> int:
    """About what a pipeline message queues in the stage process (its arrays)."""
    if isinstance(msg, wire.Forward):
        return 64 + sum(a.nbytes for a in (msg.inputs, msg.positions, msg.seq_ids, msg.outputs))
    return 64
