"""A hostile LAN host's zeroconf records, for the trust tests and the issue-20 figure.

Shared by ``tests/test_trust_discovery.py`` and ``scripts/nodes_auto_under_attack.py`` (one home
for both: scripts import nothing from tests). An attacker without the cluster token announces a
clone of a real worker's record at a dead address and junk records with fresh node ids; dead
addresses are loopback ports nobody listens on, or ports that accept and never answer.
Everything here binds 127.0.0.1 only (docs/facts.md §10): never another interface.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from zeroconf import DNSOutgoing, DNSPointer, ServiceInfo, Zeroconf

from ..engine.cluster.head import open_pipeline
from ..engine.cluster.transfer import SliceCache
from ..engine.cluster.wire import PROTOCOL_VERSION
from .auth import keys_from_token
from .lan import SERVICE_TYPE, find_candidates

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


def worker_record(
    node_id: str, port: int, *, instance: str | None = None, server: str | None = None, version: str = "0"
) -> ServiceInfo:
    """A record that says what a worker's says (:class:`potluck.discovery.lan.Advertiser`)."""
    return ServiceInfo(
        SERVICE_TYPE,
        f"{instance or 'potluck-' + node_id}.{SERVICE_TYPE}",
        addresses=[socket.inet_aton("127.0.0.1")],
        port=port,
        properties={"id": node_id, "v": version, "proto": str(PROTOCOL_VERSION), "cores": "64",
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
        # At once and without probing first (one after another takes 1.5 s a name).
        threads = [
            threading.Thread(target=self.zc.register_service, args=(worker_record(node_id, port),),
                             kwargs={"cooperating_responders": True})
            for node_id, port in zip(ids, ports)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return ids

    def goodbye(self, node_id: str) -> None:
        """Say goodbye (TTL 0) for the real worker's record, as if it had left."""
        out = DNSOutgoing(DNS_RESPONSE_FLAGS)
        name = f"potluck-{node_id}.{SERVICE_TYPE}"
        out.add_answer_at_time(DNSPointer(SERVICE_TYPE, DNS_TYPE_PTR, DNS_CLASS_IN, 0, name), 0)
        self.zc.send(out)

    def close(self) -> None:
        self.zc.close()


@dataclass
class AttackRun:
    """One ``--nodes auto`` run beside the attacker's records."""

    real_id: str
    joined: list[str]  # node ids of the chain's stages
    candidates: int  # addresses the browse offered
    browse_s: float
    join_s: float  # from open_pipeline to the plan: every candidate tried, the chain chosen
    load_s: float  # then sending and loading the slices
    silent_peak: int  # most connections open at once to the silent ports
    silent: int


def nodes_auto_under_attack(
    model_path: Path, real_id: str, token: str, slice_cache: SliceCache, *, junk: int = 10,
    silent: int = 0, browse_s: float = 3.0, join_timeout_s: float = 5.0,
) -> AttackRun:
    """``--nodes auto``'s discovery and join beside the worker ``real_id`` (zeroconf on loopback,
    holding ``token``), one clone of its record and ``junk`` junk records (``silent`` of them
    at silent ports)."""
    ports = SilentPorts(silent)
    attacker = Attacker()
    target = None
    try:
        attacker.clone(real_id, dead_port(), same_name=True)
        attacker.junk(ports.ports + [dead_port() for _ in range(junk - silent)])
        t0 = time.monotonic()
        candidates = find_candidates(browse_s, interfaces=list(LOOPBACK))
        t1 = time.monotonic()
        planned: list[float] = []
        target = open_pipeline(
            model_path, candidates, keys_from_token(token), n_ctx=256, skip_failed_joins=True,
            join_timeout_s=join_timeout_s, slice_cache=slice_cache,
            on_plan=lambda plan: planned.append(time.monotonic()), recover=False,
        )
        t2 = time.monotonic()
        return AttackRun(
            real_id, [s.node.name for s in target.plan.stages], len(candidates), t1 - t0,
            planned[0] - t1, t2 - planned[0], ports.peak, silent,
        )
    finally:
        if target is not None:
            target.close()
        attacker.close()
        ports.close()
