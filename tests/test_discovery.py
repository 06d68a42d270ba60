"""Cluster auth keys and zeroconf discovery, bound to loopback only (docs/facts.md §10)."""

from __future__ import annotations

import time

import pytest

from potluck.discovery.auth import generate_token, keys_from_token, resolve_token, save_token
from potluck.discovery.lan import Advertiser, Membership, browse
from potluck.engine.cluster.profile import NodeProfile
from potluck.engine.core.errors import PotluckError

LOOPBACK = ["127.0.0.1"]


def test_keys_are_derived_from_the_token() -> None:
    t1, t2 = generate_token(), generate_token()
    assert t1 != t2 and len(t1) > 40
    assert keys_from_token(t1) == keys_from_token(t1)
    k1, k2 = keys_from_token(t1), keys_from_token(t2)
    assert k1.server_public != k2.server_public and k1.client_public != k2.client_public
    assert k1.server_public != k1.client_public
    assert len(k1.server_public) == 40  # Z85 of 32 bytes


def test_token_resolution(tmp_home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POTLUCK_TOKEN", raising=False)
    with pytest.raises(PotluckError, match="potluck token"):
        resolve_token(None)
    token = generate_token()
    save_token(token)
    assert resolve_token(None) == token
    env_token, arg_token = generate_token(), generate_token()
    monkeypatch.setenv("POTLUCK_TOKEN", env_token)
    assert resolve_token(None) == env_token
    assert resolve_token(arg_token) == arg_token
    for weak in ("short", "x" * 40):  # the strength rule itself: tests/test_trust_token.py
        with pytest.raises(PotluckError, match="guessable"):
            resolve_token(weak)


def test_advertised_workers_are_found_and_leave() -> None:
    profiles = [NodeProfile(f"testnode{i}", 4, 1000 + i, 2.5) for i in range(2)]
    ads = [Advertiser(p, 40000 + i, "9.9", interfaces=LOOPBACK) for i, p in enumerate(profiles)]
    events: list[tuple[str, str]] = []
    watcher = Membership(interfaces=LOOPBACK, on_change=lambda kind, n: events.append((kind, n.node_id)))
    try:
        for ad in ads:
            ad.start()
        watcher.wait_for({"testnode0", "testnode1"}, 8.0)  # other loopback records may come first
        found = {n.node_id: n for n in browse(3.0, interfaces=LOOPBACK)}
        assert {"testnode0", "testnode1"} <= set(found)
        n1 = found["testnode1"]
        assert n1.address == "127.0.0.1:40001" and n1.cores == 4 and n1.free_mb == 1001
        assert n1.speed == 2.5 and n1.version == "9.9" and n1.compatible
        ads[0].close()
        for _ in range(100):
            if ("removed", "testnode0") in events:
                break
            time.sleep(0.05)
        assert ("added", "testnode1") in events and ("removed", "testnode0") in events
    finally:
        watcher.close()
        for ad in ads:
            ad.close()


def test_a_record_that_cannot_be_resolved_on_a_busy_machine_is_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """zeroconf raises EventLoopBlocked when its loop is held up past the timeout (a busy
    machine): the resolving thread logs and waits for the next announcement, no traceback."""
    import logging

    from zeroconf import EventLoopBlocked

    from potluck.discovery.lan import SERVICE_TYPE

    watcher = Membership(interfaces=LOOPBACK)
    try:
        def blocked(*a: object, **k: object) -> None:
            raise EventLoopBlocked

        monkeypatch.setattr(watcher._zc, "get_service_info", blocked)
        with caplog.at_level(logging.INFO, logger="potluck.discovery.lan"):
            watcher._resolve(SERVICE_TYPE, f"busy.{SERVICE_TYPE}")
        assert any("could not resolve" in r.getMessage() for r in caplog.records)
    finally:
        watcher.close()


def test_token_and_nodes_commands(tmp_home, capsys: pytest.CaptureFixture[str]) -> None:
    from potluck.app.cli import main

    assert main(["token"]) == 0
    token = capsys.readouterr().out.strip()
    assert main(["token", "--show"]) == 0
    assert capsys.readouterr().out.strip() == token and token.startswith("potluck-")
    assert main(["nodes", "--interface", "127.0.0.1", "--timeout", "0.3"]) == 1
    assert "no potluck workers found" in capsys.readouterr().out
