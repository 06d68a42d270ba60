"""Worker processes on loopback for the cluster tests (each fixture stops what it started).

Workers run ``potluck worker`` as real processes: 1 thread each, an OS-picked port on
127.0.0.1, zeroconf off or bound to 127.0.0.1 only (never another interface).
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TOKEN = "potluck-test-token-0123456789abcdef"
_LISTEN = re.compile(r"potluck worker (\w+) listening on ([\d.]+):(\d+)")


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
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = tmp / f"{name}.log"
    args = [
        sys.executable, "-m", "potluck.app.cli", "worker", "--port", "0", "--bind", "127.0.0.1",
        "--threads", str(threads), "--cache-dir", str(tmp / f"{name}-cache"),
        *(["--zeroconf-interface", "127.0.0.1"] if zeroconf else ["--no-zeroconf"]),
        *extra_args,
    ]
    # the token travels in the environment, never on the command line (`ps` shows those)
    env = dict(os.environ, POTLUCK_HOME=str(tmp / f"{name}-home"), PYTHONUNBUFFERED="1", POTLUCK_TOKEN=token)
    log_file = open(log_path, "wb")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log_file, env=env, preexec_fn=preexec)
    log_file.close()
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    line = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            m = _LISTEN.search(line.decode(errors="replace"))
            if m:
                return WorkerProc(proc, m.group(1), f"{m.group(2)}:{m.group(3)}", log_path)
        if proc.poll() is not None:
            break
    stop_worker(proc)
    raise RuntimeError(f"worker {name} did not start: {line!r} {log_path.read_text(errors='replace')}")


def stop_worker(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    if proc.stdout is not None:
        proc.stdout.close()
