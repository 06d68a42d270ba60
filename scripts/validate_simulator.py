"""Check `potluck simulate` against real loopback pipelines (a script: timings never go in tests).

    .venv/bin/python -m scripts.validate_simulator [--reps 2] [--max-tokens 96]

Run it on a quiet machine. It measures this machine's per-token cost and batch-cost curve
with one thread (`potluck perf`), starts 3 loopback workers (1 thread each), runs the
cluster bench on 2 and 3 of them (the synchronous pipeline, `anpd` over it and
`pipeinfer`), and simulates the same pipelines: the head's share of the model
(``HEAD_SHARE``) on the head, the rest split evenly over the stages, all sharing this
machine's cores (``cores``), the per-hop cost fitted to the measured synchronous pipeline
(one figure), the acceptance rate and the share of positions with no guess taken from the
measured pipeinfer run. The other speeds are then predictions; the table prints each
against its measurement.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from potluck.app.loopback import spawn_worker, stop_worker
from potluck.assets import default_model_path
from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster_bench import SYNC, ClusterBenchConfig, ClusterRow, run_cluster_bench
from potluck.engine.perf import measure
from potluck.engine.runtime import Model
from potluck.engine.simulate import PerfTiming, fit_latency, simulate

# measured variant -> the simulator's strategy that models it
MODELLED = {SYNC: "iterative", "anpd": "speculative", "pipeinfer": "pipeinfer"}
# the head's share of a token's compute: the workers hold every layer but the last, the head
# computes the last layer and the output layer. SmolLM2-135M: output matrix 49152x576 ≈ 28M
# MACs + one layer ≈ 3.5M, of ≈ 134M per token
HEAD_SHARE = 0.235


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--families", default="code_editing,chat")
    args = ap.parse_args()
    path = default_model_path()
    with Model(path) as model:
        report = measure(model, n_threads=1, runs=3)
    perf = PerfTiming.from_report({**asdict(report), "batch_cost": report.batch_cost})
    print(f"one thread: {perf.model_ms:.2f} ms a token; batch cost {dict(perf.batch_cost)}")
    token = secrets.token_urlsafe(32)
    folder = Path(tempfile.mkdtemp(prefix="potluck-validate-"))
    procs = [spawn_worker(folder, f"w{i}", token) for i in range(3)]
    try:
        print(f"{'stages':>6} {'family':<13} {'variant':<10} {'measured':>9} {'simulated':>10} {'error':>7}"
              f"  {'accept':>6} {'no guess':>8}")
        for n in (2, 3):
            cfg = ClusterBenchConfig(families=tuple(args.families.split(",")), reps=args.reps,
                                     max_tokens=args.max_tokens, only=("anpd", "pipeinfer"),
                                     options={"adaptive": False})  # the model has no floor
            rows = run_cluster_bench(cfg, [p[2] for p in procs[:n]], keys_from_token(token))
            for fam in cfg.families:
                by = {r.variant: r for r in rows if r.family == fam}
                report_family(n, fam, by, perf, args.max_tokens)
    finally:
        for proc, *_ in procs:
            stop_worker(proc)
        shutil.rmtree(folder, ignore_errors=True)


def report_family(n: int, fam: str, by: dict[str, ClusterRow], perf: PerfTiming, tokens: int) -> None:
    pi = by["pipeinfer"]
    alpha = pi.acceptance_rate or 0.0
    # positions the target judged a guess at, per generated token: the rest had none
    p_none = min(0.99, max(0.0, 1.0 - (pi.judged_per_token or 0.0)))
    # the workers and the head share this machine's cores (1 thread each)
    base = replace(perf.config(n), stage_ms=(perf.model_ms * (1 - HEAD_SHARE) / n,) * n,
                   head_ms=perf.model_ms * HEAD_SHARE, cores=os.cpu_count() or 1, alpha=alpha, p_none=p_none,
                   tokens=tokens, seeds=5, strategies=tuple(MODELLED.values()))
    sim = simulate(fit_latency(base, by[SYNC].tokens_per_s))["results"]
    for variant, name in MODELLED.items():
        measured, predicted = by[variant].tokens_per_s, sim[name]["tok_s"]
        err = (predicted - measured) / measured if measured else float("nan")
        print(f"{n:>6} {fam:<13} {variant:<10} {measured:>9.1f} {predicted:>10.1f} {err:>+7.0%}"
              f"  {alpha:>6.2f} {p_none:>8.2f}" + ("  (fitted)" if variant == SYNC else ""))


if __name__ == "__main__":
    main()
