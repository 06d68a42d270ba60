"""Zeroconf on the LAN: workers advertise ``_potluck._tcp.local.``; heads browse for them.

TXT record of a worker: ``id`` (node id), ``v`` (potluck version), ``proto`` (wire
protocol version), ``cores``, ``free_mb``, ``speed`` (measured score). The token is never
advertised: listing nodes needs no secret, joining them does. Tests bind zeroconf to
``127.0.0.1`` (or to addresses of network namespaces they create) so nothing multicasts on
the machine's real network (docs/facts.md §10).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from zeroconf import (
    DNSAddress,
    DNSService,
    InterfaceChoice,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
    current_time_millis,
)
from zeroconf import Error as ZeroconfError

from ..engine.cluster.profile import NodeProfile
from ..engine.cluster.wire import PROTOCOL_VERSION
from ..engine.core.errors import PotluckError
from ..engine.core.printable import printable
from ..engine.core.spec import DISCOVER_TIMEOUT_S

log = logging.getLogger(__name__)

SERVICE_TYPE = "_potluck._tcp.local."
# Rows kept by a Membership: far more workers than a LAN cluster has, few enough that the
# head can join them all at once (a socket and a thread each).
MAX_ROWS = 128
DNS_TYPE_A, DNS_TYPE_SRV, DNS_CLASS_IN = 1, 33, 1  # RFC 1035, RFC 2782


@dataclass(frozen=True)
class DiscoveredNode:
    node_id: str
    address: str  # host:port, ready for --nodes
    version: str
    protocol: int
    cores: int
    free_mb: int
    speed: float

    @property
    def compatible(self) -> bool:
        return self.protocol == PROTOCOL_VERSION


INTERFACES_ENV = "POTLUCK_ZEROCONF_INTERFACES"
"""Comma-separated addresses zeroconf binds to when a caller names none (default: every
interface). For machines on several networks, and for tests, which must never multicast beyond
loopback."""


def configured_interfaces(interfaces: Sequence[str] | None) -> list[str] | None:
    """The caller's interfaces, else those of :data:`INTERFACES_ENV`, else None (all)."""
    if interfaces:
        return list(interfaces)
    return [a.strip() for a in os.environ.get(INTERFACES_ENV, "").split(",") if a.strip()] or None


def _zeroconf(interfaces: Sequence[str] | None) -> Zeroconf:
    chosen = configured_interfaces(interfaces)
    return Zeroconf(interfaces=chosen if chosen else InterfaceChoice.All)


def local_ipv4() -> list[str]:
    """This machine's IPv4 addresses but loopback (point-to-point /32 links left out, as
    zeroconf leaves them out), or loopback alone."""
    import ifaddr

    found = [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips
             if ip.is_IPv4 and ip.network_prefix != 32 and isinstance(ip.ip, str)]
    return [a for a in dict.fromkeys(found) if not a.startswith("127.")] or ["127.0.0.1"]


class Advertiser:
    """Registers one worker's service record until :meth:`close`."""

    def __init__(
        self,
        profile: NodeProfile,
        port: int,
        version: str,
        *,
        interfaces: Sequence[str] | None = None,
    ) -> None:
        self.interfaces = configured_interfaces(interfaces)
        addresses = self.interfaces or local_ipv4()
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"potluck-{profile.node_id}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in addresses],
            port=port,
            properties={
                "id": profile.node_id,
                "v": version,
                "proto": str(PROTOCOL_VERSION),
                "cores": str(profile.cores),
                "free_mb": str(profile.free_mb),
                "speed": f"{profile.speed:g}",
            },
            server=f"potluck-{profile.node_id}.local.",
        )
        self._zc: Zeroconf | None = None

    def start(self) -> None:
        self._zc = _zeroconf(self.interfaces)
        self._zc.register_service(self.info)
        log.info("advertising %s on %s", self.info.name, self.interfaces or "all interfaces")

    def close(self) -> None:
        if self._zc is not None:
            try:
                self._zc.unregister_service(self.info)
            finally:
                self._zc.close()
                self._zc = None


def _ipv4(raw: bytes) -> str | None:
    return socket.inet_ntoa(raw) if len(raw) == 4 else None


def claimed_addresses(zc: Zeroconf, name: str, info: ServiceInfo) -> list[str]:
    """Every host:port that records under ``name`` claim, in the order first seen.

    A record is a claim, not a proof: a clone may announce the same instance name or server
    name with its own SRV or A records, and the DNS cache then holds both (until one side's
    cache-flush expires the other's a second later). Each (server, port) x IPv4 address is a
    candidate; the head proves which are workers by joining them (the CURVE handshake needs the
    token). IPv4 only, as :class:`Advertiser` announces."""
    now = current_time_millis()
    targets = [(info.server, info.port)] if info.server and info.port else []
    for srv in zc.cache.get_all_by_details(name, DNS_TYPE_SRV, DNS_CLASS_IN):
        if isinstance(srv, DNSService) and not srv.is_expired(now):
            targets.append((srv.server, srv.port))
    out: list[str] = []
    for server, port in dict.fromkeys(targets):
        hosts = list(info.parsed_addresses(IPVersion.V4Only)) if server == info.server else []
        for rec in zc.cache.get_all_by_details(server, DNS_TYPE_A, DNS_CLASS_IN):
            if isinstance(rec, DNSAddress) and not rec.is_expired(now):
                hosts.append(_ipv4(rec.address) or "")
        out += [f"{h}:{port}" for h in hosts if h]
    return list(dict.fromkeys(out))


def _node(info: ServiceInfo, address: str) -> DiscoveredNode | None:
    """The row a record claims. Anyone on the LAN may announce one, without the token: its
    text (node id, version) is kept printable, so no consumer can show a raw ``ESC ]52;``."""
    props = {k.decode(errors="replace"): (v or b"").decode(errors="replace")
             for k, v in info.properties.items() if isinstance(k, bytes)}
    try:
        return DiscoveredNode(
            node_id=printable(props.get("id", "?"), limit=64),
            address=address,
            version=printable(props.get("v", "?"), limit=40),
            protocol=int(props.get("proto", "0")),
            cores=int(props.get("cores", "0")),
            free_mb=int(props.get("free_mb", "0")),
            speed=float(props.get("speed", "0")),
        )
    except ValueError:
        log.warning("ignoring a malformed potluck service record %s", info.name)
        return None


class Membership:
    """Live set of advertised workers, one row per address a record claims;
    ``on_change(kind, node)`` with kind "added"/"removed".

    Records are unauthenticated: anyone on the LAN can announce one, with any node id and
    address. So a record is only a candidate and no record displaces or hides another: a clone
    of a worker's record at another address is one more row (same node id, other address),
    and the head's join proves which rows are workers (:func:`find_candidates`). Addresses a
    record claimed stay until that record is removed (its goodbye or expiry). At most
    :data:`MAX_ROWS` rows are kept: past that, new ones are ignored with a warning.
    """

    def __init__(
        self,
        *,
        interfaces: Sequence[str] | None = None,
        on_change: Callable[[str, DiscoveredNode], None] | None = None,
    ) -> None:
        self.ignored_rows = 0  # rows past MAX_ROWS
        self._zc = _zeroconf(interfaces)
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, str], DiscoveredNode] = {}  # (instance name, host:port) -> row
        self._on_change = on_change
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._changed])

    def _changed(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is ServiceStateChange.Removed:
            with self._lock:
                gone = [self._rows.pop(k) for k in [k for k in self._rows if k[0] == name]]
            if self._on_change:
                for node in gone:
                    self._on_change("removed", node)
            return
        threading.Thread(target=self._resolve, args=(service_type, name), daemon=True).start()

    def _resolve(self, service_type: str, name: str) -> None:
        try:
            info = self._zc.get_service_info(service_type, name, timeout=3000)
        except ZeroconfError as e:  # its event loop held up past the timeout (a busy machine), or closed
            log.info("could not resolve zeroconf record %s (%s); waiting for its next announcement",
                     name, type(e).__name__)
            return
        if info is None:
            return
        for address in claimed_addresses(self._zc, name, info):
            node = _node(info, address)
            if node is None:
                return
            with self._lock:
                known = (name, address) in self._rows
                full = not known and len(self._rows) >= MAX_ROWS
                if full:
                    self.ignored_rows += 1
                else:
                    self._rows[(name, address)] = node  # figures (free memory...) update in place
            if full:
                log.warning(
                    "ignoring zeroconf record %s at %s: over %d potluck records on this LAN "
                    "(someone may be flooding it); pass the workers with --nodes", name, address, MAX_ROWS,
                )
            elif not known and self._on_change:
                self._on_change("added", node)

    def nodes(self) -> list[DiscoveredNode]:
        with self._lock:
            return sorted(set(self._rows.values()), key=lambda n: (n.address, n.node_id))

    def wait_for(self, node_ids: Collection[str], timeout_s: float) -> list[DiscoveredNode]:
        """Rows seen once every one of ``node_ids`` is known or ``timeout_s`` passed, whichever
        is first. Ids, not a count: other machines' (or other runs') records may come first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not set(node_ids) <= {n.node_id for n in self.nodes()}:
            time.sleep(0.05)
        return self.nodes()

    def close(self) -> None:
        self._browser.cancel()
        self._zc.close()


def browse(
    timeout_s: float = DISCOVER_TIMEOUT_S, *, interfaces: Sequence[str] | None = None, expect: Collection[str] = ()
) -> list[DiscoveredNode]:
    """Rows advertised within ``timeout_s`` (returns early once the nodes ``expect`` names are found),
    including rows whose record said goodbye meanwhile: a goodbye is unauthenticated too."""
    seen: dict[DiscoveredNode, None] = {}
    m = Membership(interfaces=interfaces, on_change=lambda kind, n: seen.setdefault(n) if kind == "added" else None)
    try:
        if expect:
            now = m.wait_for(expect, timeout_s)
        else:
            time.sleep(timeout_s)
            now = m.nodes()
    finally:
        m.close()
    return sorted(set(now) | set(seen), key=lambda n: (n.address, n.node_id))


def find_candidates(
    timeout_s: float = DISCOVER_TIMEOUT_S, *, interfaces: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The addresses of ``--nodes auto``: every address a compatible record claims, once.

    None is trusted: the head joins them all at once under one deadline and keeps those that
    prove to be workers of this cluster (``skip_failed_joins``), so a clone or a junk record
    costs nothing but a failed join."""
    rows = [n for n in browse(timeout_s, interfaces=interfaces) if n.compatible]
    if not rows:
        raise PotluckError("no potluck workers found on the LAN; start `potluck worker` or pass --nodes")
    return tuple(dict.fromkeys(n.address for n in rows))
