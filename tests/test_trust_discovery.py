"""No one without the token can hide a worker from ``--nodes auto`` (issue 20, finding 3).

The attacker (potluck.discovery.lab, also run by scripts/nodes_auto_under_attack.py) announces
clones of a real worker's record at dead loopback addresses, junk records, and goodbyes for
records it does not own. Zeroconf is bound to 127.0.0.1 only (docs/facts.md §10). Other
loopback records (another test's workers) may be seen too: the assertions only ask for what
must be there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from potluck.app.loopback import running_worker, spawn_worker, stop_worker
from potluck.discovery.auth import generate_token, keys_from_token
from potluck.discovery.lab import LOOPBACK, Attacker, dead_port, nodes_auto_under_attack
from potluck.discovery.lan import Advertiser, Membership, browse, find_candidates
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.profile import NodeProfile
from potluck.engine.cluster.transfer import SliceCache

BROWSE_S = 4.0
JOIN_S = 10.0  # the real worker must join within it, on a busy machine too


def test_clones_and_junk_are_candidates_beside_the_real_worker(attacker: Attacker) -> None:
    """Clones of the real record (same node id, dead addresses; one under another instance
    name announced before the worker's own record, one under the worker's instance name)
    displace nothing: every claimed address is a candidate, and the join proves which is the
    worker."""
    real_id = "victim" + os.urandom(4).hex()
    clone_port, junk_ports = dead_port(), [dead_port() for _ in range(3)]
    other_clone_port = dead_port()
    attacker.clone(real_id, other_clone_port, same_name=False)
    attacker.junk(junk_ports)
    real = Advertiser(NodeProfile(real_id, 2, 1000, 1.0), dead_port(), "9.9", interfaces=list(LOOPBACK))
    watcher = Membership(interfaces=list(LOOPBACK))
    try:
        real.start()
        attacker.clone(real_id, clone_port, same_name=True)
        real_address = f"127.0.0.1:{real.info.port}"
        clones = {f"127.0.0.1:{clone_port}", f"127.0.0.1:{other_clone_port}"}
        candidates = find_candidates(BROWSE_S, interfaces=list(LOOPBACK))
        assert {real_address, *clones, *(f"127.0.0.1:{p}" for p in junk_ports)} <= set(candidates)
        rows = {n.address for n in watcher.nodes() if n.node_id == real_id}
        assert rows == {real_address, *clones}  # one row per claimed address, none displaced
    finally:
        watcher.close()
        real.close()


def test_a_goodbye_from_someone_else_does_not_hide_a_worker(attacker: Attacker) -> None:
    """Goodbyes are unauthenticated too: a browse keeps every row it saw."""
    real_id = "victim" + os.urandom(4).hex()
    real = Advertiser(NodeProfile(real_id, 2, 1000, 1.0), dead_port(), "9.9", interfaces=list(LOOPBACK))
    removed = threading.Event()
    watcher = Membership(
        interfaces=list(LOOPBACK),
        on_change=lambda kind, n: removed.set() if kind == "removed" and n.node_id == real_id else None,
    )
    try:
        real.start()
        deadline = time.monotonic() + 8.0
        while real_id not in {n.node_id for n in watcher.nodes()} and time.monotonic() < deadline:
            time.sleep(0.05)
        timer = threading.Timer(BROWSE_S / 2, attacker.goodbye, args=(real_id,))
        timer.start()
        rows = browse(BROWSE_S, interfaces=list(LOOPBACK))
        timer.join()
        assert removed.wait(5.0)  # the goodbye did reach the live listing
        assert f"127.0.0.1:{real.info.port}" in {n.address for n in rows if n.node_id == real_id}
    finally:
        watcher.close()
        real.close()


def test_nodes_auto_joins_the_real_worker_past_a_clone_and_junk(
    model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The real thing: a loopback worker, a clone of its record and 10 junk records at dead
    loopback ports, through find_candidates and open_pipeline as ``--nodes auto`` runs them."""
    token = generate_token()  # other loopback workers (another test's) hold other tokens
    real = spawn_worker(tmp_path, "real", token, zeroconf=True)
    cache = SliceCache(tmp_path / "slices")
    try:
        # 5 of the junk take the connection and stay silent (until the handshake timeout cuts
        # it): all were tried at once (they held 5 connections together; one after another: never 2).
        # Past the 2 s cut libzmq connects again, so a join slowed by a busy machine sees more.
        run = nodes_auto_under_attack(model_path, real.node_id, token, cache, junk=10, silent=5, join_timeout_s=JOIN_S)
        assert run.joined == [run.real_id]
        assert run.silent_peak >= 5, run
        assert run.join_s < JOIN_S + 20, run  # one deadline (generous for a busy machine); in turn: 6 x 10 s
        # All dead (nobody listens): once the worker is in, the join stops waiting for the clone
        # and the junk rather than at their deadline (a minute here).
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="potluck.engine.cluster"):
            run = nodes_auto_under_attack(
                model_path, real.node_id, token, cache, junk=10, silent=0, join_timeout_s=60.0
            )
        assert run.joined == [run.real_id]
        skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped 127.0.0.1:")]
        left_early = [m for m in skipped if "no worker of this cluster there" in m]
        assert len(left_early) >= 11, skipped  # the clone and the junk (other loopback records may add more)
        assert not any("within 60 s" in m for m in skipped), skipped
        assert any("did not prove to be workers" in r.getMessage() for r in caplog.records)
    finally:
        stop_worker(real.proc)


def test_a_worker_at_two_addresses_is_joined_once_and_its_second_link_answered(
    model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker listening on every interface is one node at several addresses (zeroconf lists
    each; here 127.0.0.1 and 127.0.0.2, both loopback). Both links say hello at once: one owns
    the worker, the other is refused at once (the worker is being set up for the first link's
    key), so the join neither keeps two links to one node nor waits out its deadline for the
    second."""
    token = generate_token()
    with running_worker(tmp_path, "twice", token, extra_args=["--bind", "0.0.0.0"]) as worker:
        port = worker.address.rsplit(":", 1)[1]
        addresses = [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="potluck.engine.cluster"):
            target = open_pipeline(
                model_path, addresses, keys_from_token(token), n_ctx=256, skip_failed_joins=True,
                join_timeout_s=120.0, slice_cache=SliceCache(tmp_path / "slices"), recover=False,
            )
        try:
            assert [s.node.name for s in target.plan.stages] == [worker.node_id]
        finally:
            target.close()
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped 127.0.0.")]
    assert len(skipped) == 1, skipped
    # answered, not abandoned: neither "no worker there" (left early) nor the deadline's reason
    assert "serving another head" in skipped[0] or "another address of node" in skipped[0], skipped
