"""A TCP relay that gives a loopback link the delay and bandwidth of a real LAN.

This kernel has no ``netem`` or ``tbf`` queueing discipline (docs/facts.md §10), so a worker's
link is shaped in user space: the head connects to the relay, the relay to the worker, and
each direction is a queue whose bytes leave at ``--mbit`` and arrive ``--rtt-ms / 2`` later
(the serialization time of a chunk is paid before its propagation delay, as on a wire).

    python -m scripts.link_relay --listen 127.0.0.1:6001 --to 127.0.0.1:5733 --profile ethernet
    python -m scripts.link_relay --listen 127.0.0.1:6002 --to 127.0.0.1:5734 --rtt-ms 3 --mbit 100
    python -m scripts.link_relay --selftest --profile wifi     # measure the relay against its settings

Profiles: ethernet = 0.2 ms round trip, 1 Gbit/s; wifi = 3 ms, 100 Mbit/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

from potluck.engine.lab.link_relay import PROFILES, READ_BYTES, Link, relay


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


async def _selftest(link: Link) -> None:
    """Ping-pong 1-byte messages and push 20 MB one way through the relay; print both."""

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(READ_BYTES):
            if data == b"?":
                w.write(b"!")
            else:
                sink[0] += len(data)
                if sink[0] >= bulk:
                    w.write(b"done")
            await w.drain()
        w.close()

    sink, bulk = [0], 20 << 20
    if link.bytes_per_s * 5 < bulk:
        bulk = int(link.bytes_per_s * 5)  # about 5 s at the configured rate
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    shaped = await relay(("127.0.0.1", 0), ("127.0.0.1", port), link)
    r, w = await asyncio.open_connection("127.0.0.1", shaped.sockets[0].getsockname()[1])
    rtts = []
    for _ in range(50):
        t0 = time.perf_counter()
        w.write(b"?")
        await w.drain()
        await r.readexactly(1)
        rtts.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    block = b"x" * (1 << 20)
    sent = 0
    while sent < bulk:
        n = min(len(block), bulk - sent)
        w.write(block[:n])
        await w.drain()
        sent += n
    await r.readexactly(4)
    seconds = time.perf_counter() - t0
    rtts.sort()
    print(f"configured: round trip {link.rtt_ms:g} ms, {link.mbit:g} Mbit/s")
    print(f"measured:   round trip median {rtts[len(rtts) // 2]:.2f} ms (min {rtts[0]:.2f}, max {rtts[-1]:.2f}) "
          f"over 50 pings; {bulk * 8 / seconds / 1e6:.0f} Mbit/s pushing {bulk >> 20} MB")
    w.close()
    await asyncio.sleep(0.2 + link.rtt_ms / 1e3)  # the EOF travels through the relay and closes it
    shaped.close()
    server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port the head connects to")
    p.add_argument("--to", help="host:port of the worker")
    p.add_argument("--profile", choices=sorted(PROFILES), help="ethernet (0.2 ms, 1 Gbit/s) or wifi (3 ms, 100 Mbit/s)")
    p.add_argument("--rtt-ms", type=float, help="round-trip delay added, in ms")
    p.add_argument("--mbit", type=float, help="rate of each direction, in Mbit/s")
    p.add_argument("--selftest", action="store_true", help="measure the relay's delay and rate, then exit")
    args = p.parse_args()
    rtt, mbit = PROFILES[args.profile] if args.profile else (0.0, 1e5)
    link = Link(args.rtt_ms if args.rtt_ms is not None else rtt, args.mbit if args.mbit is not None else mbit)
    if link.rtt_ms < 0 or link.mbit <= 0:
        p.error("--rtt-ms must be >= 0 and --mbit > 0")
    if args.selftest:
        asyncio.run(_selftest(link))
        return
    if not args.to:
        p.error("--to host:port is needed (or --selftest)")

    async def run() -> None:
        server = await relay(_addr(args.listen), _addr(args.to), link)
        host, port = server.sockets[0].getsockname()[:2]
        print(f"relay {host}:{port} -> {args.to}: round trip +{link.rtt_ms:g} ms, {link.mbit:g} Mbit/s", flush=True)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
