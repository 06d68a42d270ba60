"""Worker processes on loopback for the cluster tests (each fixture stops what it started).

Workers run ``potluck worker`` as real processes: 1 thread each, an OS-picked port on
127.0.0.1, zeroconf off or bound to 127.0.0.1 only (never another interface).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from potluck.app.loopback import LoopbackWorker, spawn_worker, spawn_workers, stop_worker, stop_workers
from potluck.discovery.auth import generate_token

__all__ = [
    "JOIN_S", "TOKEN", "WorkerProc", "loopback_workers", "start_worker", "start_workers", "stop_worker", "stop_workers",
]

# A token of this run's own (as `potluck token` makes them): another test run on the same
# machine (its workers advertise on loopback too) cannot join ours, nor ours its.
TOKEN = generate_token()
# The join deadline of joins that must succeed: a busy CI machine has taken longer than the
# default 5 s (the deadline is the caller's: --join-timeout, [cluster] join_timeout_s).
JOIN_S = 60.0


@dataclass
class WorkerProc(LoopbackWorker):
    """A loopback worker plus the marks a test leaves on it (``extra["victim"]``...)."""

    extra: dict[str, str] = field(default_factory=dict)


def stage_pids(worker: LoopbackWorker) -> set[int]:
    """The worker's child processes: its stage processes (the loaded or kept one, a spare)."""
    return {int(pid) for task in Path(f"/proc/{worker.proc.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()}


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
    w = spawn_worker(tmp, name, token, threads=threads, zeroconf=zeroconf, extra_args=extra_args, preexec=preexec)
    return WorkerProc(w.proc, w.node_id, w.address, w.log_path)


def start_workers(tmp: Path, names: Sequence[str], *, token: str = TOKEN, zeroconf: bool = False) -> list[WorkerProc]:
    """One worker per name, started together (each takes seconds to start)."""
    return [WorkerProc(w.proc, w.node_id, w.address, w.log_path)
            for w in spawn_workers(tmp, names, token, zeroconf=zeroconf)]


def loopback_workers(
    tmp: Path, prefix: str, n: int = 3, *, token: str = TOKEN, zeroconf: bool = False
) -> Iterator[list[WorkerProc]]:
    """``n`` workers for a fixture (``yield from``), started together; stopped when it ends."""
    procs = start_workers(tmp, [f"{prefix}{i}" for i in range(n)], token=token, zeroconf=zeroconf)
    try:
        yield procs
    finally:
        stop_workers([w.proc for w in procs])
