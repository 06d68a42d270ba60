"""ZeroMQ sockets as the cluster uses them: CURVE keys bound to the token, heartbeats, limits.

Every connection is CURVE-encrypted and authenticated. Both key pairs derive from the
cluster token (:func:`potluck.discovery.auth.keys_from_token`), so only a holder of the
token knows the server's public key (needed to connect at all) and the client secret key
(checked by the worker's ZAP handler). ZeroMQ heartbeats run in libzmq's I/O thread, so a
peer busy computing still answers them and only a dead or frozen process misses them.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import math
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence

import zmq
import zmq.auth.thread
from zmq.utils.monitor import parse_monitor_message

from ..core.errors import PotluckError
from ..core.spec import CurveKeys

log = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 500
HEARTBEAT_TIMEOUT_MS = 2500  # a frozen peer is declared gone after this
HANDSHAKE_IVL_MS = 2000  # a connection that has not finished CURVE by then is dropped
# Replies libzmq queues per peer; past that a peer's replies are dropped (the owner's wait in
# the worker's own bounded outbox instead). A peer that reads none holds at most this many
# (libzmq's default, 1,000 unread replies of about 1 kB, cost 0.3 MB a connection: issue 39 item 6).
SERVER_SNDHWM = 16
KEEPALIVE_IDLE_S = 2  # a worker's TCP keepalive: a vanished head is found within about 5 s
MAX_OPEN_FILES = 65536  # soft file limit a worker asks for (each connection holds one)
ZAP_DOMAIN = "potluck"


def _common(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    # Never stop reading a connection: libzmq 4.3 aborts the process when a heartbeat times
    # out on a connection whose input it stopped at the receive high-water mark (libzmq
    # issues #3937, #4767; docs/facts.md §12), which a token holder can cause by sending
    # faster than we parse.
    # Messages are bounded by MAXMSGSIZE and read as fast as they come.
    sock.setsockopt(zmq.RCVHWM, 0)


def server_socket(ctx: zmq.Context, keys: CurveKeys, *, max_msg_bytes: int) -> zmq.Socket:
    """A ROUTER that only completes the CURVE handshake with token holders.

    Its sends never wait: a peer that stops reading fills its own bounded queue
    (``SERVER_SNDHWM``) and further replies to it are dropped (``zmq.Again``), so one slow
    reader cannot stall the worker for everyone. Connections that do not finish the
    handshake within ``HANDSHAKE_IVL_MS`` are closed, so idle TCP connections cannot pile up.
    """
    sock = ctx.socket(zmq.ROUTER)
    _common(sock)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer that is gone fails at once
    # A connection claiming a routing id already taken would never be read: libzmq keeps it
    # aside, and what it sends piles up unread (issue 39 item 6: +340 MB in 20 s). With
    # handover the newer connection takes the id and the older is closed; potluck's own
    # sockets never choose one, and nothing trusts one (wire.py).
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # ... which closes the older connection's pipe first: its engine then stops reading, and
    # a heartbeat this side sends after the peer hangs up aborts the process (libzmq 4.3.5,
    # stream_engine_base.cpp:310, reproduced under a flood; docs/facts.md §12). So a worker
    # sends no heartbeats of its own: heads send theirs (a frozen worker is still found within
    # 2.5 s) and a worker answers them. A head that vanished without closing its connection
    # (power cut, cable) is found by TCP keepalive instead.
    sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    sock.setsockopt(zmq.SNDHWM, SERVER_SNDHWM)
    sock.setsockopt(zmq.SNDTIMEO, 0)
    sock.curve_server = True
    sock.curve_publickey = keys.server_public
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = ZAP_DOMAIN.encode()
    return sock


def client_socket(ctx: zmq.Context, keys: CurveKeys, routing_id: bytes = b"") -> zmq.Socket:
    """A DEALER speaking CURVE to a worker's ROUTER. Without ``routing_id`` the worker names
    the connection itself; potluck's own sockets never choose one, and nothing trusts one
    (any token holder may claim any id, and the first connection with an id keeps it)."""
    sock = ctx.socket(zmq.DEALER)
    _common(sock)
    if routing_id:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on completed connections
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
    return sock


class _TokenCredentials:
    """ZAP credentials check: the client's public key must be the token's client key."""

    def __init__(self, keys: CurveKeys, on_reject: Callable[[str], None]) -> None:
        self._allowed = keys.client_public
        self._on_reject = on_reject

    def callback(self, domain: str, key: bytes) -> bool:  # key: Z85, as pyzmq passes it
        ok = key == self._allowed
        if not ok:
            self._on_reject(f"refused a CURVE client with a key not derived from the cluster token ({domain})")
        return ok


class ConnectionGate:
    """How many connections a worker takes: every connection holds libzmq's buffers (about
    40 kB once CURVE is up) and a queue of unread replies, so a token holder opening thousands
    would grow the worker without bound (issue 39 item 6). Handshakes are refused past
    ``total`` open TCP connections to ``port``, or ``per_peer`` from one address other than
    loopback (where the tests, and a head beside its own workers, connect from). Counted from
    the kernel's table (``/proc/net/tcp*``), so nothing drifts; elsewhere than Linux, never refused.

    The table lists every TCP socket of the machine: with 6,000 it took 60 ms to read, and it
    was read at every handshake, anyone's (the gate runs before the key is checked), so a flood
    of connections made each next handshake dearer. It is read again after ``rescan_s`` (or ten
    times what the last reading took, so reading stays under a tenth of a core); between two
    readings each admitted handshake counts itself."""

    def __init__(self, port: int, total: int, per_peer: int, *, rescan_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.port, self.total, self.per_peer = port, total, per_peer
        self.refused = 0
        self.scans = 0  # readings of the kernel's table (tests)
        self._rescan_s, self._clock = rescan_s, clock
        self._counts: dict[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None = None
        self._open = 0  # the sum of _counts, kept with it (peers may be thousands of addresses)
        self._due = -math.inf  # when the table is read again

    def _current(self) -> dict[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
        now = self._clock()
        if now >= self._due:
            t0 = time.perf_counter()
            self._counts = established_by_peer(self.port)
            self._open = sum(self._counts.values()) if self._counts is not None else 0
            self._due = now + max(self._rescan_s, 10 * (time.perf_counter() - t0))
            self.scans += 1
        return self._counts

    def admit(self, address: str) -> str:
        """Why a handshake from ``address`` is refused ("" to admit it)."""
        counts = self._current()
        if counts is None:
            return ""
        try:
            peer: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(address)
        except ValueError:
            peer = None
        peer = _unmapped(peer) if peer is not None else None  # as the table counts it
        if self._open > self.total:
            why = f"{self._open} connections open (at most {self.total})"
        elif peer is None or peer.is_loopback or counts.get(peer, 0) <= self.per_peer:
            self._open += 1  # until the next reading of the table
            if peer is not None:
                counts[peer] = counts.get(peer, 0) + 1
            return ""
        else:
            why = f"{counts[peer]} connections from {address} (at most {self.per_peer} from one address)"
        self.refused += 1
        if self.refused % 1000 == 1:
            log.warning("refused a handshake: %s (%d refused so far)", why, self.refused)
        return why


def established_by_peer(port: int) -> dict[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """Established TCP connections to local ``port``, by peer address (IPv4-mapped peers as
    IPv4), from the kernel's tables; None where they cannot be read."""
    counts: dict[ipaddress.IPv4Address | ipaddress.IPv6Address, int] = {}
    found = False
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path, encoding="ascii") as f:
                next(f, None)
                found = True
                for line in f:
                    fields = line.split()
                    if len(fields) < 4 or fields[3] != "01":  # ESTABLISHED
                        continue
                    local, remote = fields[1], fields[2]
                    if int(local.rsplit(":", 1)[1], 16) != port:
                        continue
                    peer = _proc_ip(remote.rsplit(":", 1)[0])
                    counts[peer] = counts.get(peer, 0) + 1
        except (OSError, ValueError):
            continue
    return counts if found else None


def _proc_ip(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp writes it (32-bit words in host byte order)."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    return _unmapped(ipaddress.ip_address(words))


def _unmapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4-mapped IPv6 address as the IPv4 one (a dual-stack socket's IPv4 peers)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class _GatedAuthenticator(zmq.auth.thread.ThreadAuthenticator):
    """pyzmq's ZAP handler, with a :class:`ConnectionGate` asked first: a refused handshake
    gets status 300 (temporary, RFC 27), which a head tells apart from a wrong token."""

    def __init__(self, ctx: zmq.Context, gate: ConnectionGate | None) -> None:
        super().__init__(ctx, log=logging.getLogger("potluck.zap"))
        self.gate = gate

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if self.gate is not None and len(msg) >= 6:
            why = self.gate.admit(msg[3].decode("ascii", "replace"))
            if why:
                self._send_zap_reply(msg[1], ZAP_BUSY, why.encode()[:200])
                return
        await super().handle_zap_message(msg)


ZAP_BUSY = b"300"  # RFC 27: a temporary refusal (the worker takes no more connections now)


def start_authenticator(
    ctx: zmq.Context, keys: CurveKeys, gate: ConnectionGate | None = None
) -> zmq.auth.thread.ThreadAuthenticator:
    """Run the ZAP handler that gates every CURVE server socket of ``ctx``: the token's key,
    and ``gate``'s bound on connections."""
    auth = _GatedAuthenticator(ctx, gate)
    auth.start()
    auth.configure_curve_callback(
        domain=ZAP_DOMAIN, credentials_provider=_TokenCredentials(keys, lambda m: log.warning("%s", m))
    )
    return auth


AUTH_FAILED_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
}


def read_event(monitor: zmq.Socket) -> tuple[int, int]:
    """(event id, value) of one pending monitor message; the value of a refused handshake
    (``EVENT_HANDSHAKE_FAILED_AUTH``) is the ZAP status: 300 for :data:`ZAP_BUSY`."""
    msg = parse_monitor_message(monitor.recv_multipart())
    return int(msg["event"]), int(msg.get("value", 0))


def raise_open_files_limit(want: int = MAX_OPEN_FILES) -> int:
    """Raise this process's soft limit on open files toward ``want`` (capped by the hard
    limit): with the default 1024 a flood of idle TCP connections exhausts the descriptors
    and the listener stops accepting real heads until the handshake timeout frees them."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft)


def endpoint(address: str) -> str:
    """``host:port`` (or a full endpoint) -> a ZeroMQ TCP endpoint."""
    if "://" in address:
        return address
    return f"tcp://{address}"


def host_of(address: str) -> str:
    """The host part of ``host:port``, ``tcp://host:port`` or ``[v6]:port``."""
    return address.split("://")[-1].rsplit(":", 1)[0].strip("[]")


def on_this_machine(address: str) -> bool:
    """Loopback, or an address of one of this machine's interfaces (a worker found by
    zeroconf on the same PC is listed at its LAN address): only this machine can bind it.
    Host names other than localhost are not resolved (no DNS wait); they count as remote."""
    host = host_of(address)
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return is_local_ip(ip)


def is_local_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a connection to ``ip`` stays on this machine: loopback, the unspecified
    address and the rest of 0.0.0.0/8 (Linux connects those locally), an IPv4-mapped IPv6
    form of any of them, or an address of one of this machine's interfaces (it can bind it)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback or ip.is_unspecified or (ip.version == 4 and ip in _THIS_NETWORK):
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
        return True
    except OSError:
        return False


_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_TCP_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]{0,252}):([0-9]{1,5})")
RESOLVE_TIMEOUT_S = 2.0  # a name the resolver cannot answer by then is refused (the loop must not wait)

Resolver = Callable[[str, int], Sequence[str]]


def resolve_host(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to for a TCP connection, as libzmq's own connect would
    resolve it (getaddrinfo: ``127.1``, ``0x7f000001`` and ``2130706433`` are 127.0.0.1), in
    the resolver's order; within :data:`RESOLVE_TIMEOUT_S`, else PotluckError."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="potluck-resolve")
    try:
        infos = pool.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM).result(RESOLVE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        raise PotluckError(f"{host!r} did not resolve within {RESOLVE_TIMEOUT_S:g} s") from None
    except (OSError, UnicodeError) as e:
        raise PotluckError(f"{host!r} does not resolve ({e})") from None
    finally:
        pool.shutdown(wait=False)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def check_next_stage(
    next_addr: str, own_port: int, head_on_this_machine: bool, resolve: Resolver = resolve_host
) -> str:
    """The endpoint a worker connects to for the next-stage address ``next_addr``, as an
    address literal (``tcp://192.168.1.21:5733``, ``tcp://[fe80::2]:5733``): what was checked
    is what is connected, whatever a name resolves to later. Refused: anything but
    ``tcp://host:port`` (``ipc://``, ``inproc://`` such as the worker's own ZAP endpoint); a
    host that resolves to this machine (loopback in any spelling, the unspecified address,
    this machine's own addresses and names) unless the head shares this machine (on a LAN
    they would reach whatever listens on the worker's own loopback); and this worker's own
    listener whoever asks."""
    m = _TCP_ENDPOINT.fullmatch(next_addr)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise PotluckError(f"next-stage address {next_addr[:80]!r} refused: only tcp://host:port is taken")
    host, port = m.group(1).strip("[]"), int(m.group(2))
    try:
        found = resolve(host, port)
    except PotluckError as e:
        raise PotluckError(f"next-stage address {next_addr!r} refused: {e}") from None
    ips = []
    for text in found:
        try:
            ips.append(ipaddress.ip_address(text.split("%", 1)[0]))
        except ValueError:
            continue
    if not ips:
        raise PotluckError(f"next-stage address {next_addr!r} refused: it resolves to no IP address")
    local = [ip for ip in ips if is_local_ip(ip)]
    if local and port == own_port:
        raise PotluckError(f"next-stage address {next_addr!r} refused: it is this worker itself")
    if local and not head_on_this_machine:
        why = "" if str(local[0]) == host else f" (it resolves to {local[0]})"
        raise PotluckError(
            f"next-stage address {next_addr!r} refused{why}: an address of this machine is taken only "
            "from a head on this machine"
        )
    ip = ips[0]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"tcp://[{ip}]:{port}" if ip.version == 6 else f"tcp://{ip}:{port}"


def peer_address(frames: list) -> str:
    """The TCP peer address a received message came from ("" if unknown): ZeroMQ's own
    record of the connection, not anything the peer wrote."""
    for frame in frames:
        try:
            return str(frame.get("Peer-Address"))
        except (AttributeError, zmq.ZMQError, TypeError):
            continue
    return ""
