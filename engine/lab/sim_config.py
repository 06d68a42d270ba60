"""The simulator's settings: :class:`SimConfig` (checked in one place, one line per bad
value), the batch-cost curve, and what it takes from a `potluck perf` report. The model
itself is described in :mod:`.simulate`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..core.errors import PotluckError

# docs/facts.md §6, `potluck perf` with logits for every row (SmolLM2-135M, 2 threads)
DEFAULT_BATCH_COST: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.76), (4, 3.06), (8, 5.55), (16, 11.07))
STRATEGIES = ("iterative", "speculative", "pipelined", "pipeinfer", "pipeinfer-nocancel", "pipeinfer-nocontinuous")
TREND_NODES = (1, 2, 4, 8, 16, 32)
CUTOFF_RULES = ("paper", "reference", "code")
MAX_MS = 1e6  # any time setting (ms): beyond it sums of times lose their precision


@dataclass(frozen=True)
class SimConfig:
    """Everything the model needs; times in ms, one conversation of ``tokens`` tokens."""

    stage_ms: tuple[float, ...] = (6.0, 6.0)  # per stage, one token (default: 12 ms/token split in two)
    head_ms: float = 0.0  # the head's output layer, one token
    run_ms: float = 0.0  # a stage's fixed cost per job, whatever its rows
    msg_ms: float = 0.0  # CPU one message burns at its receiver, beside it (with cores > 0)
    sample_ms: float = 0.1  # sampling / verifying one run's result
    draft_ms: float = 0.0  # one drafted token (0: N-gram lookups)
    latency_ms: float = 0.1  # one message on one link (loopback ~0.1, gigabit ~1)
    bandwidth_mbps: float = 10_000.0  # megabits/s of each link
    n_embd: int = 576  # hidden state: n_embd * 4 bytes a token on every link
    return_bytes: int = 0  # a token on the return link (0: the hidden state; 49152 * 4 for logits)
    batch_cost: tuple[tuple[int, float], ...] = DEFAULT_BATCH_COST
    alpha: float = 0.7  # chance a drafted token is accepted
    p_none: float = 0.0  # chance the drafter has no guess
    tokens: int = 200  # tokens decided after the prompt's own
    seeds: int = 3
    prompt_tokens: int = 64
    prefill_ms: float = 0.0  # whole model, a prompt token (0: the batch-cost curve; perf's prefill speed)
    n_batch: int = 512
    k: int = 4  # draft length of speculative and pipelined
    max_runs: int = 0  # runs in flight (0: stages + 1)
    max_draft: int = 8  # pipeinfer-nocontinuous: one bigger speculative run
    p_accept: float = 0.001  # PipeInfer's cutoff factors (the paper's -pa -pr -pd)
    recovery: float | None = None  # None: the strategy's own default, min(0.4, 1 / (stages + 1))
    decay: float = 0.01
    cutoff_rule: str = "code"  # or "paper", "reference" (module docstring)
    skip_ms: float = 0.01
    abort_ms: float = 0.5
    cores: int = 0  # cores all computing shares (0: each stage and the head on its own machine)
    strategies: tuple[str, ...] = STRATEGIES

    @property
    def n_stages(self) -> int:
        return len(self.stage_ms)

    def check(self) -> SimConfig:
        """Refuse what the model cannot mean, with one line naming the setting."""
        if not self.stage_ms:
            raise PotluckError("simulate: at least one stage is needed (--stages 1 or more)")
        if not all(0 < ms <= MAX_MS for ms in self.stage_ms):
            raise PotluckError(f"simulate: each stage's ms must be above 0 and at most {MAX_MS:g}, "
                               f"got {list(self.stage_ms)}")
        for name, value in (("--head-ms", self.head_ms), ("--run-ms", self.run_ms), ("--msg-ms", self.msg_ms),
                            ("--sample-ms", self.sample_ms), ("--draft-ms", self.draft_ms),
                            ("--latency-ms", self.latency_ms), ("--skip-ms", self.skip_ms),
                            ("--abort-ms", self.abort_ms), ("--recovery", self.recovery or 0.0),
                            ("--prefill-ms", self.prefill_ms),
                            ("--decay", self.decay), ("--p-accept", self.p_accept)):
            if not 0 <= value <= MAX_MS:
                raise PotluckError(f"simulate: {name} must be between 0 and {MAX_MS:g}, got {value}")
        if not 1e-3 <= self.bandwidth_mbps <= 1e9:
            raise PotluckError(f"simulate: --bandwidth-mbps must be between 0.001 and 1e9, got {self.bandwidth_mbps}")
        for name, value in (("--alpha", self.alpha), ("--p-none", self.p_none)):
            if not 0.0 <= value <= 1.0:
                raise PotluckError(f"simulate: {name} must be between 0 and 1, got {value}")
        # upper bounds keep one run within seconds to minutes, not hours
        for name, ivalue, low, high in (("--tokens", self.tokens, 1, 100_000), ("--seeds", self.seeds, 1, 100),
                                        ("--stages", self.n_stages, 1, 256),
                                        ("--prompt-tokens", self.prompt_tokens, 1, 1_000_000),
                                        ("--n-batch", self.n_batch, 1, 1_000_000), ("--k", self.k, 1, 64),
                                        ("--max-runs", self.max_runs, 0, 1024), ("--max-draft", self.max_draft, 1, 64),
                                        ("--n-embd", self.n_embd, 1, 1_000_000), ("--cores", self.cores, 0, 1024),
                                        ("--return-bytes", self.return_bytes, 0, 100_000_000)):
            if not low <= ivalue <= high:
                raise PotluckError(f"simulate: {name} must be between {low} and {high}, got {ivalue}")
        if self.prompt_tokens > 10_000 * self.n_batch:
            raise PotluckError(f"simulate: {self.prompt_tokens} prompt tokens in chunks of {self.n_batch} is too many "
                               "chunks; raise --n-batch")
        if self.cutoff_rule not in CUTOFF_RULES:
            raise PotluckError(f"simulate: --cutoff-rule is one of {', '.join(CUTOFF_RULES)}, got {self.cutoff_rule!r}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise PotluckError(f"simulate: unknown strategy {', '.join(unknown) or '(none)'}; "
                               f"choose from {', '.join(STRATEGIES)}")
        check_batch_cost(self.batch_cost)
        return self


def check_batch_cost(points: Sequence[tuple[int, float]]) -> None:
    ks = [k for k, _ in points]
    if not points or ks[0] != 1 or any(b <= a for a, b in zip(ks, ks[1:])):
        raise PotluckError("simulate: the batch cost needs k=1 first and growing k (e.g. 1:1,2:1.76,4:3.06)")
    if any(not 0 < c <= 1e6 for _, c in points) or ks[-1] > 1_000_000:
        raise PotluckError("simulate: batch costs must be positive numbers (at most 1e6, for k up to 1e6)")


def batch_cost_fn(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """cost(b) relative to one token: linear between the measured points, the last slope
    beyond them (prefill chunks are far past the measured 16)."""
    ks = np.array([k for k, _ in points], dtype=float)
    cs = np.array([c for _, c in points], dtype=float)
    slope = (cs[-1] - cs[-2]) / (ks[-1] - ks[-2]) if len(ks) > 1 else cs[0]
    cache: dict[int, float] = {}

    def cost(b: int) -> float:
        if b not in cache:
            cache[b] = float(np.interp(b, ks, cs)) if b <= ks[-1] else float(cs[-1] + (b - ks[-1]) * slope)
        return cache[b]

    return cost


@dataclass(frozen=True)
class PerfTiming:
    """What the model takes from `potluck perf --json` (engine/lab/perf.py's PerfReport)."""

    model_ms: float  # one token through the whole model
    prefill_ms: float  # one prompt token through the whole model (0: not in the report)
    batch_cost: tuple[tuple[int, float], ...]

    @classmethod
    def from_report(cls, report: Mapping[str, Any], source: str = "the perf report") -> PerfTiming:
        try:
            speed = float(report["decode_tokens_per_s"])
            prefill = float(report.get("prefill_tokens_per_s") or 0.0)
            cost = tuple(sorted((int(k), float(c)) for k, c in report["batch_cost"].items()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise PotluckError(f"simulate: {source} is not `potluck perf --json` output (decode_tokens_per_s, "
                               "batch_cost); write it with `potluck perf --json > FILE.json`") from None
        if not (speed > 0 and math.isfinite(speed)):
            raise PotluckError(f"simulate: {source}: decode_tokens_per_s must be positive, got {speed}")
        check_batch_cost(cost)
        prefill_ms = 1000.0 / prefill if prefill > 0 and math.isfinite(prefill) else 0.0
        return cls(1000.0 / speed, prefill_ms, cost)

    def config(self, stages: int, base: SimConfig = SimConfig()) -> SimConfig:
        """``base`` with this model split evenly over ``stages`` stages."""
        if not 1 <= stages <= 256:
            raise PotluckError(f"simulate: --stages must be between 1 and 256, got {stages}")
        return replace(base, stage_ms=(self.model_ms / stages,) * stages, prefill_ms=self.prefill_ms,
                       batch_cost=self.batch_cost)
