"""Soak: chat through a 3-stage loopback pipeline while workers are killed and restarted.

    .venv/bin/python -m scripts.cluster_soak --minutes 60

Starts 3 loopback workers (1 thread each) and one head in this process, then chats for
``--minutes``: replies of up to 64 tokens, a new conversation whenever the context is
three quarters full. At random moments (mean ``--restart-every-s``) a random worker gets
SIGKILL or a SIGSTOP of a few seconds followed by SIGKILL, and a fresh worker process starts
in its place; the head recovers mid-reply and takes the new worker back in between replies.

Every 10 s the resident memory (VmRSS, Linux /proc) of the head and of each worker slot
(the worker process plus its llama.cpp child) is sampled. The report gives the peak per
process for each tenth of the run (bounded means the last tenths do not keep climbing) and
the counts of replies, recoveries and regroups. A reply that makes no progress for
``--hang-s`` seconds ends the run as a hang (exit status 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from potluck.app.loopback import LoopbackWorker, spawn_worker, stop_worker
from potluck.assets import default_model_path
from potluck.discovery.auth import generate_token, keys_from_token
from potluck.engine.cluster.head import PipelineTarget, open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.events import Finished, PlanChanged, TokenText
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from scripts.procfs import process_tree

N_CTX = 2048
MAX_NEW = 64
PROMPTS = [
    "Name three rivers and one fact about each.",
    "Write a short poem about autumn.",
    "Explain what a hash table is, briefly.",
    "Count from one to twelve in words.",
    "Give me two tips for learning to cook.",
]


def rss_mb(pid: int, descendants: bool = True) -> float:
    """Resident memory of ``pid`` (and its descendants), in MB (0 once it is gone)."""
    total = 0.0
    for p in process_tree(pid) if descendants else [pid]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except (OSError, ValueError):
            continue
    return total


class Cluster:
    """Three worker slots; a slot's process is replaced when the chaos thread strikes it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.lock = threading.Lock()
        self.token = generate_token()
        self.workers: list[LoopbackWorker] = [spawn_worker(tmp, f"w{i}", self.token) for i in range(3)]
        self.restarts = 0

    def addresses(self) -> list[str]:
        with self.lock:
            return [w.address for w in self.workers]

    def strike(self, rng: random.Random) -> str:
        i = rng.randrange(3)
        w = self.workers[i]
        how = rng.choice(["SIGKILL", "SIGSTOP"])
        if how == "SIGSTOP":
            os.kill(w.proc.pid, signal.SIGSTOP)
            time.sleep(rng.uniform(3.0, 8.0))  # frozen long enough to be declared lost
        os.kill(w.proc.pid, signal.SIGKILL)
        stop_worker(w.proc)
        fresh = spawn_worker(self.tmp, f"w{i}", self.token)  # same cache folder: slices stay
        with self.lock:
            self.workers[i] = fresh
            self.restarts += 1
        return f"{how} slot {i + 1}"

    def close(self) -> None:
        for w in self.workers:
            if w.alive():
                os.kill(w.proc.pid, signal.SIGCONT)
            stop_worker(w.proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--restart-every-s", type=float, default=90.0, help="mean time between worker restarts")
    ap.add_argument("--hang-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR)
    rng = random.Random(args.seed)
    end = time.monotonic() + args.minutes * 60
    samples: list[tuple[float, float, list[float]]] = []  # (t, head MB, [slot MB])
    counts = {"replies": 0, "tokens": 0, "plan_changes": 0}
    last_progress = [time.monotonic()]
    hang = threading.Event()
    stop = threading.Event()

    with Model(default_model_path(), vocab_only=True) as model, tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        cluster = Cluster(tmp)
        target: PipelineTarget | None = None
        t0 = time.monotonic()

        def sampler() -> None:
            while not stop.wait(10.0):
                with cluster.lock:
                    pids = [w.proc.pid for w in cluster.workers]
                head_mb = rss_mb(os.getpid(), descendants=False)
                samples.append((time.monotonic() - t0, head_mb, [rss_mb(p) for p in pids]))
                if time.monotonic() - last_progress[0] > args.hang_s:
                    hang.set()
                    os.kill(os.getpid(), signal.SIGINT)  # break the chat loop out of a blocking wait

        def chaos() -> None:
            while not stop.wait(rng.expovariate(1.0 / args.restart_every_s)):
                print(f"  [{time.monotonic() - t0:7.1f} s] {cluster.strike(rng)}", flush=True)

        threads = [threading.Thread(target=sampler, daemon=True), threading.Thread(target=chaos, daemon=True)]
        try:
            target = open_pipeline(default_model_path(), cluster.addresses(), keys_from_token(cluster.token),
                                   n_ctx=N_CTX, split=[0, 10, 20, 30], slice_cache=SliceCache(tmp / "slices"),
                                   candidates=cluster.addresses)
            session = Session(model, target, Plain())
            for t in threads:
                t.start()
            n = 0
            while time.monotonic() < end:
                if session.conversation_tokens > 0.75 * N_CTX:
                    session.load_messages([])  # a new conversation
                for ev in session.generate(PROMPTS[n % len(PROMPTS)], SamplingParams(), MAX_NEW):
                    last_progress[0] = time.monotonic()
                    if isinstance(ev, TokenText):
                        counts["tokens"] += len(ev.token_ids)
                    elif isinstance(ev, PlanChanged):
                        counts["plan_changes"] += 1
                        print(f"  [{time.monotonic() - t0:7.1f} s] plan changed: {ev.reason}", flush=True)
                    elif isinstance(ev, Finished):
                        counts["replies"] += 1
                n += 1
        except KeyboardInterrupt:
            if not hang.is_set():
                raise
        finally:
            stop.set()
            recoveries = target.recoveries if target is not None else 0
            if target is not None:
                target.close()
            cluster.close()

    print()
    print(f"soak: {args.minutes:g} min, {counts['replies']} replies, {counts['tokens']} tokens, "
          f"{cluster.restarts} worker restarts, {recoveries} recoveries, {counts['plan_changes']} plan changes"
          + (f"; HANG: no progress for {args.hang_s:.0f} s" if hang.is_set() else "; no hang"))
    if samples:
        tenth = max(1, len(samples) // 10)
        print("peak resident memory (MB) per tenth of the run: head | worker slot 1, 2, 3 (with llama.cpp child)")
        for i in range(0, len(samples), tenth):
            part = samples[i : i + tenth]
            head = max(s[1] for s in part)
            slots = [max(s[2][k] for s in part) for k in range(3)]
            print(f"  {part[0][0] / 60:5.1f}-{part[-1][0] / 60:5.1f} min: {head:7.1f} | "
                  + ", ".join(f"{m:7.1f}" for m in slots))
    return 1 if hang.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
