"""Check `potluck simulate` against real loopback pipelines (a script: timings never go in tests).

    .venv/bin/python -m scripts.validate_simulator [--reps 2] [--max-tokens 96]

Run it on a quiet machine. It measures this machine's per-token cost and batch-cost curve
with one thread (`potluck perf`), starts 3 loopback workers (1 thread each), runs the
cluster bench on 2 and 3 of them (the synchronous pipeline, `anpd` over it and
`pipeinfer`, both drafting without the floor, anpd 4 tokens at a time as the model does),
and simulates the same pipelines: the head's share of the model (``HEAD_SHARE``) on the
head, the rest split evenly over the stages, all sharing this machine's cores (``cores``).

What a message costs is measured, not fitted: one synchronous reply is decoded while the
workers' CPU time (each worker and its llama.cpp process, from /proc) and the stages' busy
counters are read at its first and last token. A stage's busy time per job beyond its
share of the model is ``run_ms``; its CPU beyond its busy time, per job, is ``msg_ms`` (the
model burns it beside each message, at the head too); the head's output layer per run is
``head_ms``. The link latency is then fitted to the measured synchronous pipeline (one
figure), the acceptance rate and the share of positions with no guess taken from the
measured pipeinfer run. The other speeds are predictions; the table prints each against
its measurement. A second prediction fits nothing: its links are the ones the head timed at
join (half the median round trip one way, the slowest link's bandwidth; "sim. links").
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from potluck.app.loopback import spawn_workers, stop_workers
from potluck.assets import default_model_path
from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import PipelineTarget, open_pipeline
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.events import Finished, TokenText
from potluck.engine.core.runtime import Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import CurveKeys, EngineSpec
from potluck.engine.lab.benchmark import load_prompts
from potluck.engine.lab.cluster_bench import SYNC, ClusterBenchConfig, ClusterRow, run_cluster_bench
from potluck.engine.lab.perf import measure
from potluck.engine.lab.sim_config import PerfTiming, SimConfig
from potluck.engine.lab.simulate import fit_latency, simulate
from potluck.engine.speculation.strategies.registry import get_strategy_class
from scripts.procfs import process_tree

# measured variant -> the simulator's strategy that models it
MODELLED = {SYNC: "iterative", "anpd": "speculative", "pipeinfer": "pipeinfer"}
# the head's share of a token's compute: the workers hold every layer but the last, the head
# computes the last layer and the output layer. SmolLM2-135M: output matrix 49152x576 ≈ 28M
# MACs + one layer ≈ 3.5M, of ≈ 134M per token
HEAD_SHARE = 0.235
K = 4  # anpd's draft length, fixed, as the model's speculative policy drafts


@dataclass(frozen=True)
class Overheads:
    """Per-message work measured on a synchronous reply (ms)."""

    run_ms: float  # a stage's busy time per job beyond its share of the model
    msg_ms: float  # a worker's CPU per job beyond its busy time (sockets, the pipe, Python)
    head_ms: float  # the head's output layer per run
    head_other_ms: float  # the head's other CPU per run (shown, not modelled beyond msg_ms)
    busy_per_job: tuple[float, ...]
    latency_ms: float = 0.0  # one way on a link: half the median round trip the head measured at join
    bandwidth_mbps: float = 0.0  # the slowest link's, as measured at join

    def apply(self, cfg: SimConfig) -> SimConfig:
        return replace(cfg, run_ms=self.run_ms, msg_ms=self.msg_ms, head_ms=self.head_ms)

    def measured_links(self, cfg: SimConfig) -> SimConfig:
        """``cfg`` with the links the head timed at join, instead of a fitted latency."""
        return replace(cfg, latency_ms=self.latency_ms, bandwidth_mbps=self.bandwidth_mbps)


def tree_cpu_ms(pid: int) -> float:
    """User + system CPU time of a process and all its descendants, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) * 1e3 / tick
    return total


def measure_overheads(
    model: Model, pipeline: PipelineTarget, pids: list[int], stage_ms: float, tokens: int
) -> Overheads:
    """Decode one reply synchronously; read CPU and counters at its first and last token."""
    strategy = get_strategy_class("plain").build(model, EngineSpec(strategy="plain", n_ctx=2048))
    session = Session(model, pipeline, strategy)
    marks = []

    def mark() -> tuple:
        st = pipeline.status()
        return ([tree_cpu_ms(p) for p in pids], [s.busy_ms for s in st],
                [s.finished + s.aborted + s.skipped for s in st], time.process_time() * 1e3,
                pipeline.tail.runner.counters.busy_s * 1e3, pipeline.stats.batches)

    pipeline.reset()
    for ev in session.generate(load_prompts("code_editing")[0], SamplingParams(), tokens):
        if (isinstance(ev, TokenText) and not marks) or isinstance(ev, Finished):
            marks.append(mark())
    (cpu0, busy0, jobs0, head0, tail0, runs0), (cpu1, busy1, jobs1, head1, tail1, runs1) = marks
    jobs = [b - a for a, b in zip(jobs0, jobs1)]
    busy = [(b - a) / j for a, b, j in zip(busy0, busy1, jobs)]
    msg = [((c1 - c0) - (b1 - b0)) / j for c0, c1, b0, b1, j in zip(cpu0, cpu1, busy0, busy1, jobs)]
    runs = runs1 - runs0
    msg_ms = max(0.0, sum(msg) / len(msg))
    head_ms = (tail1 - tail0) / runs
    return Overheads(
        run_ms=max(0.0, sum(busy) / len(busy) - stage_ms), msg_ms=msg_ms, head_ms=head_ms,
        head_other_ms=(head1 - head0 - (tail1 - tail0)) / runs, busy_per_job=tuple(busy),
    )


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
    procs = spawn_workers(folder, [f"w{i}" for i in range(3)], token)
    try:
        print(f"{'stages':>6} {'family':<13} {'variant':<10} {'measured':>9} {'simulated':>10} {'error':>7}"
              f"  {'accept':>6} {'no guess':>8} {'sim. links':>11} {'error':>7}")
        keys = keys_from_token(token)
        for n in (2, 3):
            addresses = [p.address for p in procs[:n]]
            over = calibrate(path, addresses, keys, [p.proc.pid for p in procs[:n]], perf, n, args.max_tokens)
            cfg = ClusterBenchConfig(families=tuple(args.families.split(",")), reps=args.reps,
                                     max_tokens=args.max_tokens, only=("anpd", "pipeinfer"),
                                     options={"adaptive": False, "max_draft": K})  # the model has no floor
            rows = run_cluster_bench(cfg, addresses, keys)
            for fam in cfg.families:
                by = {r.variant: r for r in rows if r.family == fam}
                report_family(n, fam, by, perf, over, args.max_tokens)
    finally:
        stop_workers([p.proc for p in procs])
        shutil.rmtree(folder, ignore_errors=True)


def stage_ms(perf: PerfTiming, n: int) -> float:
    return perf.model_ms * (1 - HEAD_SHARE) / n


def calibrate(
    path: Path, addresses: list[str], keys: CurveKeys, pids: list[int], perf: PerfTiming, n: int, tokens: int
) -> Overheads:
    with Model(path) as model:
        pipeline = open_pipeline(path, addresses, keys, n_ctx=2048)
        try:
            over = measure_overheads(model, pipeline, pids, stage_ms(perf, n), tokens)
            nodes = [s.node for s in pipeline.plan.stages]
            over = replace(over, latency_ms=statistics.median(nd.rtt_ms for nd in nodes) / 2,
                           bandwidth_mbps=min(nd.mbps for nd in nodes))
        finally:
            pipeline.close()
    print(f"{n} stages, per job: stage busy {', '.join(f'{b:.2f}' for b in over.busy_per_job)} ms "
          f"(model share {stage_ms(perf, n):.2f}, so run_ms {over.run_ms:.2f}); msg_ms {over.msg_ms:.2f}; "
          f"head: output layer {over.head_ms:.2f} ms a run, other CPU {over.head_other_ms:.2f} ms a run; "
          f"links timed at join: {over.latency_ms:.3f} ms one way, {over.bandwidth_mbps:,.0f} Mbit/s")
    return over


def report_family(
    n: int, fam: str, by: dict[str, ClusterRow], perf: PerfTiming, over: Overheads, tokens: int
) -> None:
    pi = by["pipeinfer"]
    alpha = pi.acceptance_rate or 0.0
    # positions the target judged a guess at, per generated token: the rest had none
    p_none = min(0.99, max(0.0, 1.0 - (pi.judged_per_token or 0.0)))
    # the workers and the head share this machine's cores (1 thread each)
    base = replace(over.apply(perf.config(n)), stage_ms=(stage_ms(perf, n),) * n, k=K,
                   cores=os.cpu_count() or 1, alpha=alpha, p_none=p_none,
                   tokens=tokens, seeds=5, strategies=tuple(MODELLED.values()))
    timed = simulate(over.measured_links(base))["results"]  # no figure fitted: the join's link timings
    try:
        fitted: SimConfig | None = fit_latency(base, by[SYNC].tokens_per_s)
    except PotluckError as e:  # a measurement faster than the stages allow (a noisy machine)
        print(f"  (no latency fits {fam}: {e})")
        fitted = None
    sim = simulate(fitted)["results"] if fitted is not None else None
    for variant, name in MODELLED.items():
        measured, from_links = by[variant].tokens_per_s, timed[name]["tok_s"]
        predicted = sim[name]["tok_s"] if sim is not None else float("nan")
        err = (predicted - measured) / measured if measured else float("nan")
        err_links = (from_links - measured) / measured if measured else float("nan")
        note = f"  (fitted latency {fitted.latency_ms:.3f} ms)" if variant == SYNC and fitted is not None else ""
        print(f"{n:>6} {fam:<13} {variant:<10} {measured:>9.1f} {predicted:>10.1f} {err:>+7.0%}"
              f"  {alpha:>6.2f} {p_none:>8.2f} {from_links:>11.1f} {err_links:>+7.0%}" + note)


if __name__ == "__main__":
    main()
