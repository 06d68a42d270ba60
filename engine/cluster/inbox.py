"""What a worker takes from peers it cannot trust yet: a budget per peer, per second.

Every potluck socket keeps ``RCVHWM=0`` (docs/facts.md §12: a bounded receive queue plus missed
heartbeats makes libzmq abort the process), so libzmq queues whatever arrives. A worker
therefore drains its socket at once, every pass, and keeps a bounded amount of it: its
owner's requests and its upstream's pipeline traffic always (proven by their signatures,
:mod:`.wire`; served as soon as they are read), and once a pass finds a backlog (more than
:data:`UNMETERED` messages), from anyone else at most :data:`PEER_MESSAGES` messages and
:data:`PEER_BYTES` bytes a second each, and :data:`PASS_MESSAGES` / :data:`PASS_BYTES` in all
per pass. The rest is dropped unread and counted. Measured (issue 20): a ping flood from two
sockets once grew a worker from 115 MB to 2.7 GB in 40 s.
"""

from __future__ import annotations

import ctypes
import time

WINDOW_S = 1.0
# Messages a pass over the socket serves before any budget applies: a socket that keeps up
# (a head's requests, a fuzzer waiting for each reply) is never metered; a backlog is.
UNMETERED = 1024
PEER_MESSAGES = 256  # per window, from one peer that is neither owner nor upstream
PEER_BYTES = 16 << 20
PASS_MESSAGES = 4096  # untrusted messages kept for one pass over the socket, all peers together
PASS_BYTES = 64 << 20


class PeerBudget:
    """Per-peer message and byte budgets over a one-second window, and per-pass totals (peers
    by routing id: an attacker may open many connections; the table is cleared every window)."""

    def __init__(self) -> None:
        self._spent: dict[bytes, list[int]] = {}  # peer -> [messages, bytes] this window
        self._window_start = time.monotonic()
        self._pass_messages = 0
        self._pass_bytes = 0
        self.dropped = 0  # messages dropped unread (tests, logs)

    def new_pass(self) -> None:
        """A new pass over the socket: a new window once a second has gone."""
        now = time.monotonic()
        if now - self._window_start >= WINDOW_S:
            self._spent.clear()
            self._window_start = now
        self._pass_messages = self._pass_bytes = 0

    def over(self, peer: bytes) -> bool:
        """Whether ``peer`` spent its budget this window (its messages are dropped unread)."""
        spent = self._spent.get(peer)
        return spent is not None and (spent[0] >= PEER_MESSAGES or spent[1] >= PEER_BYTES)

    def first_in_window(self, peer: bytes) -> bool:
        """Whether ``peer`` has sent nothing yet this window (its first message is served at
        once: a new upstream proves itself with it)."""
        return peer not in self._spent

    def admit(self, peer: bytes, size: int) -> None:
        """Count a message of ``size`` bytes from ``peer``, under its budget (checked by
        :meth:`over` first: a peer under budget gets its next message through, any size)."""
        spent = self._spent.setdefault(peer, [0, 0])
        spent[0] += 1
        spent[1] += size

    def keep(self, size: int) -> bool:
        """Whether this pass may hold one more untrusted message of ``size`` bytes; if not it
        is dropped (counted)."""
        if self._pass_messages >= PASS_MESSAGES or self._pass_bytes >= PASS_BYTES:
            self.dropped += 1
            return False
        self._pass_messages += 1
        self._pass_bytes += size
        return True


def give_back_freed_memory() -> None:
    """Return freed heap pages to the system (glibc ``malloc_trim``): the messages libzmq
    queued during a flood are freed once drained, but the heap keeps its size otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
