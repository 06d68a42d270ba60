"""Issue 39 item 9's figure: how long SIGTERM takes to end a worker and its stage process, over
kills during replies and during slice transfers (the goal: 2 s at any moment; once, a worker
killed mid-reply never ended). Prints one JSON line per trial, then a summary.

    .venv/bin/python -m scripts.worker_kill_trials                   # 20 during replies, 20 during transfers
    .venv/bin/python -m scripts.worker_kill_trials --replies 5 --transfers 0 --seed 3

A trial starts two loopback workers, opens a chain over them, then either queues a burst of
single-token batches (what a replay after a loss sends: about 1 MB, far more than the stage
process's pipe holds) and waits a random 0-50 ms, or waits until a random share of a slice
has been sent; then SIGTERMs both workers at once and times each until it and every stage
process it had are gone (None past 15 s: wedged; its tree is then killed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from potluck.app.loopback import spawn_workers, stop_workers
from potluck.assets import default_model_path
from potluck.discovery.auth import generate_token, keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.lab.worker_kills import queue_burst, sigterm_and_time

LIMIT_S = 15.0
BURST = 1500


def reply_trial(folder: Path, token: str, cache: SliceCache, rng: random.Random) -> list[float | None]:
    workers = spawn_workers(folder, ["a", "b"], token)  # the same caches: slices are sent once
    try:
        target = open_pipeline(default_model_path(), [w.address for w in workers], keys_from_token(token),
                               n_ctx=2048, n_threads=1, slice_cache=cache, recover=False)
        try:
            target.decode(list(range(10, 40)))
            queue_burst(target, 200, 30, BURST)
            time.sleep(rng.uniform(0.0, 0.05))
            return sigterm_and_time([w.proc for w in workers], LIMIT_S)
        finally:
            target.close()
    finally:
        stop_workers([w.proc for w in workers])


def transfer_trial(folder: Path, token: str, i: int, rng: random.Random) -> list[float | None]:
    workers = spawn_workers(folder, [f"t{i}a", f"t{i}b"], token)  # fresh caches: the slices are sent
    at, sending = rng.uniform(0.1, 0.9), threading.Event()

    def progress(what: str, done: int, total: int) -> None:
        if total and done >= at * total:
            sending.set()

    def head() -> None:
        try:
            open_pipeline(default_model_path(), [w.address for w in workers], keys_from_token(token), n_ctx=256,
                          progress=progress, slice_cache=SliceCache(folder / f"head{i}"), recover=False).close()
        except Exception:  # the workers are stopped under it
            pass

    thread = threading.Thread(target=head, daemon=True)
    try:
        thread.start()
        if not sending.wait(120):
            raise RuntimeError("no slice was being sent")
        return sigterm_and_time([w.proc for w in workers], LIMIT_S)
    finally:
        thread.join(60)
        stop_workers([w.proc for w in workers])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=20, help="trials killing both workers during a reply")
    ap.add_argument("--transfers", type=int, default=20, help="trials killing both during a slice transfer")
    ap.add_argument("--seed", type=int, default=39)
    args = ap.parse_args()
    rng, token = random.Random(args.seed), generate_token()
    times: dict[str, list[float | None]] = {"reply": [], "transfer": []}
    with tempfile.TemporaryDirectory(prefix="potluck-kills-") as tmp:
        folder, cache = Path(tmp), SliceCache(Path(tmp) / "slices")
        for i in range(args.replies + args.transfers):
            moment = "reply" if i < args.replies else "transfer"
            got = reply_trial(folder, token, cache, rng) if moment == "reply" else transfer_trial(folder, token, i, rng)
            times[moment] += got
            print(json.dumps({"trial": i, "moment": moment, "seconds": got, "load": os.getloadavg()[0]}), flush=True)
    summary = {}
    for moment, got in times.items():
        ended = sorted(t for t in got if t is not None)
        summary[moment] = {
            "workers": len(got), "wedged": len(got) - len(ended), "over_2_s": sum(t > 2.0 for t in ended),
            "median_s": round(statistics.median(ended), 3) if ended else None,
            "max_s": round(ended[-1], 3) if ended else None,
        }
    print(json.dumps({"summary": summary}), flush=True)
    return 0 if all(s["wedged"] == 0 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
