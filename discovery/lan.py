"""Zeroconf on the LAN: workers advertise ``_potluck._tcp.local.``; heads browse for them.

TXT record of a worker: ``id`` (node id), ``v`` (potluck version), ``proto`` (wire
protocol version), ``cores``, ``free_mb``, ``speed`` (measured score). The token is never
advertised: listing nodes needs no secret, joining them does. Tests bind zeroconf to
``127.0.0.1`` (or to addresses of network namespaces they create) so nothing multicasts on
the machine's real network (docs/facts.md §10).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zeroconf import InterfaceChoice, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from ..engine.cluster.profile import NodeProfile
from ..engine.cluster.wire import PROTOCOL_VERSION

log = logging.getLogger(__name__)

SERVICE_TYPE = "_potluck._tcp.local."


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


def _zeroconf(interfaces: Sequence[str] | None) -> Zeroconf:
    return Zeroconf(interfaces=list(interfaces) if interfaces else InterfaceChoice.All)


def _local_ipv4() -> list[str]:
    from zeroconf import get_all_addresses

    return [a for a in get_all_addresses() if not a.startswith("127.")] or ["127.0.0.1"]


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
        self.interfaces = list(interfaces) if interfaces else None
        addresses = self.interfaces or _local_ipv4()
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


def _node(info: ServiceInfo) -> DiscoveredNode | None:
    props = {k.decode(): (v or b"").decode() for k, v in info.properties.items() if isinstance(k, bytes)}
    addrs = info.parsed_addresses()
    if not addrs or info.port is None:
        return None
    try:
        return DiscoveredNode(
            node_id=props.get("id", "?"),
            address=f"{addrs[0]}:{info.port}",
            version=props.get("v", "?"),
            protocol=int(props.get("proto", "0")),
            cores=int(props.get("cores", "0")),
            free_mb=int(props.get("free_mb", "0")),
            speed=float(props.get("speed", "0")),
        )
    except ValueError:
        log.warning("ignoring a malformed potluck service record %s", info.name)
        return None


class Membership:
    """Live set of advertised workers; ``on_change(kind, node)`` with kind "added"/"removed".

    Records are unauthenticated (anyone on the LAN can announce one), so a known node keeps
    its address: a record that reuses its instance name or node id with another address is
    ignored with a warning unless ``verify(node)`` (e.g. a CURVE join checking the node id
    the worker itself reports) confirms it. A node leaves only by its own goodbye or expiry.
    """

    def __init__(
        self,
        *,
        interfaces: Sequence[str] | None = None,
        on_change: Callable[[str, DiscoveredNode], None] | None = None,
        verify: Callable[[DiscoveredNode], bool] | None = None,
    ) -> None:
        self._verify = verify
        self.refused_takeovers = 0
        self._zc = _zeroconf(interfaces)
        self._lock = threading.Lock()
        self._nodes: dict[str, DiscoveredNode] = {}
        self._on_change = on_change
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._changed])

    def _changed(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is ServiceStateChange.Removed:
            with self._lock:
                node = self._nodes.pop(name, None)
            if node is not None and self._on_change:
                self._on_change("removed", node)
            return
        threading.Thread(target=self._resolve, args=(service_type, name), daemon=True).start()

    def _resolve(self, service_type: str, name: str) -> None:
        info = self._zc.get_service_info(service_type, name, timeout=3000)
        node = _node(info) if info is not None else None
        if node is None:
            return
        with self._lock:
            old = self._nodes.get(name) or next(
                (n for n in self._nodes.values() if n.node_id == node.node_id), None
            )
        takeover = old is not None and old.address != node.address
        if takeover:
            if self._verify is None or not self._verify(node):
                self.refused_takeovers += 1
                log.warning(
                    "ignoring a zeroconf record that moves node %s from %s to %s without proof",
                    old.node_id, old.address, node.address,
                )
                return
        with self._lock:
            if takeover:  # proven: the node moved
                self._nodes = {k: v for k, v in self._nodes.items() if v is not old}
            elif old is not None and old is not self._nodes.get(name):
                return  # the same node id under a second name: keep the first
            known = name in self._nodes
            self._nodes[name] = node
        if not known and self._on_change:
            self._on_change("added", node)

    def nodes(self) -> list[DiscoveredNode]:
        with self._lock:
            return sorted(self._nodes.values(), key=lambda n: n.address)

    def wait_for(self, count: int, timeout_s: float) -> list[DiscoveredNode]:
        """Nodes seen once ``count`` are known or ``timeout_s`` passed, whichever is first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and len(self.nodes()) < count:
            time.sleep(0.05)
        return self.nodes()

    def close(self) -> None:
        self._browser.cancel()
        self._zc.close()


def browse(timeout_s: float = 2.0, *, interfaces: Sequence[str] | None = None, expect: int = 0) -> list[DiscoveredNode]:
    """Workers advertised within ``timeout_s`` (returns early once ``expect`` are found)."""
    m = Membership(interfaces=interfaces)
    try:
        return m.wait_for(expect or 1 << 30, timeout_s)
    finally:
        m.close()
