"""llama.cpp's own tools as the scripts run them beside potluck: loopback ports and RPC servers
(tools built by ../shared/tools/build-llama-tools.sh)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# llama-bench's settings for like-for-like figures: potluck's cache type, flash attention on,
# no weight repacking (the AMX crash; docs/facts.md)
BENCH_ARGS = ["-fa", "on", "-ctk", "bf16", "-ctv", "bf16", "--repack", "0"]


def free_port() -> int:
    """A port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RpcServer:
    proc: subprocess.Popen
    port: int


@contextmanager
def rpc_servers(
    bin_dir: Path,
    n: int,
    *,
    extra: Sequence[str] = (),
    env: Callable[[int], dict[str, str] | None] = lambda _i: None,
    preexec: Callable[[int], Callable[[], object] | None] = lambda _i: None,
    deadline_s: float = 30.0,
) -> Iterator[list[RpcServer]]:
    """``n`` ``ggml-rpc-server -t 1`` bound to loopback, listening when this yields; ``env`` and
    ``preexec`` per server (a cache folder, a memory cgroup)."""
    servers: list[RpcServer] = []
    try:
        for i in range(n):
            port = free_port()
            proc = subprocess.Popen(
                [str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1", *extra],
                env=env(i), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=preexec(i),
            )
            servers.append(RpcServer(proc, port))
        for s in servers:
            deadline = time.monotonic() + deadline_s
            while socket.socket().connect_ex(("127.0.0.1", s.port)) != 0:
                if time.monotonic() > deadline:
                    raise SystemExit(f"ggml-rpc-server on port {s.port} did not listen within {deadline_s:g} s")
                time.sleep(0.2)
        yield servers
    finally:
        for s in servers:
            s.proc.terminate()
            s.proc.wait()


def rpc_addresses(servers: Sequence[RpcServer]) -> str:
    """``llama-bench --rpc``'s argument for these servers."""
    return ",".join(f"127.0.0.1:{s.port}" for s in servers)
