"""``--nodes auto`` with an attacker on the LAN (issue 20, finding 3): a script with a figure.

    .venv/bin/python -m scripts.nodes_auto_under_attack [--junk 10] [--silent 0] [--reps 3]

An attacker without the cluster token announces zeroconf records: a clone of a real worker's
record (same node id and instance name, at a dead address) and junk records with fresh node
ids. Dead addresses are loopback ports nobody listens on, or (``--silent N`` of the junk)
ports that take a TCP connection and never answer, like a host that is up but is no worker.
One real loopback worker advertises itself. The head then does what ``--nodes auto`` does
(:func:`potluck.discovery.lan.find_candidates`, then ``open_pipeline`` skipping candidates
that fail to join) and the script reports the time to browse, to join (until the plan) and
to load the chain, and the most silent-port connections open at once (all of them: the
candidates were tried in parallel). Everything is bound to 127.0.0.1 (docs/facts.md §10).
tests/test_trust_discovery.py runs the same scenario.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from zeroconf import DNSOutgoing, DNSPointer, ServiceInfo, Zeroconf

from potluck.app.loopback import LoopbackWorker, spawn_worker, stop_worker
from potluck.assets import default_model_path
from potluck.discovery.auth import generate_token, keys_from_token
from potluck.discovery.lan import SERVICE_TYPE, find_candidates
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
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
    model_path: Path, real: LoopbackWorker, token: str, slice_cache: SliceCache, *, junk: int = 10,
    silent: int = 0, browse_s: float = 3.0, join_timeout_s: float = 5.0,
) -> AttackRun:
    """``--nodes auto``'s discovery and join beside the worker ``real`` (zeroconf on loopback,
    holding ``token``), one clone of its record and ``junk`` junk records (``silent`` of them
    at silent ports)."""
    ports = SilentPorts(silent)
    attacker = Attacker()
    target = None
    try:
        attacker.clone(real.node_id, dead_port(), same_name=True)
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
            real.node_id, [s.node.name for s in target.plan.stages], len(candidates), t1 - t0,
            planned[0] - t1, t2 - planned[0], ports.peak, silent,
        )
    finally:
        if target is not None:
            target.close()
        attacker.close()
        ports.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--junk", type=int, default=10, help="junk records (default 10)")
    ap.add_argument("--silent", type=int, default=0, help="of them at ports that accept and stay silent (default 0)")
    ap.add_argument("--join-timeout", type=float, default=5.0, help="the joins' one deadline, s (default 5)")
    ap.add_argument("--browse", type=float, default=3.0, help="seconds to browse (default 3; the CLI's is 2)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not 0 <= args.silent <= args.junk:
        ap.error("--silent must be 0..--junk")
    runs = []
    with tempfile.TemporaryDirectory(prefix="potluck-attack-") as tmp:
        token = generate_token()  # other loopback workers (another run's) hold other tokens
        real = spawn_worker(Path(tmp), "real", token, zeroconf=True)
        try:
            cache = SliceCache(Path(tmp) / "slices")
            for i in range(args.reps):
                run = nodes_auto_under_attack(
                    default_model_path(), real, token, cache, junk=args.junk, silent=args.silent,
                    browse_s=args.browse, join_timeout_s=args.join_timeout,
                )
                ok = run.joined == [run.real_id]
                print(f"rep {i}: {run.candidates} candidates; browse {run.browse_s:.1f} s, join {run.join_s:.2f} s, "
                      f"load {run.load_s:.1f} s; chain {'= the real worker' if ok else run.joined}; "
                      f"silent ports open at once {run.silent_peak}/{run.silent}", flush=True)
                runs.append((run, ok))
        finally:
            stop_worker(real.proc)
    joins = [r.join_s for r, _ in runs]
    print(f"join (until the plan), {args.junk} junk ({args.silent} silent) + 1 clone: "
          f"median {statistics.median(joins):.2f} s, max {max(joins):.2f} s over {len(runs)} runs")
    return 0 if all(ok for _, ok in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
