"""Kill trials for cluster recovery (a script with a report, not a test).

    .venv/bin/python -m scripts.recovery_trials --trials 100

Starts 3 loopback workers (1 thread each). Each trial opens a 3-stage pipeline, runs a
two-turn conversation, and at a random moment (uniform over the conversation's measured
length) sends SIGKILL or SIGSTOP to a random worker. The head must re-plan over the other
two and finish with tokens identical to an uninterrupted run on one machine (greedy and
seeded sampling alternate). The victim is then replaced by a fresh worker process.

A trial whose signal landed after the conversation ended (nothing to recover) is reported
as missed and run again, so the report counts trials that really lost a node mid-run.
Exit status 0 only if every counted trial recovered with identical output.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from potluck.app.loopback import spawn_worker, stop_worker
from potluck.assets import default_model_path
from potluck.discovery.auth import generate_token, keys_from_token
from potluck.engine.cluster.head import PipelineTarget, open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.events import Finished, PlanChanged
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.target import LocalTarget, Target

N_CTX = 1024
MAX_NEW = 48
CONVERSATIONS = [
    ("Count from one to twenty in words.", "Now name five animals."),
    ("Write a haiku about the sea.", "Explain it in one sentence."),
    ("What is the capital of France?", "And of Italy? Answer briefly."),
]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=4321)]


@dataclass
class Trial:
    n: int
    signal: str
    victim_stage: int
    at_s: float
    identical: bool
    recoveries: int
    recover_s: float
    detail: str = ""


def converse(model: Model, target: Target, turns: tuple[str, ...], sampling: SamplingParams) -> tuple[list, list]:
    session = Session(model, target, Plain())
    replies, changes = [], []
    for turn in turns:
        for ev in session.generate(turn, sampling, MAX_NEW):
            if isinstance(ev, Finished):
                replies.append(ev.tokens)
            elif isinstance(ev, PlanChanged):
                changes.append(ev)
    return replies, changes


def reference(model: Model, turns: tuple[str, ...], sampling: SamplingParams) -> list:
    target = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    try:
        return converse(model, target, turns, sampling)[0]
    finally:
        target.close()


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.token = generate_token()
        self.workers = [spawn_worker(tmp, f"w{i}", self.token) for i in range(3)]

    def replace(self, i: int) -> None:
        w = self.workers[i]
        if w.alive():
            os.kill(w.proc.pid, signal.SIGCONT)
        stop_worker(w.proc)
        self.workers[i] = spawn_worker(self.tmp, f"w{i}", self.token)  # same cache: slices stay

    def close(self) -> None:
        for w in self.workers:
            if w.alive():
                os.kill(w.proc.pid, signal.SIGCONT)
            stop_worker(w.proc)


def open_three(model_path: Path, cluster: Cluster, cache: SliceCache) -> PipelineTarget:
    workers = cluster.workers
    return open_pipeline(model_path, [w.address for w in workers], keys_from_token(cluster.token), n_ctx=N_CTX,
                         split=[0, 10, 20, 30], slice_cache=cache)


def run_trial(n: int, rng: random.Random, model: Model, model_path: Path, cluster: Cluster, cache: SliceCache,
              refs: dict, lengths: dict) -> Trial | None:
    key = (n % len(CONVERSATIONS), (n // len(CONVERSATIONS)) % len(SAMPLINGS))
    turns, sampling = CONVERSATIONS[key[0]], SAMPLINGS[key[1]]
    sig_name = rng.choice(["SIGKILL", "SIGSTOP"])
    stage = rng.randrange(3)
    at_s = rng.uniform(0.0, lengths[key])
    target = open_three(model_path, cluster, cache)
    victim = next(w for w in cluster.workers if w.address == target.links[stage].address)
    timer = threading.Timer(at_s, lambda: os.kill(victim.proc.pid, getattr(signal, sig_name)))
    t0 = time.monotonic()
    try:
        timer.start()
        replies, changes = converse(model, target, turns, sampling)
        fired = time.monotonic() - t0 >= at_s
        recoveries = target.recoveries
        recover_s = max(target.recovery_s, default=0.0)
        assert len(changes) == recoveries, "every recovery is announced by a PlanChanged event"
    except Exception as e:  # a failed trial is reported, never hidden
        replies, changes, fired, recoveries, recover_s = [], [], True, target.recoveries, 0.0
        detail = f"{type(e).__name__}: {e}"
    else:
        detail = ""
    finally:
        timer.cancel()
        timer.join()
        target.close()
        cluster.replace(cluster.workers.index(victim))
    if not fired or (recoveries == 0 and not detail):
        return None  # the signal came after the conversation: nothing was lost mid-run
    identical = replies == refs[key]
    if not identical and not detail:
        detail = "output differs from the uninterrupted run"
    return Trial(n, sig_name, stage, at_s, identical and recoveries >= 1, recoveries, recover_s, detail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="seed of the trial schedule")
    ap.add_argument("-m", "--model", type=Path, default=None, help="GGUF (default: the bundled SmolLM2)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show the head's log (losses, new plans)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR)
    model_path = args.model or default_model_path()
    rng = random.Random(args.seed)
    trials: list[Trial] = []
    missed = 0
    with Model(model_path) as model, tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        cache = SliceCache(tmp / "slices")
        cluster = Cluster(tmp)
        try:
            refs, lengths = {}, {}
            for c in range(len(CONVERSATIONS)):
                for s in range(len(SAMPLINGS)):
                    refs[(c, s)] = reference(model, CONVERSATIONS[c], SAMPLINGS[s])
                    target = open_three(model_path, cluster, cache)
                    t0 = time.monotonic()
                    try:
                        out = converse(model, target, CONVERSATIONS[c], SAMPLINGS[s])[0]
                    finally:
                        target.close()
                    lengths[(c, s)] = time.monotonic() - t0
                    if out != refs[(c, s)]:
                        print(f"uninterrupted cluster run {c},{s} differs from one machine", file=sys.stderr)
                        return 1
            n = 0
            while len(trials) < args.trials:
                t = run_trial(n, rng, model, model_path, cluster, cache, refs, lengths)
                n += 1
                if t is None:
                    missed += 1
                    continue
                trials.append(t)
                mark = "ok  " if t.identical else "FAIL"
                print(f"{mark} trial {len(trials):3d}: {t.signal} stage {t.victim_stage + 1} at {t.at_s:5.2f} s, "
                      f"recovered in {t.recover_s:4.1f} s {t.detail}", flush=True)
        finally:
            cluster.close()
    ok = [t for t in trials if t.identical]
    print()
    print(f"recovery trials: {len(ok)}/{len(trials)} identical to an uninterrupted run "
          f"({missed} missed: signal after the conversation, re-run)")
    for sig in ("SIGKILL", "SIGSTOP"):
        of = [t for t in trials if t.signal == sig]
        print(f"  {sig}: {sum(t.identical for t in of)}/{len(of)}"
              + (f", recovery time median {statistics.median(t.recover_s for t in of):.1f} s, "
                 f"max {max(t.recover_s for t in of):.1f} s" if of else ""))
    for stage in range(3):
        of = [t for t in trials if t.victim_stage == stage]
        print(f"  stage {stage + 1} lost: {sum(t.identical for t in of)}/{len(of)}")
    for t in trials:
        if not t.identical:
            print(f"  failed trial {t.n}: {t.signal} stage {t.victim_stage + 1} at {t.at_s:.2f} s: {t.detail}")
    return 0 if len(ok) == len(trials) else 1


if __name__ == "__main__":
    sys.exit(main())
