"""Issue 39's flood figures (item 6): a worker's peak and settled memory, and its owner's
decoding speed, while token holders flood it as real attackers would. One JSON line per
scenario.

    .venv/bin/python -m scripts.flood_worker                          # every scenario, 20 s each
    .venv/bin/python -m scripts.flood_worker --scenarios owned-ids,connections --seconds 40
    .venv/bin/python -m scripts.flood_worker --worker-cpus 0 --flooder-cpus 1   # apart, as on a LAN

Each scenario starts a fresh worker (and its llama.cpp child: the tree's memory is measured),
makes this process its owner, then runs the flooders as processes of their own (each one
token holder) while the owner decodes one token at a time. Figures: idle (before the flood),
peak (sampled every 0.1 s), settled (30 s after), seconds until back within +200 MB and
+50 MB of idle, the owner's tokens/s quiet and during, and the worker's own counts (its log:
messages dropped, handshakes refused, connections cut off).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from potluck.app.loopback import running_worker
from potluck.assets import default_model_path
from potluck.discovery.auth import generate_token, keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.cluster.transport import client_socket, established_by_peer
from potluck.engine.core.spec import CurveKeys
from potluck.engine.lab.flood import FloodPlan, flood_process
from scripts.procfs import process_tree

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
N_CTX = 512
ALL_KINDS = ("ping", "pad", "status", "hello", "junk", "forward")
# name -> the flooders (one process each) of that scenario, for ``seconds``
SCENARIOS: dict[str, tuple[tuple[int, tuple[str, ...], str, str], ...]] = {
    "pings": ((4, ("ping",), "none", "never"),),  # issue 20's flood
    "owned-ids": ((4, ("ping",), "own", "never"),),  # issue 39: own routing ids, never reading
    "shared-id": ((4, ("ping",), "shared", "never"),),  # one routing id over every connection
    "slow-readers": ((4, ("ping", "pad", "status"), "own", "slow"),),  # issue 39: a slow reader
    "kinds": ((4, ALL_KINDS, "own", "never"),),  # every message kind
    "holders": (  # several token holders at once, each its own way
        (4, ALL_KINDS, "own", "never"), (4, ("ping", "status"), "shared", "slow"), (4, ("ping", "pad"), "none", "all"),
    ),
    "connections": (),  # 3,000 connections held open (the bound on connections: "sent" is the most open)
}


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


def hold_connections(keys: CurveKeys, address: str, n: int, seconds: float) -> int:
    """``n`` connections held open for ``seconds`` (refused ones retry, as libzmq does); the
    most TCP connections the worker had open at once meanwhile."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n + 64)
    port = int(address.rsplit(":", 1)[1])
    most = 0
    try:
        for _ in range(n):
            s = client_socket(ctx, keys)
            s.connect(f"tcp://{address}")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            most = max(most, sum((established_by_peer(port) or {}).values()))
            time.sleep(0.5)
        return most
    finally:
        ctx.destroy(linger=0)


def counts(log: str) -> dict[str, int]:
    """The worker's own counts, from its log lines."""
    def last(pattern: str) -> int:
        found = re.findall(pattern, log)
        return int(found[-1]) if found else 0

    return {
        "dropped": last(r"dropped (\d+) messages from peers past their budget"),
        "handshakes_refused": last(r"refused a handshake: .* \((\d+) refused so far\)"),
        "cut_off": last(r"\((\d+) cut off so far\)"),
        "refusal_lines": log.count("refused a message from"),
    }


def run(name: str, seconds: float, worker_cpus: set[int] | None, flooder_cpus: set[int] | None) -> dict:
    token = generate_token()
    keys = keys_from_token(token)
    with tempfile.TemporaryDirectory(prefix="potluck-flood-") as tmp, running_worker(
        Path(tmp), "flooded", token,
        preexec=(lambda: os.sched_setaffinity(0, worker_cpus)) if worker_cpus else None,
    ) as worker:
        target = open_pipeline(default_model_path(), [worker.address], keys, n_ctx=N_CTX, n_threads=1,
                               slice_cache=SliceCache(Path(tmp) / "slices"))
        try:
            target.decode(PROMPT)
            quiet = decode_for(target, 5.0)
            idle = tree_rss_mb(worker.proc.pid)
            done = threading.Event()
            samples: list[float] = []
            sent: list[int] = []

            def sample() -> None:
                while not done.is_set():
                    samples.append(tree_rss_mb(worker.proc.pid))
                    time.sleep(0.1)

            def flood() -> None:
                if name == "connections":
                    sent.append(hold_connections(keys, worker.address, 3000, seconds))
                    return
                procs = []
                for n, kinds, idents, reads in SCENARIOS[name]:
                    args, env = flood_process(worker.address, FloodPlan(n, seconds, kinds, idents, reads), keys)
                    procs.append(subprocess.Popen(
                        args, env=env, stdout=subprocess.PIPE, text=True,
                        preexec_fn=(lambda: os.sched_setaffinity(0, flooder_cpus)) if flooder_cpus else None))
                sent.extend(int((p.communicate()[0] or "0").strip() or 0) for p in procs)

            threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=flood, daemon=True)]
            for t in threads:
                t.start()
            stop = threading.Event()
            threading.Thread(target=lambda: (threads[1].join(), stop.set()), daemon=True).start()
            during = decode_for(target, seconds + 600, stop)
            done.set()
            t_end = time.monotonic()
            back_200 = back_50 = None
            settled = tree_rss_mb(worker.proc.pid)
            while time.monotonic() - t_end < 30:
                settled = tree_rss_mb(worker.proc.pid)
                if back_200 is None and settled - idle < 200:
                    back_200 = round(time.monotonic() - t_end, 1)
                if back_50 is None and settled - idle < 50:
                    back_50 = round(time.monotonic() - t_end, 1)
                if back_50 is not None:
                    break
                time.sleep(0.25)
            peak = max(samples, default=idle)
            report = {
                "scenario": name, "seconds": seconds, "sent": sent, "load": os.getloadavg()[0],
                "worker_cpus": sorted(worker_cpus) if worker_cpus else None,
                "idle_mb": round(idle, 1), "peak_mb": round(peak, 1), "peak_rise_mb": round(peak - idle, 1),
                "settled_mb": round(settled, 1), "back_within_200_mb_s": back_200, "back_within_50_mb_s": back_50,
                "owner_quiet_tok_s": round(quiet, 1), "owner_during_tok_s": round(during, 1),
                "owner_ratio": round(during / quiet, 2) if quiet else None,
                "worker_alive": worker.proc.poll() is None, **counts(worker.log()),
            }
        finally:
            target.close()
    return report


def main() -> int:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the connections scenario holds 3,000 sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 16, hard))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--worker-cpus", help="comma-separated cores for the worker and its child")
    ap.add_argument("--flooder-cpus", help="comma-separated cores for the flooding processes")
    args = ap.parse_args()
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            ap.error(f"no scenario {name!r}")
        print(json.dumps(run(name, args.seconds, cpus(args.worker_cpus), cpus(args.flooder_cpus))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
