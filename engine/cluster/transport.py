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
import re
import socket
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
# Replies queued per peer (a head reads its results as they come); past that they are dropped.
SERVER_SNDHWM = 1024
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


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> zmq.auth.thread.ThreadAuthenticator:
    """Run the ZAP handler that gates every CURVE server socket of ``ctx``."""
    auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("potluck.zap"))
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


def read_event(monitor: zmq.Socket) -> tuple[int, str]:
    """(event id, endpoint) of one pending monitor message."""
    msg = parse_monitor_message(monitor.recv_multipart())
    endpoint = msg.get("endpoint", b"")
    return int(msg["event"]), endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


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
