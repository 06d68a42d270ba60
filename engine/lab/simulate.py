"""A discrete-event model of potluck's LAN pipeline, to compare ways of decoding on it.

Why a model: a real cluster of 32 nodes is not at hand, and on two loopback workers the
effects PipeInfer (Butler et al. 2024, §IV-V) relies on are small and noisy. The model
keeps only what decides the speed of one conversation on a pipeline:

- **Stages.** N stages in a chain, each computing one job at a time in FIFO order. A
  micro-batch of b tokens costs ``stage_ms[i] * cost(b)`` on stage i, where ``cost`` is a
  batch-cost curve relative to one token (docs/facts.md §6; interpolated linearly,
  extrapolated with its last slope).
- **Links.** head -> stage 1 -> ... -> stage N -> head. A message takes the link for
  ``bytes / bandwidth`` (one message at a time per link) and arrives ``latency_ms`` later.
  Every link carries the hidden state (``n_embd * 4`` bytes a token); the return link
  carries ``return_bytes`` a token (the hidden state when the head computes the output
  layer, ``vocab * 4`` when the last stage returns logits). The head's output layer costs
  ``head_ms * cost(b)`` per run, on its own runner (not the head loop).
- **Per-message work.** A stage's job also costs ``run_ms`` whatever its rows (the decode
  call's own work: building the batch and the graph, copying the hidden state out). Each
  message also burns ``msg_ms`` of CPU at its receiver, a stage or the head (a socket
  thread, the pipe to the worker's llama.cpp process, the encryption threads), empty and
  cancelled ones included. That CPU runs beside the message, not in its way: the delay a
  hop adds is ``latency_ms``. Only on shared cores does it slow anything, by taking cores
  from the computing stages: what makes many small runs dearer than few big ones there.
- **Head loop.** One thing at a time: drafting costs ``draft_ms`` a drafted token (0 for
  N-gram lookups), sampling/verifying ``sample_ms`` a run's result.
- **Acceptance.** Each drafted token is right with probability ``alpha``, independently;
  a chain of guesses holds up to its first wrong one. With probability ``p_none`` the
  drafter has no guess at all (N-gram tables often have none).
- **Cancellation.** The cancel message reaches every stage ``latency_ms`` after the head
  sends it. A stage that has not started the run skips it (``skip_ms``) and still passes
  an empty message on, so the order of messages holds; a stage computing it stops
  ``abort_ms`` after the cancel arrives (llama.cpp polls its abort flag coarsely,
  docs/facts.md §7).
- **Prompt.** ``prompt_tokens`` are prefilled in chunks of ``n_batch`` through the same
  pipeline. TTFT is the paper's (§V-A2): from the token sampled at the end of prefill to
  the next one decided; ``ttft_e2e_ms`` adds the prefill.

Every strategy is one :class:`Policy` of the same head loop (:func:`.sim_head.head_loop`), which is
the loop of ``engine/speculation/strategies/pipeinfer.py`` step for step; the other strategies are
that loop with parts switched off:

- ``iterative``: one token at a time (today's synchronous cluster decoding);
- ``speculative``: draft k, send the last token and the k guesses as one batch, wait
  (SpecInfer over the pipeline, the paper's baseline);
- ``pipelined``: the same batches kept in flight back to back, each built on the guesses
  of the earlier ones; no cancellation: after a rejection, later runs are computed and
  thrown away;
- ``pipeinfer``: the target's own token goes down alone as a non-speculative run, while
  micro-batches of 1-4 guesses keep the pipeline full under the confidence cutoff
  (a micro-batch's confidence is ``alpha ** len``, the chance all its tokens hold); runs
  built on a rejected guess are cancelled. Ablations: ``pipeinfer-nocancel``,
  ``pipeinfer-nocontinuous`` (one speculative run at a time, of ``max_draft`` tokens).

The confidence cutoff's counters are read three ways (``cutoff_rule``), because the paper's
words, its authors' code and potluck's module differ:

- ``paper`` (§IV-B2): ``iterations`` counts micro-batches sent since a run was accepted
  whole; ``declines`` counts times speculation was declined with no result waiting;
  both reset when a run is accepted whole;
- ``reference`` (the authors' ``examples/speculative/speculative.cpp``): ``iterations``
  counts the micro-batches of the current burst (from 0 each time the head comes back
  from sampling); ``declines`` resets whenever a token is accepted;
- ``code`` (``engine/speculation/strategies/pipeinfer.py``): ``iterations`` is the
  number of speculative runs in flight; ``declines`` resets when a round accepts guesses
  and ends on no token of the target's own; a cutoff above 1 stops speculation without
  counting a decline. This reading is the strategy's own :class:`Speculation` object (sends,
  room, bar, declines), and the two others subclass it (:mod:`.sim_head`).

The readings matter: under ``paper``, a burst whose first guess fails leaves the cutoff
above 1 until about 40 idle declines (decay 0.01) bring it down, so PipeInfer spends most
of its time one token at a time (``--trends --cutoff-rule paper``); under ``code`` with
the paper's recovery factor 0.4 at most 3 speculative runs fly at once, too few to fill
more than about 4 stages, which is why the strategy's default shrinks it on deep pipelines.

On one stage ``pipeinfer`` runs as ``speculative``, as the strategy module does.

**Shared cores** (``cores``, 0 by default). By default every stage and the head has its
own machine. Validating the model against loopback runs breaks that: on one machine the
worker processes and the head share its cores, and speculative micro-batches that keep
stages busy take cores from the critical path. With ``cores = N`` every computing
activity (a stage's job, the head's output layer for a run, its drafting and sampling)
shares N cores by processor sharing: while k compute at once each progresses at
``min(1, N / k)``. The engine keeps each activity's work left; when the rate changes it
brings them up to date and moves their finish events (the version that invalidates a
finish an abort moved). Iterative decoding never computes two things at once, so it is the
same with or without shared cores, unless the messages' CPU (``msg_ms``) runs beside a
stage on a single core; :func:`fit_latency` then bisects instead of solving.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..core.errors import PotluckError
from .sim_config import TREND_NODES, SimConfig
from .sim_engine import Engine
from .sim_head import Timeline, head_loop, policy


def _simulate_one(cfg: SimConfig, name: str, seed: int) -> dict[str, float | list[float]]:
    eng = Engine(cfg)
    timeline = Timeline()
    eng.run(head_loop(eng, policy(name, cfg), np.random.default_rng(seed), timeline))
    wall = timeline.end - timeline.prefill_end
    busy = [(b - b0) / wall for b, b0 in zip(eng.busy_until_now(), timeline.busy_at_prefill)]
    c = eng.counters
    return {
        "tok_s": cfg.tokens / wall * 1e3,
        "ttft_ms": timeline.first_after - timeline.prefill_end,
        "ttft_e2e_ms": timeline.first_after,
        "prefill_ms": timeline.prefill_end,
        "stage_busy": busy,
        # share of the time more activities computed than there were cores
        "contended": (eng.cores.contended_until_now() - timeline.contended_at_prefill) / wall,
        "runs": c.runs,
        "speculative_runs": c.speculative_runs,
        "cancelled": c.cancelled,
        "wasted": c.wasted,
        "skipped": c.skipped,
        "aborted": c.aborted,
        "drafted": c.drafted,
        "accepted": c.accepted,
        "declines": c.declines,
        "max_in_flight": c.max_in_flight,
        "max_computing": c.max_computing,
        "tokens_per_run": cfg.tokens / max(1, c.runs),
    }


def simulate(cfg: SimConfig) -> dict:
    """Every strategy of ``cfg`` over ``cfg.seeds`` seeds (the same seeds for each):
    means of the figures and counters, keyed by strategy, plus the config used."""
    cfg.check()
    results: dict[str, dict] = {}
    for name in cfg.strategies:
        per_seed = [_simulate_one(cfg, name, seed) for seed in range(cfg.seeds)]
        mean: dict[str, float | list[float]] = {}
        for key, first in per_seed[0].items():
            if isinstance(first, list):
                mean[key] = [float(np.mean([s[key][i] for s in per_seed])) for i in range(len(first))]
            else:
                mean[key] = float(np.mean([s[key] for s in per_seed]))
        mean["busy_mean"] = float(np.mean(mean["stage_busy"]))
        mean["acceptance"] = mean["accepted"] / mean["drafted"] if mean["drafted"] else 0.0
        results[name] = mean
    base = results.get("iterative")
    for r in results.values():
        r["speed_vs_iterative"] = r["tok_s"] / base["tok_s"] if base else None
    return {"config": asdict(cfg), "results": results}


def fit_latency(cfg: SimConfig, iterative_tok_s: float) -> SimConfig:
    """``cfg`` with the link latency that makes ``iterative`` decode at a measured speed.

    Real links cost more than the wire: each hop also pays for framing, a socket and a
    thread handoff. One measured figure (the synchronous pipeline's tokens/s) fixes that
    per-hop cost; the other strategies are then predictions. Iterative decoding's token
    time is closed form (every stage, every link and the head in turn) unless the
    messages' CPU shares too few cores with the computing: then the closed form's latency is
    refined by bisection on the simulated speed."""
    cfg.check()
    if not (iterative_tok_s > 0 and math.isfinite(iterative_tok_s)):
        raise PotluckError(f"simulate: the measured speed must be positive, got {iterative_tok_s}")
    n = cfg.n_stages
    wire_ms = (n * cfg.n_embd * 4 + (cfg.return_bytes or cfg.n_embd * 4)) * 8 / (cfg.bandwidth_mbps * 1e3)
    fixed_ms = sum(cfg.stage_ms) + n * cfg.run_ms + cfg.head_ms + cfg.sample_ms + wire_ms
    target_ms = 1000.0 / iterative_tok_s
    latency_ms = (target_ms - fixed_ms) / (n + 1)
    too_fast = PotluckError(
        f"simulate: {iterative_tok_s:g} tok/s is faster than the stages alone allow "
        f"({1000.0 / fixed_ms:.1f} tok/s): the stage times are too high for that measurement"
    )
    if latency_ms < 0:
        raise too_fast
    if not (cfg.msg_ms and cfg.cores):
        return replace(cfg, latency_ms=latency_ms).check()

    def token_ms(lat: float) -> float:
        c = replace(cfg, latency_ms=lat, strategies=("iterative",), seeds=1)
        return 1000.0 / simulate(c)["results"]["iterative"]["tok_s"]

    lo, hi = 0.0, latency_ms  # the messages' CPU only ever slows a token: the answer is below
    if token_ms(lo) > target_ms:
        raise too_fast
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if token_ms(mid) < target_ms else (lo, mid)
    return replace(cfg, latency_ms=(lo + hi) / 2).check()


@dataclass(frozen=True)
class TrendSetting:
    """The paper's setting for its trends (§V): a big target split evenly over N nodes
    (its per-token time fixed), a small draft, a gigabit LAN, a memory-bound batch curve
    (big models on many cores barely pay for more rows, docs/facts.md §6)."""

    model_ms: float = 200.0  # whole target, one token
    draft_ms: float = 6.0  # one drafted token (~1B draft for a 70B target)
    latency_ms: float = 1.0  # gigabit
    bandwidth_mbps: float = 880.0  # ~110 MB/s
    n_embd: int = 8192  # a 70B Llama
    batch_cost: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.05), (4, 1.15), (8, 1.4), (16, 2.0))
    high_alpha: float = 0.8
    low_alpha: float = 0.5
    slow_factor: float = 3.0  # one node that much slower
    nodes: tuple[int, ...] = TREND_NODES
    strategies: tuple[str, ...] = ("iterative", "speculative", "pipelined", "pipeinfer")


def trend_config(base: SimConfig, setting: TrendSetting, nodes: int, alpha: float, slow: bool) -> SimConfig:
    stage = setting.model_ms / nodes
    stage_ms = [stage] * nodes
    if slow:
        stage_ms[nodes // 2] *= setting.slow_factor
    return replace(
        base, stage_ms=tuple(stage_ms), draft_ms=setting.draft_ms, latency_ms=setting.latency_ms,
        bandwidth_mbps=setting.bandwidth_mbps, n_embd=setting.n_embd, return_bytes=0,
        batch_cost=setting.batch_cost, alpha=alpha, strategies=setting.strategies,
        max_runs=0,
    )


def trends(base: SimConfig, setting: TrendSetting = TrendSetting()) -> dict:
    """The paper's trend figures: (a) tok/s against nodes at high and low acceptance,
    (b) with one node ``slow_factor`` slower, (c) TTFT against nodes (high acceptance).
    Each figure maps strategy -> one value per node count."""
    figures: dict[str, dict[str, list[float]]] = {}
    for key, alpha, slow in (("high", setting.high_alpha, False), ("low", setting.low_alpha, False),
                             ("slow", setting.high_alpha, True)):
        runs = [simulate(trend_config(base, setting, n, alpha, slow))["results"] for n in setting.nodes]
        figures[f"tok_s_{key}"] = {s: [r[s]["tok_s"] for r in runs] for s in setting.strategies}
        if key == "high":
            figures["ttft_ms"] = {s: [r[s]["ttft_ms"] for r in runs] for s in setting.strategies}
            figures["busy_high"] = {s: [r[s]["busy_mean"] for r in runs] for s in setting.strategies}
    return {"setting": asdict(setting), "nodes": list(setting.nodes), "figures": figures}
