"""Issue 20's flood figures: a worker's peak memory, and its owner's decoding speed, while a
token holder pings it from several sockets without reading the replies. Prints one JSON line.

    .venv/bin/python -m scripts.flood_worker --sockets 4 --seconds 60
    .venv/bin/python -m scripts.flood_worker --worker-cpus 0 --flooder-cpus 1   # apart, as on a LAN

The worker (and its llama.cpp child) and the flooder run as separate processes, so
``--worker-cpus``/``--flooder-cpus`` can keep them off each other's cores; the head (this
process) decodes one token at a time as the worker's owner throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from potluck.app.loopback import running_worker
from potluck.assets import default_model_path
from potluck.discovery.auth import generate_token, keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.lab.flood import flood
from scripts.procfs import process_tree

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
N_CTX = 512


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (the worker and its llama.cpp child)."""
    kb = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    kb += int(line.split()[1])
        except OSError:
            pass
    return kb / 1024


def cpus(text: str | None) -> set[int] | None:
    return {int(c) for c in text.split(",")} if text else None


def decode_for(target, seconds: float, stop: threading.Event | None = None) -> float:  # type: ignore[no-untyped-def]
    """Single-token steps as the owner for ``seconds`` (or until ``stop``); tokens a second."""
    n, t0 = 0, time.monotonic()
    tok = 7
    while time.monotonic() - t0 < seconds and not (stop and stop.is_set()):
        if target.n_past >= N_CTX - 4:
            target.truncate(len(PROMPT))
        tok = int(target.decode([tok])[0].argmax())
        n += 1
    return n / (time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sockets", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--quiet-seconds", type=float, default=10.0)
    ap.add_argument("--worker-cpus", help="comma-separated cores for the worker and its child")
    ap.add_argument("--flooder-cpus", help="comma-separated cores for the flooding process")
    ap.add_argument("--flood-only", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood_only:  # the flooder process: the token comes in the environment
        keys = keys_from_token(os.environ["POTLUCK_TOKEN"])
        print(flood(keys, args.flood_only, args.sockets, args.seconds), flush=True)
        return 0

    token = generate_token()
    keys = keys_from_token(token)
    worker_cpus, flooder_cpus = cpus(args.worker_cpus), cpus(args.flooder_cpus)
    with tempfile.TemporaryDirectory(prefix="potluck-flood-") as tmp, running_worker(
        Path(tmp), "flooded", token,
        preexec=(lambda: os.sched_setaffinity(0, worker_cpus)) if worker_cpus else None,
    ) as worker:
        target = open_pipeline(default_model_path(), [worker.address], keys, n_ctx=N_CTX, n_threads=1,
                               slice_cache=SliceCache(Path(tmp) / "slices"))
        try:
            target.decode(PROMPT)
            quiet = decode_for(target, args.quiet_seconds)
            before = tree_rss_mb(worker.proc.pid)
            flooder = subprocess.Popen(
                [sys.executable, "-m", "scripts.flood_worker", "--flood-only", worker.address,
                 "--sockets", str(args.sockets), "--seconds", str(args.seconds)],
                env=dict(os.environ, POTLUCK_TOKEN=token), stdout=subprocess.PIPE, text=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, flooder_cpus)) if flooder_cpus else None,
            )
            samples: list[float] = []
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    samples.append(tree_rss_mb(worker.proc.pid))
                    time.sleep(0.1)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            watcher = threading.Thread(target=lambda: (flooder.wait(), done.set()), daemon=True)
            watcher.start()
            during = decode_for(target, args.seconds + 30, done)
            sent = int((flooder.stdout.read() or "0").strip() or 0)  # type: ignore[union-attr]
            sampler.join()
            t_end = time.monotonic()
            after = tree_rss_mb(worker.proc.pid)
            while after - before > 50 and time.monotonic() - t_end < 60:
                time.sleep(0.5)
                after = tree_rss_mb(worker.proc.pid)
            report = {
                "sockets": args.sockets, "seconds": args.seconds, "pings_sent": sent,
                "worker_cpus": args.worker_cpus, "flooder_cpus": args.flooder_cpus,
                "rss_before_mb": round(before, 1), "rss_peak_mb": round(max(samples, default=before), 1),
                "peak_rise_mb": round(max(samples, default=before) - before, 1),
                "rss_median_during_mb": round(statistics.median(samples), 1) if samples else None,
                "rss_after_mb": round(after, 1), "fell_back_within_s": round(time.monotonic() - t_end, 1),
                "owner_quiet_tok_s": round(quiet, 1), "owner_during_tok_s": round(during, 1),
                "owner_ratio": round(during / quiet, 2) if quiet else None,
                "dropped_logged": "past their budget" in worker.log_path.read_text(errors="replace"),
                "worker_alive": worker.proc.poll() is None,
            }
        finally:
            target.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
