"""A token holder's ping flood (issue 20, finding 2), shared by the trust test and
scripts/flood_worker.py: pings from several connections as fast as they go, never reading a
reply, so whatever the worker does not drop piles up in its memory."""

from __future__ import annotations

import time

import zmq

from ..cluster import wire
from ..cluster.transport import client_socket
from ..core.spec import CurveKeys


def flood(keys: CurveKeys, address: str, sockets: int, seconds: float) -> int:
    """Ping ``address`` from ``sockets`` connections for ``seconds``; the number of pings sent."""
    ctx = zmq.Context()
    socks = [client_socket(ctx, keys) for _ in range(sockets)]
    sent = 0
    try:
        for s in socks:
            s.setsockopt(zmq.SNDHWM, 0)  # the attacker queues on its side: the worker decides
            s.connect(f"tcp://{address}")
        ping = wire.to_frames(wire.Ping(1))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for s in socks:
                for _ in range(200):
                    s.send_multipart(ping, copy=False)
                sent += 200
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
    return sent
