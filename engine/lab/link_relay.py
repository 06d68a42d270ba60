"""A TCP relay that gives a loopback link the delay and bandwidth of a real LAN.

This kernel has no ``netem`` or ``tbf`` queueing discipline (docs/facts.md §10), so a worker's
link is shaped in user space: the head connects to the relay, the relay to the worker, and
each direction is a queue whose bytes leave at the link's rate and arrive half its round
trip later (the serialization time of a chunk is paid before its propagation delay, as on a
wire). scripts/link_relay.py runs one from the command line (and checks it against a
measurement: ``--selftest``); :class:`RelayThread` runs one beside a test or a bench.

Profiles: ethernet = 0.2 ms round trip, 1 Gbit/s; wifi = 3 ms, 100 Mbit/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass

PROFILES = {"ethernet": (0.2, 1000.0), "wifi": (3.0, 100.0)}
READ_BYTES = 64 << 10
# most bytes in flight per direction: a few bandwidth-delay products, as a socket buffer would hold
QUEUE_CHUNKS = 64
SPIN_S = 0.0015


@dataclass(frozen=True)
class Link:
    rtt_ms: float
    mbit: float

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2e3

    @property
    def bytes_per_s(self) -> float:
        return self.mbit * 1e6 / 8


async def _shape(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    """Copy one direction: each chunk leaves when the wire is free and lands one_way_s later."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
    wire_free_at = 0.0

    async def deliver() -> None:
        while True:
            at, data = await queue.get()
            if not data:
                break
            # the event loop's timers are ms-grained (epoll): sleep to within 1.5 ms of the
            # delivery time, then yield until it comes (sub-ms delays of an Ethernet profile)
            if at - loop.time() > SPIN_S:
                await asyncio.sleep(at - loop.time() - SPIN_S)
            while loop.time() < at:
                await asyncio.sleep(0)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    task = asyncio.create_task(deliver())
    try:
        while data := await reader.read(READ_BYTES):
            wire_free_at = max(loop.time(), wire_free_at) + len(data) / link.bytes_per_s
            await queue.put((wire_free_at + link.one_way_s, data))
    finally:
        await queue.put((0.0, b""))
        with contextlib.suppress(OSError, ConnectionError):
            await task


async def _serve_one(client_r, client_w, target: tuple[str, int], link: Link) -> None:
    try:
        server_r, server_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.close()
        return
    try:
        await asyncio.gather(_shape(client_r, server_w, link), _shape(server_r, client_w, link))
    except (OSError, ConnectionError):
        pass
    finally:
        for w in (client_w, server_w):
            w.close()


async def relay(listen: tuple[str, int], target: tuple[str, int], link: Link) -> asyncio.Server:
    return await asyncio.start_server(lambda r, w: _serve_one(r, w, target, link), *listen)


class RelayThread:
    """A relay to ``target`` ("host:port") on its own event loop thread, listening on a free
    loopback port (:attr:`address`) until :meth:`close`."""

    def __init__(self, target: str, link: Link) -> None:
        host, _, port = target.rpartition(":")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="link-relay")
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            relay(("127.0.0.1", 0), (host, int(port)), link), self._loop
        ).result(10)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> RelayThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
