"""Open connections, bounded before any key is checked (slowloris).

A client that opens connections and trickles header lines never reaches the guard: at a file
limit of 1,024, 1,100 such connections kept every other request from an answer, and asyncio
logged "accept() out of system resource" thousands of times a second. So, below the HTTP
parser (uvicorn's h11 protocol, subclassed only to be told when a connection opens, when its
request head is complete and when its response is done):
- a connection must send a whole request head within ``header_timeout_s`` of opening, or of
  its previous response on a keep-alive connection, or it is closed;
- open connections stay below the process's file limit (raised to its hard limit at start):
  past ``max_open``, or past ``per_address`` from one address, a new connection closes the
  oldest one still waiting for its head (from that address first), so a trickling crowd
  cannot hold the door against a client that sends its request at once;
- the accept loop's resource errors are logged once a minute, one line each, no traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time
from collections import Counter, OrderedDict
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("potluck.serve")

RESERVED_FDS = 64  # files beside connections: the model, logs, sockets to workers, the tokenizer
_ACCEPT_ERROR = "socket.accept() out of system resource"


def raise_file_limit() -> int:
    """Raise the soft limit on open files to the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 16


def connection_budget(wanted: int) -> int:
    """``wanted`` connections, or fewer: what the file limit leaves after the files open now."""
    room = raise_file_limit() - open_files() - RESERVED_FDS
    if room < wanted:
        log.warning("at most %d connections at once (the open-file limit); raise it with ulimit -n", max(room, 8))
    return max(8, min(wanted, room))


class ConnectionGate:
    """Counts open connections and closes the ones that wait too long for their request head."""

    def __init__(self, max_open: int, per_address: int, header_timeout_s: float) -> None:
        self.max_open = max_open
        self.per_address = per_address
        self.header_timeout_s = header_timeout_s
        self.open: set[GatedProtocol] = set()
        self.by_address: Counter[str] = Counter()
        self.waiting: OrderedDict[GatedProtocol, asyncio.TimerHandle] = OrderedDict()  # oldest first
        self.counters = dict.fromkeys(("opened", "evicted", "refused", "timed_out"), 0)
        self._last_accept_log = 0.0

    def opened(self, conn: GatedProtocol) -> None:
        self.counters["opened"] += 1
        address = conn.address
        if self.by_address[address] >= self.per_address and not self._evict(address):
            self._refuse(conn)
            return
        if len(self.open) >= self.max_open and not self._evict(None):
            self._refuse(conn)
            return
        self.open.add(conn)
        self.by_address[address] += 1
        self.wait_for_head(conn)

    def wait_for_head(self, conn: GatedProtocol) -> None:
        self.head_received(conn)
        if conn in self.open:
            self.waiting[conn] = conn.loop.call_later(self.header_timeout_s, self._time_out, conn)

    def head_received(self, conn: GatedProtocol) -> None:
        timer = self.waiting.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def closed(self, conn: GatedProtocol) -> None:
        self.head_received(conn)
        if conn in self.open:
            self.open.discard(conn)
            self.by_address[conn.address] -= 1
            if self.by_address[conn.address] <= 0:
                del self.by_address[conn.address]

    def accept_error_handler(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The event loop's exception handler: accept() errors once a minute, one line each."""
        if context.get("message") == _ACCEPT_ERROR:
            now = time.monotonic()
            if now - self._last_accept_log >= 60:
                self._last_accept_log = now
                log.warning("accepting connections failed (%s); %d open", context.get("exception"), len(self.open))
            return
        loop.default_exception_handler(context)

    def _evict(self, address: str | None) -> bool:
        """Close the oldest connection still waiting for its head (from ``address`` if given)."""
        victim = next((c for c in self.waiting if address is None or c.address == address), None)
        if victim is None:
            return False
        self.counters["evicted"] += 1
        self._close(victim)
        return True

    def _time_out(self, conn: GatedProtocol) -> None:
        if conn in self.waiting:
            self.counters["timed_out"] += 1
            self._close(conn)

    def _refuse(self, conn: GatedProtocol) -> None:
        self.counters["refused"] += 1
        conn.transport.close()

    def _close(self, conn: GatedProtocol) -> None:
        self.closed(conn)
        conn.transport.close()


class GatedProtocol(H11Protocol):
    """uvicorn's h11 protocol, reporting to a :class:`ConnectionGate` (set on the subclass)."""

    gate: ConnectionGate

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.address = self.client[0] if self.client else ""
        self.gate.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.closed(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self.gate.head_received(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.gate.wait_for_head(self)


def gated_protocol(gate: ConnectionGate) -> type[GatedProtocol]:
    return type("GatedProtocol", (GatedProtocol,), {"gate": gate})


def listening_socket(family: socket.AddressFamily) -> socket.socket:
    """A TCP socket for the server. Made with IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY
    only on accepted sockets whose ``proto`` says TCP, and a socket made with proto 0 passes 0
    on to every connection it accepts, so each small response waited for the client's delayed
    ACK (about 44 ms per keep-alive request instead of 4)."""
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
