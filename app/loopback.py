"""`potluck worker` processes on this machine's loopback: the cluster bench's stages, and the
workers of the tests and of the soak, trial and simulator scripts (one way to start and stop
them for all). Real processes that only ever listen on 127.0.0.1."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..engine import PotluckError

_LISTEN = re.compile(r"potluck worker (\w+) listening on ([\d.]+|<this-machine>):(\d+)")
START_TIMEOUT_S = 60.0


@dataclass
class LoopbackWorker:
    """A started worker: its process, the node id it reported, where it listens, its log."""

    proc: subprocess.Popen
    node_id: str
    address: str  # "127.0.0.1:port"
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None


def spawn_worker(
    folder: Path,
    name: str,
    token: str,
    *,
    threads: int = 1,
    zeroconf: bool = False,
    extra_args: Sequence[str] = (),
    preexec: Callable[[], None] | None = None,
) -> LoopbackWorker:
    """Start one worker with its own home and slice cache under ``folder``; returns once it
    listens. Zeroconf, if on, is bound to loopback only."""
    return spawn_workers(
        folder, [name], token, threads=threads, zeroconf=zeroconf, extra_args=extra_args, preexec=preexec
    )[0]


def spawn_workers(
    folder: Path,
    names: Sequence[str],
    token: str,
    *,
    threads: int = 1,
    zeroconf: bool = False,
    extra_args: Sequence[str] = (),
    preexec: Callable[[], None] | None = None,
) -> list[LoopbackWorker]:
    """Start one worker per name at once (each takes seconds to import and start its
    llama.cpp child), then wait until every one listens; if one fails, none is left running."""
    folder.mkdir(parents=True, exist_ok=True)
    started = [_launch(folder, name, token, threads, zeroconf, extra_args, preexec) for name in names]
    try:
        return [_listening(proc, log_path) for proc, log_path in started]
    except BaseException:
        stop_workers([proc for proc, _ in started])
        raise


def _launch(
    folder: Path, name: str, token: str, threads: int, zeroconf: bool, extra_args: Sequence[str],
    preexec: Callable[[], None] | None,
) -> tuple[subprocess.Popen, Path]:
    log_path = folder / f"{name}.log"
    args = [
        sys.executable, "-m", "potluck.app.cli", "worker", "--port", "0", "--bind", "127.0.0.1",
        "--threads", str(threads), "--cache-dir", str(folder / f"{name}-cache"),
        *(["--zeroconf-interface", "127.0.0.1"] if zeroconf else ["--no-zeroconf"]),
        *extra_args,
    ]
    # the token travels in the environment, never on the command line (`ps` shows those)
    env = dict(os.environ, POTLUCK_HOME=str(folder / f"{name}-home"), PYTHONUNBUFFERED="1", POTLUCK_TOKEN=token)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log_file, env=env, preexec_fn=preexec)
    return proc, log_path


def _listening(proc: subprocess.Popen, log_path: Path) -> LoopbackWorker:
    """The worker once it printed where it listens (PotluckError if it never does)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    line = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            m = _LISTEN.search(line.decode(errors="replace"))
            if m:
                host = "127.0.0.1" if m.group(2) == "<this-machine>" else m.group(2)  # bound to every interface
                return LoopbackWorker(proc, m.group(1), f"{host}:{m.group(3)}", log_path)
        if proc.poll() is not None:
            break
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [line.decode(errors="replace")]
    raise PotluckError(f"a loopback worker did not start: {tail[0]}")


@contextmanager
def running_worker(
    folder: Path, name: str, token: str, *, extra_args: Sequence[str] = (), preexec: Callable[[], None] | None = None
) -> Iterator[LoopbackWorker]:
    """:func:`spawn_worker`, stopped when the block ends."""
    worker = spawn_worker(folder, name, token, extra_args=extra_args, preexec=preexec)
    try:
        yield worker
    finally:
        stop_worker(worker.proc)


def stop_worker(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    stop_workers([proc], timeout)


def stop_workers(procs: Sequence[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM to every worker first, then wait for each (a worker takes seconds to wind
    down its llama.cpp child: stopping several one by one would add those up)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
        if proc.stdout is not None:
            proc.stdout.close()
