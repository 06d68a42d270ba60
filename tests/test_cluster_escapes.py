"""Strangers and workers write to your terminal no more (issue 39 item 7).

A zeroconf record sent without the token put raw ``ESC ]0;`` (window title), ``ESC ]52;c;``
(a clipboard write) and ``ESC [2J`` (clear the screen) into ``potluck nodes``; a malicious
worker's refusal reached the head's terminal raw, and Textual markup in either could crash the
chat app. Everything a remote party says is shown escaped: records where they are parsed
(discovery/lan.py), a worker's words where the head reads them (cluster/link.py), and again
where the CLI and the chat app print them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from potluck.discovery.auth import keys_from_token
from potluck.discovery.lab import LOOPBACK, Attacker, dead_port, worker_record
from potluck.engine.cluster import wire
from potluck.engine.lab.wire_fuzz import FakeWorker

from .cluster_support import TOKEN

TITLE, CLIPBOARD, CLEAR = "\x1b]0;owned\x07", "\x1b]52;c;aGk=\x07", "\x1b[2J"
EVIL = f"{CLIPBOARD}[/x]{TITLE}{CLEAR}\u202eevil"


def run_cli(args: list[str], home: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, POTLUCK_HOME=str(home), POTLUCK_TOKEN=TOKEN)
    return subprocess.run([sys.executable, "-m", "potluck.app.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def assert_escaped(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text)
    assert "\\x1b]52;c;aGk=\\x07" in text, text  # shown, escaped (long text is cut: a line each)


def test_potluck_nodes_escapes_what_a_record_says(attacker: Attacker, tmp_home: Path) -> None:
    instance, port = "potluck-evil" + os.urandom(4).hex(), dead_port()
    attacker.zc.register_service(worker_record(EVIL, port, instance=instance, version=EVIL),
                                 cooperating_responders=True)
    out = run_cli(["nodes", "--interface", LOOPBACK[0], "--timeout", "4"], tmp_home)
    rows = [line for line in out.stdout.splitlines() if f"127.0.0.1:{port}" in line]
    assert out.returncode == 0 and len(rows) == 1, out
    assert_escaped(rows[0])
    assert "\x1b" not in out.stdout + out.stderr


def test_a_workers_refusal_reaches_the_head_escaped(tmp_home: Path) -> None:
    # a token holder posing as a worker, refusing every request with text for the terminal
    evil = FakeWorker(keys_from_token(TOKEN), 49152, lambda m: [], refusal=wire.Error(EVIL, "refused\x1b[2J", EVIL, 0))
    try:
        out = run_cli(["generate", "--nodes", f"127.0.0.1:{evil.port}", "--join-timeout", "30",
                       "--max-tokens", "1", "hi"], tmp_home)
    finally:
        evil.close()
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("potluck: error:"), out.stderr
    assert "refused" in lines[0]
    assert_escaped(lines[0])


def test_what_a_worker_writes_is_made_printable_where_the_head_reads_it() -> None:
    from potluck.engine.cluster.link import shown

    error = shown(wire.Error(EVIL, "busy", EVIL * 100, 3))
    assert isinstance(error, wire.Error) and error.txn == 3
    assert_escaped(error.node)
    assert_escaped(error.message[:200]) and len(error.message) <= 400  # a line, not 4 kB
    welcome = shown(wire.Welcome(EVIL, EVIL, 2, 1000, 1.0, "idle", 1 << 20))
    assert isinstance(welcome, wire.Welcome)
    assert_escaped(welcome.node_id) and assert_escaped(welcome.potluck_version)  # type: ignore[func-returns-value]
    plain = wire.Welcome("node-1", "0.9", 2, 1000, 1.0, "idle", 1 << 20)
    assert shown(plain) == plain  # what a real worker says is unchanged
    # why a stage's batches stay exact: it ends up in a one-line refusal of speculation
    loaded = shown(wire.Loaded(12, 576, 49152, 512, 1.0, 1, False, EVIL * 100))
    assert isinstance(loaded, wire.Loaded) and loaded.max_rows == 1
    assert_escaped(loaded.exact_reason[:200]) and len(loaded.exact_reason) <= 400  # type: ignore[func-returns-value]
    honest = wire.Loaded(12, 576, 49152, 512, 1.0, 48, True, "F32 (blk.0.ffn_gate_inp.weight): single steps as 2 rows")
    assert shown(honest) == honest
