"""Token holders flooding a worker as a real attacker would (issue 20, finding 2; issue 39
item 6), shared by the trust tests and scripts/flood_worker.py.

A flood is several connections sending as fast as they go, each with:

- its routing id: none (the worker names the connection, as potluck's own sockets do), one of
  its own, or one id shared by every connection (libzmq once kept such a connection aside,
  unread, and let it pile up: +340 MB in 20 s);
- its reading: never (a receive queue of one message and a 4 kB socket buffer: the worker's
  replies back up, its connections reconnect under the same id), slowly (one reply every
  ``SLOW_READ_S``), or at once;
- several message kinds: pings, pings padded to ``PAD_BYTES``, status requests, hellos
  (refused as busy, or taking an idle worker), malformed frames, and pipeline traffic signed
  with no key the stage knows.

:func:`flood` runs one in this process; :func:`flood_process_args` is the command line of a
separate process (another token holder) running one.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import zmq

from ..cluster import wire
from ..cluster.transport import client_socket
from ..core.spec import CurveKeys

KINDS = ("ping", "pad", "status", "hello", "junk", "forward")
IDENTS = ("none", "own", "shared")
READS = ("never", "slow", "all")
PAD_BYTES = 1 << 20
SLOW_READ_S = 0.01
BURST = 50  # messages a connection sends before the next connection's turn


@dataclass(frozen=True)
class FloodPlan:
    """One flooder: ``sockets`` connections for ``seconds``, sending ``kinds`` in turn."""

    sockets: int = 4
    seconds: float = 12.0
    kinds: tuple[str, ...] = ("ping",)
    idents: str = "none"
    reads: str = "never"

    def __post_init__(self) -> None:
        if not set(self.kinds) <= set(KINDS) or self.idents not in IDENTS or self.reads not in READS:
            raise ValueError(f"a flood sends {KINDS}, with routing ids {IDENTS}, reading {READS}")

    def args(self) -> list[str]:
        """This plan as :mod:`scripts.flood_worker`'s options."""
        return ["--sockets", str(self.sockets), "--seconds", str(self.seconds), "--kinds", ",".join(self.kinds),
                "--idents", self.idents, "--reads", self.reads]


def _messages(kind: str) -> list[list]:
    """A few messages of ``kind``, as frames (sent in turn)."""
    key = os.urandom(32)
    if kind == "ping":
        return [wire.to_frames(wire.Ping(7))]
    if kind == "pad":
        return [wire.to_frames(wire.Ping(8, np.zeros(PAD_BYTES, np.uint8)))]
    if kind == "status":
        return [wire.to_frames(wire.Status())]
    if kind == "hello":
        return [wire.to_frames(wire.Hello("flooder", "0", key.hex()), key)]
    if kind == "junk":
        return [[wire.MAGIC, b"{not json"], [b"potluck/0"], [wire.MAGIC, b'{"type":"ping","f":{}}', b"x" * 512]]
    job = np.ones(4, np.int32)
    fwd = wire.Forward(1, 1, False, job, np.arange(4, dtype=np.int32), np.zeros(4, np.int32), np.ones(4, np.uint8))
    return [wire.to_frames(fwd, key), wire.to_frames(wire.KvApply(1, 0, "rm", 0, -1, 0, -1, 0), key)]


def flood(keys: CurveKeys, address: str, sockets: int, seconds: float, plan: FloodPlan | None = None) -> int:
    """Flood ``address`` as ``plan`` says (default: pings from ``sockets`` connections for
    ``seconds``, no routing id, never reading); the number of messages sent."""
    plan = plan or FloodPlan(sockets, seconds)
    ctx = zmq.Context()
    socks = []
    shared = os.urandom(8)
    for i in range(plan.sockets):
        ident = {"none": b"", "own": os.urandom(8) + bytes([i % 256]), "shared": shared}[plan.idents]
        s = client_socket(ctx, keys, ident)
        s.setsockopt(zmq.SNDHWM, 0)  # the attacker queues on its side: the worker decides
        if plan.reads != "all":
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(f"tcp://{address}")
        socks.append(s)
    batches = [m for kind in plan.kinds for m in _messages(kind)]
    sent = 0
    next_read = time.monotonic()
    try:
        end = time.monotonic() + plan.seconds
        while time.monotonic() < end:
            for s in socks:
                for i in range(BURST):
                    s.send_multipart(batches[(sent + i) % len(batches)], copy=False)
                sent += BURST
                if plan.reads == "all":
                    while s.poll(0):
                        s.recv_multipart(copy=False)
            if plan.reads == "slow" and time.monotonic() >= next_read:
                for s in socks:
                    if s.poll(0):
                        s.recv_multipart(copy=False)
                next_read = time.monotonic() + SLOW_READ_S
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
    return sent


KEYS_ENV = "POTLUCK_FLOOD_KEYS"  # a flooding process's CURVE keys (the engine never reads tokens)


def flood_process(address: str, plan: FloodPlan, keys: CurveKeys) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a separate flooding process (another token
    holder); it prints how many messages it sent."""
    env = dict(os.environ)
    env[KEYS_ENV] = b",".join((keys.server_public, keys.client_public, keys.client_secret)).decode()
    return [sys.executable, "-m", "potluck.engine.lab.flood", address, *plan.args()], env


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="flood a potluck worker as a token holder (issue 39 item 6)")
    ap.add_argument("address")
    ap.add_argument("--sockets", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--kinds", default="ping")
    ap.add_argument("--idents", default="none", choices=IDENTS)
    ap.add_argument("--reads", default="never", choices=READS)
    args = ap.parse_args(argv)
    plan = FloodPlan(args.sockets, args.seconds, tuple(args.kinds.split(",")), args.idents, args.reads)
    server_public, client_public, client_secret = os.environ[KEYS_ENV].encode().split(b",")
    keys = CurveKeys(server_public=server_public, server_secret=b"", client_public=client_public,
                     client_secret=client_secret)
    sent = flood(keys, args.address, plan.sockets, plan.seconds, plan)
    sys.stdout.write(f"{sent}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
