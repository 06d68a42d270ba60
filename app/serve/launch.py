"""A `potluck serve` process on this machine's loopback, on a port the OS picks: the server of
the tests and of ``scripts/serve_bench.py`` (one way to start and stop it for both)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...engine import PotluckError

_LISTEN = re.compile(r"potluck serve: (http://[\d.:\[\]]+)/v1")
START_TIMEOUT_S = 120.0


@dataclass
class RunningServer:
    proc: subprocess.Popen
    base_url: str  # "http://127.0.0.1:PORT"
    log_path: Path
    api_key: str | None = None  # /health shows more than ready-or-not only to a key

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def health(self) -> dict[str, object]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(f"{self.base_url}/health", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def counters(self) -> dict[str, int]:
        """The engine thread's counters, from /health (shown to a key holder)."""
        return self.health()["counters"]  # type: ignore[return-value]


def start_server(home: Path, args: Sequence[str] = (), *, env: dict[str, str] | None = None,
                 timeout_s: float = START_TIMEOUT_S, api_key: str | None = None,
                 wrapper: Sequence[str] = ()) -> RunningServer:
    """Start ``potluck serve --port 0 ARGS`` with ``home`` as POTLUCK_HOME (its config.toml) and
    return once the model is loaded (/health "ready"); ``api_key``: one the server takes, for
    :meth:`RunningServer.health`; ``wrapper``: a command that runs it (``prlimit --nofile=256``)."""
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "serve.log"
    full_env = {**os.environ, "POTLUCK_HOME": str(home), **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*wrapper, sys.executable, "-m", "potluck.app.cli", "serve", "--port", "0", *args],
                                stdout=subprocess.DEVNULL, stderr=log, env=full_env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    base_url = None
    try:
        while time.monotonic() < deadline:
            text = log_path.read_text(encoding="utf-8", errors="replace")
            found = _LISTEN.search(text)
            base_url = base_url or (found.group(1) if found else None)
            if base_url and "potluck serve: ready" in text:
                return RunningServer(proc, base_url, log_path, api_key)
            if proc.poll() is not None:
                raise PotluckError(f"potluck serve exited ({proc.returncode}): {text.strip()[-500:]}")
            time.sleep(0.2)
        raise PotluckError(f"potluck serve was not ready within {timeout_s:g} s")
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGINT (uvicorn's graceful stop), then SIGKILL if it does not end in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
