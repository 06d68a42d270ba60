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
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from potluck.discovery.auth import keys_from_token
from potluck.discovery.lab import LOOPBACK, Attacker, dead_port, worker_record
from potluck.engine.cluster import wire
from potluck.engine.cluster.transport import server_socket, start_authenticator

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


@pytest.fixture()
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    try:
        yield a
    finally:
        a.close()


def test_potluck_nodes_escapes_what_a_record_says(attacker: Attacker, tmp_home: Path) -> None:
    instance, port = "potluck-evil" + os.urandom(4).hex(), dead_port()
    attacker.zc.register_service(worker_record(EVIL, port, instance=instance, version=EVIL),
                                 cooperating_responders=True)
    out = run_cli(["nodes", "--interface", LOOPBACK[0], "--timeout", "4"], tmp_home)
    rows = [line for line in out.stdout.splitlines() if f"127.0.0.1:{port}" in line]
    assert out.returncode == 0 and len(rows) == 1, out
    assert_escaped(rows[0])
    assert "\x1b" not in out.stdout + out.stderr


class Refuser:
    """A token holder posing as a worker that refuses every request with text for the terminal."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, keys_from_token(TOKEN))
        self.sock = server_socket(self.ctx, keys_from_token(TOKEN), max_msg_bytes=1 << 20)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            if self.sock.poll(20):
                ident, *_ = self.sock.recv_multipart()
                try:
                    self.sock.send_multipart([ident, *wire.to_frames(wire.Error(EVIL, "refused\x1b[2J", EVIL, 0))])
                except zmq.ZMQError:
                    pass

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close(linger=0)
        self.auth.stop()
        self.ctx.destroy(linger=0)


def test_a_workers_refusal_reaches_the_head_escaped(tmp_home: Path) -> None:
    evil = Refuser()
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
