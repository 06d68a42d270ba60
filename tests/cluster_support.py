"""Worker processes on loopback for the cluster tests (each fixture stops what it started).

Workers run ``potluck worker`` as real processes: 1 thread each, an OS-picked port on
127.0.0.1, zeroconf off or bound to 127.0.0.1 only (never another interface).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from potluck.app.loopback import spawn_worker, stop_worker

__all__ = ["TOKEN", "WorkerProc", "loopback_workers", "start_worker", "stop_worker"]

TOKEN = "potluck-test-token-0123456789abcdef"


@dataclass
class WorkerProc:
    proc: subprocess.Popen
    node_id: str
    address: str
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_worker(
    tmp: Path,
    name: str,
    *,
    token: str = TOKEN,
    zeroconf: bool = False,
    threads: int = 1,
    extra_args: Sequence[str] = (),
    preexec: Callable[[], None] | None = None,
) -> WorkerProc:
    proc, node_id, address, log_path = spawn_worker(
        tmp, name, token, threads=threads, zeroconf=zeroconf, extra_args=extra_args, preexec=preexec
    )
    return WorkerProc(proc, node_id, address, log_path)


def loopback_workers(tmp: Path, prefix: str, n: int = 3, **kw: object) -> Iterator[list[WorkerProc]]:
    """``n`` workers for a module fixture (``yield from``): stopped when it ends."""
    procs: list[WorkerProc] = []
    try:
        for i in range(n):
            procs.append(start_worker(tmp, f"{prefix}{i}", **kw))  # type: ignore[arg-type]
        yield procs
    finally:
        for w in procs:
            stop_worker(w.proc)
