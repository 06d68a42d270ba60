"""What a worker takes from peers it cannot trust yet: a budget per peer, per second.

Every potluck socket keeps ``RCVHWM=0`` (docs/facts.md §12: a bounded receive queue lets a
peer make libzmq abort the process), so libzmq queues whatever arrives and only reading
faster than a flooder sends keeps a worker's memory bounded. A worker therefore drains its
socket at once, every pass, and keeps a bounded amount of it: its owner's requests and its
upstream's pipeline traffic always (proven by their signatures, :mod:`.wire`; served as soon
as they are read). Once a pass finds a backlog (more than :data:`UNMETERED` messages), every
other peer is metered for the rest of that second: at most :data:`PEER_MESSAGES` messages and
:data:`PEER_BYTES` bytes each, and :data:`PASS_MESSAGES` / :data:`PASS_BYTES` kept in all per
pass. A peer past its budget is dropped unread by :mod:`.skim`, a numba loop over libzmq's own
message calls: 0.15 µs a message where pyzmq takes 4.2 µs, so a drain outruns libzmq's I/O
thread, which must decrypt each message first (measured, issue 20: a ping flood from two
sockets once grew a worker from 115 MB to 2.7 GB in 40 s; four sockets for 60 s still added
1.9 GB when dropping took pyzmq calls).

A backlog is also :data:`UNMETERED_BYTES` read in one pass (a flood of 4 MB padded pings is
a few hundred messages). The owner and the upstream are metered too once a backlog forms,
more loosely and by kind (issue 39 item 6: a token holder that said hello to an idle worker
became its owner and flooded it unmetered): their pipeline traffic and cancels are served
until the stage holds all the work it may queue (``StageProcess.over_limit``), their other
requests up to :data:`TRUSTED_CONTROL` a window; past either, that connection is cut off
(:meth:`PeerBudget.cut_off`): its messages are dropped unread until the window ends, as any
peer's past its budget.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable

import numpy as np
import zmq

log = logging.getLogger(__name__)

WINDOW_S = 1.0
# Messages a pass over the socket serves before any budget applies: a socket that keeps up
# (a head's requests, a fuzzer waiting for each reply) is never metered; a backlog is, for the
# rest of the window.
UNMETERED = 1024
UNMETERED_BYTES = 16 << 20
PEER_MESSAGES = 256  # per window, from one peer that is neither owner nor upstream
PEER_BYTES = 16 << 20
TRUSTED_CONTROL = 1024  # per window, the owner's (or upstream's) requests other than pipeline traffic
# Untrusted messages served per window, all peers together: per-peer budgets alone let 1,500
# connections ask for 384,000 replies a second, far more than Python answers ...
WINDOW_MESSAGES = 2048
# ... and the time they may take, with the owner's requests other than pipeline traffic: a
# worker short of CPU (a busy machine) drops sooner instead of falling behind its socket.
WINDOW_SERVE_S = 0.25
PASS_MESSAGES = 2048  # untrusted messages kept for one pass over the socket, all peers together
PASS_BYTES = 32 << 20
# Message kinds a trusted connection sends in bulk (a replay sends the whole conversation at
# once); recognized by the start of the header as wire.to_frames writes it.
BULK_KINDS = tuple(b'{"type":"%s"' % kind for kind in (b"forward", b"kv", b"reset", b"cancel"))
SKIM_MAX = 65_536  # messages one skim drops before it hands back (stop flag, results)
MAX_IDENT = 256  # a ZeroMQ routing id is at most 255 bytes
SLOTS = 4096  # budget counters, a peer's by a hash of its routing id (a collision pools two)

class PeerBudget:
    """Per-peer message and byte budgets over a one-second window, and per-pass totals (peers
    by routing id: an attacker may open many connections; the table is cleared every window)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._spent_msgs = np.zeros(SLOTS, np.int64)
        self._spent_bytes = np.zeros(SLOTS, np.int64)
        self._window_start = clock()
        self._pass_messages = 0
        self._pass_bytes = 0
        self._pass_read = 0  # bytes read this pass, from anyone (a backlog in bytes)
        self._trusted_control = 0  # trusted requests other than bulk kinds, this window
        self._window_messages = 0  # untrusted messages served this window
        self._serve_s = 0.0  # time spent serving untrusted messages and trusted requests, this window
        self._trusted_serve_s = 0.0  # ...of which the owner's and upstream's requests
        self._cut: set[bytes] = set()  # trusted connections cut off for the rest of the window
        self._msg = np.zeros(8, np.int64)  # one zmq_msg_t (64 bytes, aligned)
        self._ident = np.zeros(MAX_IDENT, np.uint8)
        self._trusted = (np.zeros(0, np.uint8), np.zeros(0, np.uint8))
        self._trusted_ids: tuple[bytes, ...] = ()
        self.metering = False  # a backlog was found this window: untrusted peers are metered
        self.dropped = 0  # messages dropped unread (tests, logs)
        self.cut_offs = 0  # trusted connections cut off for a window
        self._dropped_logged = 0

    def new_pass(self) -> None:
        """A new pass over the socket: a new window (and no metering) once a second has gone."""
        now = self._clock()
        if now - self._window_start >= WINDOW_S:
            self._spent_msgs.fill(0)
            self._spent_bytes.fill(0)
            self._window_start = now
            self.metering = False
            self._trusted_control = 0
            self._window_messages = 0
            self._serve_s = self._trusted_serve_s = 0.0
            self._cut.clear()
        self._pass_messages = self._pass_bytes = self._pass_read = 0

    def trust(self, *idents: bytes) -> None:
        """The routing ids skim never meters (the owner's and the upstream's connections),
        but those cut off this window."""
        idents = tuple(i for i in idents if i not in self._cut)
        if idents != self._trusted_ids:
            self._trusted_ids = idents
            a, b = (np.frombuffer(i, np.uint8).copy() for i in (*idents, b"", b"")[:2])
            self._trusted = (a, b)

    def read(self, size: int) -> None:
        """``size`` bytes were read this pass: past :data:`UNMETERED_BYTES` it is a backlog."""
        self._pass_read += size
        if self._pass_read > UNMETERED_BYTES:
            self.metering = True

    def trusted_request(self, ident: bytes, frames: list) -> bool:
        """Whether to serve a trusted connection's message: always, but for requests other
        than pipeline traffic and cancels past :data:`TRUSTED_CONTROL` this window while
        metering, or past :data:`WINDOW_SERVE_S` of its own requests' time (then the connection
        is cut off, :meth:`cut_off`). The time untrusted peers took is theirs: counting it here
        let a flood on a slow machine cut the owner off window after window (a new head's
        pings went unanswered for 5 s)."""
        if not self.metering or len(frames) < 2:
            return True
        if bytes(getattr(frames[1], "buffer", frames[1])[:20]).startswith(BULK_KINDS):
            return True
        self._trusted_control += 1
        if self._trusted_control <= TRUSTED_CONTROL and self._trusted_serve_s < WINDOW_SERVE_S:
            return True
        self.cut_off(ident)
        return False

    def cut_off(self, ident: bytes) -> None:
        """Drop ``ident``'s messages unread until the window ends (a trusted connection past
        what it may send, or whose pipeline traffic the stage could no longer queue)."""
        self._cut.add(ident)
        self.cut_offs += 1
        if self.cut_offs % 100 == 1:  # the first, then every 100th
            log.warning("cut off a connection of the owner or upstream for the rest of the second: it sent more "
                        "than a head does (%d cut off so far)", self.cut_offs)
        self.metering = True
        slot = _slot_of(ident)
        self._spent_msgs[slot] = PEER_MESSAGES
        self._spent_bytes[slot] = PEER_BYTES
        self.trust(*self._trusted_ids)
        self.dropped += 1

    def skim(self, sock: zmq.Socket, between: Callable[[], None]) -> tuple[bytes, int] | None:
        """Drop what peers past their budget sent, up to the next message Python must read:
        its routing id and peer slot (the rest of it is still on ``sock``; the message is
        counted, its bytes by :meth:`spend`), or None once the socket is empty. ``between``
        runs between long stretches of drops (a worker sends its finished results)."""
        from . import skim as kernel  # numba: loaded by warm_up, or by the first backlog

        while True:
            spent = self.spent  # then only the owner and upstream are read
            status, n, slot, dropped = kernel.skim(
                sock.underlying, self._msg, self._ident, *self._trusted, self._spent_msgs,
                self._spent_bytes, 0 if spent else PEER_MESSAGES, 0 if spent else PEER_BYTES, SKIM_MAX)
            self.dropped += dropped
            if status == kernel.READ:
                return bytes(self._ident[:n]), slot
            if status == kernel.EMPTY:
                return None
            between()

    @property
    def spent(self) -> bool:
        """Whether this window's untrusted work is used up (by count or by time)."""
        return self._window_messages >= WINDOW_MESSAGES or self._serve_s >= WINDOW_SERVE_S

    def served(self, seconds: float, trusted: bool = False) -> None:
        """An untrusted message, or a trusted request that is not pipeline traffic, took
        ``seconds`` to serve (both leave less of the window to untrusted peers)."""
        self._serve_s += seconds
        if trusted:
            self._trusted_serve_s += seconds

    def spend(self, key: int, size: int) -> bool:
        """Count ``size`` bytes of a message :meth:`skim` returned; whether it was the peer's
        first this window (served at once: a new upstream proves itself with its first message)."""
        self._spent_bytes[key] += size
        self._window_messages += 1
        return bool(self._spent_msgs[key] <= 1)

    def log_drops(self) -> None:
        """One warning at the first drop and then every 100,000 (a flood must not flood the log)."""
        if self.dropped > self._dropped_logged and (
                self._dropped_logged == 0 or self.dropped - self._dropped_logged >= 100_000):
            log.warning("dropped %d messages from peers past their budget so far (a flood?)", self.dropped)
            self._dropped_logged = self.dropped

    def keep(self, size: int) -> bool:
        """Whether this pass may hold one more untrusted message of ``size`` bytes; if not it
        is dropped (counted)."""
        if self._pass_messages >= PASS_MESSAGES or self._pass_bytes >= PASS_BYTES:
            self.dropped += 1
            return False
        self._pass_messages += 1
        self._pass_bytes += size
        return True


def _slot_of(ident: bytes) -> int:
    """The budget slot of a routing id, as :mod:`.skim` hashes it (FNV-1a)."""
    h = 14695981039346656037
    for b in ident[:MAX_IDENT]:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h % SLOTS


def drop_all(sock: zmq.Socket) -> int:
    """Read and free everything waiting on ``sock``, unparsed (a socket nothing should send
    on, such as a worker's connection to its next stage); how many messages."""
    from . import skim as kernel

    msg, ident = np.zeros(8, np.int64), np.zeros(MAX_IDENT, np.uint8)
    none, spent = np.zeros(0, np.uint8), np.zeros(1, np.int64)
    total = 0
    while True:
        status, _, _, dropped = kernel.skim(sock.underlying, msg, ident, none, none, spent, spent, 0, 0, SKIM_MAX)
        total += dropped
        if status == kernel.EMPTY:
            return total


def warm_up(ctx: zmq.Context) -> None:
    """Load the drain (numba and LLVM: about 0.7 s) on a socket of its own, so a worker's
    first flood finds it ready; the worker runs it before it serves (worker.py)."""
    sock = ctx.socket(zmq.ROUTER)
    try:
        PeerBudget().skim(sock, lambda: None)
    finally:
        sock.close(linger=0)


def give_back_freed_memory() -> None:
    """Return freed heap pages to the system (glibc ``malloc_trim``): the messages libzmq
    queued during a flood are freed once drained, but the heap keeps its size otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
