"""SIGTERM at any moment (issue 39 item 9), for tests/test_worker_stop.py and
scripts/worker_kill_trials.py: time how long a worker and its stage processes take to end.

Once, both workers of a chain killed together during a reply left one of them, and its
llama.cpp child, blocked forever writing to each other (~219 KB queued each way); it ignored
SIGTERM and SIGINT until ``kill -9``. The pipe fills when a stage has many batches queued: a
burst of single-token batches (:func:`queue_burst`, as a replay after a loss sends them)
fills it in milliseconds. Slice transfers are the other long moment: the worker writes and
hashes what it receives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from ..core.jobs import DecodeJob
from ..core.target import Target


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants that still run (zombies count as ended); [] once gone."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            children = [int(c) for task in Path(f"/proc/{p}/task").iterdir()
                        for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
        out.append(p)
        todo += children
    return out


def sigterm_and_time(workers: list[subprocess.Popen], limit_s: float) -> list[float | None]:
    """SIGTERM every worker at once; for each, the seconds until it and every stage process
    it had were gone, or None past ``limit_s`` (its tree is then killed)."""
    trees = {w.pid: process_tree(w.pid) for w in workers}
    t0 = time.monotonic()
    for w in workers:
        os.kill(w.pid, signal.SIGTERM)
    ended: dict[int, float] = {}
    while len(ended) < len(workers) and time.monotonic() - t0 < limit_s:
        for w in workers:
            if w.pid not in ended:
                w.poll()  # reap it: a zombie of ours is gone
                if not any(p in process_tree(p) for p in trees[w.pid]):
                    ended[w.pid] = time.monotonic() - t0
        time.sleep(0.005)
    for w in workers:
        if w.pid not in ended:
            for p in trees[w.pid]:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            w.wait(10)
    return [ended.get(w.pid) for w in workers]


def queue_burst(target: Target, first_token: int, n_past: int, n: int) -> int:
    """Queue ``n`` single-token batches after position ``n_past`` without waiting for any
    (what a replay sends at once); how many were queued before the chain failed."""
    queued = 0
    try:
        for i in range(n):
            target.submit(DecodeJob.tokens(1, [first_token + i % 50], n_past + i))
            queued += 1
    except Exception:  # the chain may fail under us: the workers are being stopped
        pass
    return queued
