"""The head's connection to one worker: :class:`NodeLink` (a CURVE DEALER and its monitor),
and the errors that name a node.

A link knows when its worker is lost: the monitor reports a closed socket (the worker died),
missed heartbeats (it froze, 2.5 s) or a refused handshake (another token). Requests wait
only for their own kind of reply; anything else that arrives meanwhile is late and dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import numpy as np
import zmq

from ..core.errors import PotluckError
from ..core.printable import printable
from ..core.spec import JOIN_TIMEOUT_S, CurveKeys
from . import wire
from .plan import NodeInfo
from .transport import AUTH_FAILED_EVENTS, client_socket, endpoint, read_event

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0
SEND_TIMEOUT_MS = 3000
# A survivor may be blocked up to the worker's forward timeout (5 s) per batch it still tries
# to pass to the lost node before it reads our hello.
REJOIN_TIMEOUT_S = 15.0
# a hello unanswered this long is sent again: longer than a worker's budget window (inbox.WINDOW_S)
HELLO_AGAIN_S = 1.5
# The link's figures at join (NodeLink.measure): the fastest of a few bare pings spread over
# a fifth of a second (a worker that has just started is busy for a moment: loopback pings
# then took 13 ms, and a plan gave its last stage 6 layers of 29), and the best of a few
# padded pings for the bandwidth. 256 KiB takes 2 ms at 1 Gbit/s, 21 ms at 100 Mbit/s: long
# beside the round trip, short beside a join. Faster than MAX_MBPS reads as MAX_MBPS.
LINK_PINGS = 8
PING_GAP_S = 0.025
PAD_PINGS = 3
PAD_BYTES = 256 << 10
MAX_MBPS = 100_000.0


class NodeFailedError(PotluckError):
    """A worker died, froze, went away or refused work; the message names it."""


class NodeLostError(NodeFailedError):
    """A worker stopped answering (died, froze, unreachable): the head may re-plan without it."""

    def __init__(self, message: str, address: str = "") -> None:
        super().__init__(message)
        self.address = address


class SameNodeError(NodeFailedError):
    """The worker at this address is one another of our links joined already (``node_id``)."""

    def __init__(self, message: str, node_id: str) -> None:
        super().__init__(message)
        self.node_id = node_id


class NodeBusyError(NodeFailedError):
    """The worker serves another head (it refused our hello with code ``busy``): the node
    ``node_id``, which may be ours through another address."""

    def __init__(self, message: str, node_id: str = "") -> None:
        super().__init__(message)
        self.node_id = node_id


def max_result_bytes(n_batch: int, n_embd: int) -> int:
    """The largest message a worker may send this head: f32 hidden states of every row of
    the largest batch at the head's own width, plus headers (ZMQ_MAXMSGSIZE)."""
    return n_batch * n_embd * 4 + wire.MAX_HEADER_BYTES + (48 << 10) if n_embd > 0 else -1


NODE_ID_CHARS = 64  # a worker's node id as the head shows it (its advertised id is a hostname's length)
REFUSAL_CHARS = 400  # a worker's refusal as the head shows it (a line, not the worker's 4 kB)


def shown(msg: wire.WireMessage) -> wire.WireMessage:
    """``msg`` with the text a worker wrote for people (node id, version, state, refusals, why
    its batches stay exact) made
    printable: a worker is another party, and its text reaches the head's terminal, log and
    chat app (an ``ESC ]52;`` in a refusal would write the user's clipboard)."""
    if isinstance(msg, wire.Error):
        return dataclasses.replace(msg, node=printable(msg.node, limit=NODE_ID_CHARS * 2), code=printable(
            msg.code, limit=32), message=printable(msg.message, limit=REFUSAL_CHARS))
    if isinstance(msg, wire.Welcome):
        return dataclasses.replace(msg, node_id=printable(msg.node_id, limit=NODE_ID_CHARS),
                                   potluck_version=printable(msg.potluck_version, limit=40),
                                   state=printable(msg.state, limit=32))
    if isinstance(msg, wire.Loaded):  # its reason reaches a refusal of speculation, a line on the terminal
        return dataclasses.replace(msg, exact_reason=printable(msg.exact_reason, limit=REFUSAL_CHARS))
    return msg


class NodeLink:
    """One CURVE DEALER connection from the head to one worker, with its monitor.

    The connection has no chosen routing id (the worker names it). The worker knows this head
    by ``key``, a secret sent in our hello over this encrypted connection only: every later
    request is signed with it, and pipeline traffic to a first stage with ``data_key`` (set
    when the chain loads). A token holder who claims any routing id proves nothing.
    """

    def __init__(self, zctx: zmq.Context, keys: CurveKeys, address: str, max_msg_bytes: int = -1) -> None:
        self.address = address
        self.key = os.urandom(32)
        self.data_key = b""  # signs forward/kv/reset to this worker while it is the first stage
        # The head's own worker: where another stage reaches it (the head uses loopback).
        self.seen_from: Callable[[str], str] | None = None
        self.node_id = ""
        self.layers: tuple[int, int] | None = None
        self.welcome: wire.Welcome | None = None
        # None: no TCP connection yet (a dead address, a refused port never has one); True: connected;
        # False: the connection was dropped before CURVE completed (a host that is no worker of this cluster)
        self.reachable: bool | None = None
        self.handshaken = False
        self.auth_failed = False
        self.hellos_repeated = 0  # hellos sent again, unanswered (a worker under a flood)
        self.sock = client_socket(zctx, keys)
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)  # a bigger one drops the connection
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        self.sock.connect(endpoint(address))
        self.bytes_out = 0
        self.bytes_in = 0
        self.rtt_ms = 0.0  # measured at join (0: not measured)
        self.mbps = 0.0

    def _hello(self, head_id: str, version: str) -> wire.Hello:
        return wire.Hello(head_id, version, self.key.hex())

    def _frames(self, msg: wire.WireMessage) -> list:
        """``msg`` signed with the key its worker checks: pipeline traffic with the first
        stage's upstream key, everything else with our hello's key."""
        data = isinstance(msg, (wire.Forward, wire.KvApply, wire.Reset))
        return wire.to_frames(msg, self.data_key if data else self.key)

    def describe(self) -> str:
        who = f"node {self.node_id} at {self.address}" if self.node_id else f"node at {self.address}"
        return f"{who} (layers {self.layers[0]}-{self.layers[1]})" if self.layers else who

    def drain_events(self) -> str | None:
        """Apply pending monitor events; the reason this link is lost, if it is."""
        lost = None
        while True:
            try:
                event, _ = read_event(self.monitor) if self.monitor.poll(0) else (None, 0)
            except zmq.ZMQError:
                return lost
            if event is None:
                return lost
            if event == zmq.EVENT_CONNECTED and self.reachable is None:
                self.reachable = True
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and self.reachable and not self.handshaken:
                self.reachable = False
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshaken = True
            elif event in AUTH_FAILED_EVENTS:
                self.auth_failed = True
            elif self.handshaken and event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                lost = "disconnected (the worker stopped, crashed or froze)"

    def lost(self, why: str) -> NodeLostError:
        return NodeLostError(f"{self.describe()} {why}", self.address)

    def send(self, msg: wire.WireMessage) -> None:
        frames = self._frames(msg)
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
            frames = self._frames(msg)
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        self.bytes_out += wire.frames_nbytes(frames)
        return True

    def read(self) -> wire.WireMessage:
        """The next message, refusals (``wire.Error``) included; a malformed one names the node.
        What a worker writes for people to read (its node id, version, refusals) comes back
        printable (:func:`shown`)."""
        frames = self.sock.recv_multipart(copy=False)
        self.bytes_in += sum(len(f.buffer) for f in frames)
        try:
            return shown(wire.parse_frames(frames))
        except wire.WireError as e:
            raise NodeFailedError(f"{self.describe()} sent a malformed message: {printable(e, limit=200)}") from None

    def recv(self) -> wire.WireMessage:
        """The next reply to a request; a refusal becomes :class:`NodeFailedError`."""
        msg = self.read()
        if isinstance(msg, wire.Error):
            if msg.code == "busy":
                raise NodeBusyError(f"{self.describe()} refused: {msg.message}", msg.node.partition("@")[0])
            raise NodeFailedError(f"{self.describe()} refused: {msg.message}")
        return msg

    def request(self, msg: wire.WireMessage, timeout_s: float = REQUEST_TIMEOUT_S) -> wire.WireMessage:
        """Send ``msg`` and wait for this worker's reply, watching the connection meanwhile.
        Messages that are not that reply are late and dropped: a probe, a result of a chain
        being rebuilt, the welcome of a hello that timed out (a worker that was frozen)."""
        self.send(msg)
        return self.reply(wire.REPLY_TO[type(msg)], timeout_s)

    def reply(self, want: type[wire.WireMessage], timeout_s: float = REQUEST_TIMEOUT_S) -> wire.WireMessage:
        """Wait for this worker's reply of type ``want`` to a request already sent (several
        workers then work at once: the chain's loads); what else comes is dropped, as in
        :meth:`request`."""
        reply = self._await_reply(want, timeout_s)
        if reply is None:
            raise NodeLostError(self._silence_reason(timeout_s), self.address)
        return reply

    def _await_reply(self, want: type[wire.WireMessage], timeout_s: float) -> wire.WireMessage | None:
        """:meth:`reply`, but None when nothing came in time (a lost connection still raises)."""
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
        return None

    def _silence_reason(self, timeout_s: float) -> str:
        self.drain_events()
        if self.handshaken and not self.auth_failed:
            return f"{self.describe()} did not answer within {timeout_s:g} s"
        if self.auth_failed:  # an answer, not a silence: no deadline in the message (libzmq shows a
            # client no reason: a worker past its connection bound refuses the same way)
            return (f"{self.describe()} refused our CURVE handshake: started with a different cluster token, "
                    "or it takes no more connections now (too many are open to it: a flood?)")
        if self.reachable is None:
            why = "nothing took the connection there: not running, or a wrong address"
        elif self.reachable is False:
            why = "it dropped the connection before CURVE completed: not a potluck worker, or another cluster token"
        else:  # connected, and CURVE still under way
            why = ("it took the connection but CURVE did not complete: a busy or frozen machine "
                   "(give it longer: --join-timeout), not a potluck worker, or another cluster token")
        return f"{self.describe()} did not accept us within {timeout_s:.3g} s: {why}"

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

    def join(
        self, head_id: str, version: str, timeout_s: float = JOIN_TIMEOUT_S,
        ours: Callable[[str], bool] = lambda node_id: False,
    ) -> wire.Welcome:
        """Say hello until welcomed. A busy worker is asked again until the deadline (one whose
        last head just vanished is busy until it notices, < 3 s), unless ``ours(node_id)``:
        another of our links holds it (one worker at two addresses). Asking again would take it
        from that link once the worker's setup lease lapses. A hello not answered within
        :data:`HELLO_AGAIN_S` is sent again: a worker under a flood drops a stranger's message
        unread once the second's budget is spent (inbox.py), and a repeated hello is welcomed
        again (worker.py: nothing is loaded yet)."""
        deadline = time.monotonic() + timeout_s
        if not self.await_handshake(deadline):
            raise NodeLostError(self._silence_reason(timeout_s), self.address)
        while True:
            try:
                self.send(self._hello(head_id, version))
                left = deadline - time.monotonic()
                reply = self._await_reply(wire.Welcome, max(0.5, min(HELLO_AGAIN_S, left)))
                if reply is not None:
                    break
                if time.monotonic() >= deadline:
                    raise NodeLostError(self._silence_reason(timeout_s), self.address)
                self.hellos_repeated += 1
            except NodeBusyError as e:
                if e.node_id and ours(e.node_id):
                    raise SameNodeError(f"another address of node {e.node_id}", e.node_id) from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
        return self._welcomed(reply)

    def rejoin(self, head_id: str, version: str) -> None:
        """Ask a worker of a broken chain to drop its stage and welcome us again (recovery): a
        hello from the head that owns the stage releases it. Sent without waiting:
        :meth:`await_welcome` then skips what the old chain still sends."""
        self.send(self._hello(head_id, version))

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
        return NodeInfo(self.node_id, self.address, self.welcome.free_mb, self.welcome.speed, self.rtt_ms, self.mbps)

    def measure(self, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Time this link once joined: the round trip of bare pings (the fastest: queueing
        only ever adds), then the bandwidth from padded ones (``PAD_BYTES`` out, a bare pong
        back: the best of a few, less the round trip). The planner counts each hop's time
        from these figures."""
        assert self.welcome is not None
        trips = []
        for i in range(LINK_PINGS):
            if i:
                time.sleep(PING_GAP_S)
            trips.append(self._ping(i, None, timeout_s))
        rtt = min(trips)
        size = max(1, min(PAD_BYTES, self.welcome.max_message - (64 << 10), wire.MAX_PING_PAD))
        pad = np.zeros(size, np.uint8)
        padded = min(self._ping(LINK_PINGS + i, pad, timeout_s) for i in range(PAD_PINGS))
        self.rtt_ms = rtt * 1e3
        self.mbps = size * 8 / max(padded - rtt, size * 8 / (MAX_MBPS * 1e6)) / 1e6
        log.info("%s: round trip %.2f ms, %.0f Mbit/s", self.describe(), self.rtt_ms, self.mbps)

    def _ping(self, nonce: int, pad: np.ndarray | None, timeout_s: float) -> float:
        """Seconds until the pong of this nonce (a worker's probe of its owner is skipped)."""
        t0 = time.perf_counter()
        self.send(wire.Ping(nonce) if pad is None else wire.Ping(nonce, pad))
        deadline = time.monotonic() + timeout_s
        while True:
            pong = self.reply(wire.Pong, max(0.0, deadline - time.monotonic()))
            if isinstance(pong, wire.Pong) and pong.nonce == nonce:
                return time.perf_counter() - t0

    def close(self, release: bool) -> None:
        if release and self.handshaken:
            try:
                self.sock.send_multipart(self._frames(wire.Release()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.monitor.close(linger=0)
        self.sock.close(linger=100 if release else 0)

