"""A LAN attacker without the cluster token against ``--nodes auto`` (issue 20, finding 3).

It announces zeroconf records: clones of a real worker's record (same node id, at an address
where no worker answers) and junk records, and it may say goodbye for a record it does not
own. Everything is bound to 127.0.0.1 (docs/facts.md §10): the dead addresses are loopback
ports nobody listens on, or :class:`SilentPorts` that take a connection and never answer.
Used by tests/test_trust_discovery.py and scripts/nodes_auto_under_attack.py.
"""

from __future__ import annotations

import os
import select
import socket
import threading

from zeroconf import DNSOutgoing, DNSPointer, ServiceInfo, Zeroconf

from potluck.discovery.lan import SERVICE_TYPE
from potluck.engine.cluster.wire import PROTOCOL_VERSION

LOOPBACK = ("127.0.0.1",)
DNS_TYPE_PTR, DNS_CLASS_IN = 12, 1  # RFC 1035
DNS_RESPONSE_FLAGS = 0x8400  # QR (a response) + AA (authoritative), RFC 6762 §18


def dead_port() -> int:
    """A loopback port nobody listens on (the OS just handed it out and it was closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SilentPorts:
    """Loopback TCP ports that accept connections and never send a byte (a host that is up
    but is no potluck worker). ``peak`` is the most connections open at once over all of them:
    a head that tries candidates one after another never has more than one."""

    def __init__(self, n: int) -> None:
        self._listeners = []
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(64)
            self._listeners.append(s)
        self.ports = [s.getsockname()[1] for s in self._listeners]
        self._conns: set[socket.socket] = set()
        self.accepted = 0
        self.peak = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="silent-ports", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            ready, _, _ = select.select([*self._listeners, *self._conns], [], [], 0.05)
            for s in ready:
                if s in self._listeners:
                    conn, _ = s.accept()
                    self._conns.add(conn)
                    self.accepted += 1
                elif not s.recv(65536):  # the peer closed (a greeting is read and ignored)
                    self._conns.discard(s)
                    s.close()
            self.peak = max(self.peak, len(self._conns))

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        for s in [*self._conns, *self._listeners]:
            s.close()


def worker_record(node_id: str, port: int, *, instance: str | None = None, server: str | None = None) -> ServiceInfo:
    """A record that says what a worker's says (:class:`potluck.discovery.lan.Advertiser`)."""
    return ServiceInfo(
        SERVICE_TYPE,
        f"{instance or 'potluck-' + node_id}.{SERVICE_TYPE}",
        addresses=[socket.inet_aton("127.0.0.1")],
        port=port,
        properties={"id": node_id, "v": "0", "proto": str(PROTOCOL_VERSION), "cores": "64",
                    "free_mb": "999999", "speed": "99"},  # looks better than any real worker
        server=server or f"potluck-{node_id}.local.",
    )


class Attacker:
    """Records announced from the attacker's own zeroconf responder (on loopback)."""

    def __init__(self) -> None:
        self.zc = Zeroconf(interfaces=list(LOOPBACK))

    def clone(self, node_id: str, port: int, *, same_name: bool) -> None:
        """A clone of ``node_id``'s record at ``port``: under the worker's own instance name
        (announced without probing, as a responder that ignores the conflict would; the
        worker must be announced first, or its probe finds the clone) or under another."""
        if same_name:
            info = worker_record(node_id, port, server="attacker.local.")
            self.zc.register_service(info, cooperating_responders=True)
        else:
            self.zc.register_service(worker_record(node_id, port, instance=f"potluck-{node_id}-2"))

    def junk(self, ports: list[int]) -> list[str]:
        """One record with a fresh node id at each port; their node ids."""
        ids = [os.urandom(6).hex() for _ in ports]
        for node_id, port in zip(ids, ports):
            self.zc.register_service(worker_record(node_id, port))
        return ids

    def goodbye(self, node_id: str) -> None:
        """Say goodbye (TTL 0) for the real worker's record, as if it had left."""
        out = DNSOutgoing(DNS_RESPONSE_FLAGS)
        name = f"potluck-{node_id}.{SERVICE_TYPE}"
        out.add_answer_at_time(DNSPointer(SERVICE_TYPE, DNS_TYPE_PTR, DNS_CLASS_IN, 0, name), 0)
        self.zc.send(out)

    def close(self) -> None:
        self.zc.close()
