"""The cluster bench: decoding over a pipeline of workers, side by side with one machine.

Every variant answers the same prompts greedily on the same pipeline (one plan, slices
loaded once): synchronous decoding (today's cluster default), synchronous speculation
(`anpd`, `sd` with a draft) and `pipeinfer` with its ablations (no early cancellation, no
continuous speculation); one machine holding the whole model is the reference for speed
and for the output. What proves the stages overlap is each stage's busy fraction (the
share of wall time it computed, from the workers' own counters); the bytes the last stage
sends per token show what the output layer on the head saves.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cluster.head import PipelineTarget, open_pipeline
from ..core.errors import PotluckError
from ..core.events import Finished
from ..core.load_watch import default_threads
from ..core.runtime import ContextParams, Model
from ..core.sampling import SamplingParams
from ..core.session import Session
from ..core.spec import ClusterSpec, CurveKeys, EngineSpec
from ..core.strategy import Strategy
from ..core.target import LocalTarget, Target
from ..loader import resolve_model
from ..speculation.strategies.registry import get_strategy_class
from .benchmark import FAMILIES, load_prompts

ONE_MACHINE = "one machine"
SYNC = "pipeline"


@dataclass(frozen=True)
class Variant:
    label: str
    strategy: str
    options: dict[str, object] = field(default_factory=dict)
    on_pipeline: bool = True


def variants(with_draft: bool) -> list[Variant]:
    out = [
        Variant(ONE_MACHINE, "plain", on_pipeline=False),
        Variant(SYNC, "plain"),
        Variant("anpd", "anpd"),
    ]
    if with_draft:
        out.append(Variant("sd", "sd"))
    out += [
        Variant("pipeinfer", "pipeinfer"),
        Variant("pipeinfer, no cancel", "pipeinfer", {"cancel": False}),
        Variant("pipeinfer, no continuous", "pipeinfer", {"continuous": False}),
    ]
    return out


@dataclass(frozen=True)
class ClusterBenchConfig:
    model: Path | None = None
    draft: Path | None = None  # used by `sd` and by `pipeinfer` (instead of the N-gram tables)
    families: tuple[str, ...] = FAMILIES
    max_tokens: int = 128
    reps: int = 3
    n_ctx: int = 2048
    n_threads: int = 0  # one machine's threads (default: all cores)
    split: tuple[int, ...] | None = None
    only: tuple[str, ...] = ()  # variant labels to run (default: all)
    options: dict[str, object] = field(default_factory=dict)  # `--option`: to each variant whose strategy takes it


@dataclass(frozen=True)
class ClusterRow:
    family: str
    variant: str
    tokens_per_s: float  # median over repetitions of tokens / decode time
    vs_pipeline: float  # speed over synchronous decoding on the same pipeline
    vs_one_machine: float
    ttft_s: float  # median time to first token (prompt processing included)
    acceptance_rate: float | None
    judged_per_token: float | None  # guesses the target judged per generated token
    identical_to_one_machine: bool
    stage_busy: tuple[float, ...]  # per worker, then the head: computing time / wall time of the replies
    last_stage_bytes_per_token: float | None  # received from the last worker per token it computed
    fed_per_token: float | None  # tokens sent down the pipeline per generated token (prompt excluded)
    cancelled_per_reply: float | None  # pipeinfer's cancelled runs
    stages: int

    def as_json(self) -> dict[str, object]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class _Acc:
    tokens: dict[int, int] = field(default_factory=dict)  # per repetition
    seconds: dict[int, float] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    identical: bool = True
    busy_ms: list[float] = field(default_factory=list)
    wall_ms: float = 0.0
    last_bytes: int = 0
    fed: int = 0  # tokens sent down the pipeline, prompts included
    prompt: int = 0
    generated: int = 0
    cancelled: int = 0
    replies: int = 0

    def tokens_per_s(self) -> float:
        rates = [self.tokens[r] / s for r, s in self.seconds.items() if s > 0]
        return statistics.median(rates) if rates else 0.0


def chosen_variants(cfg: ClusterBenchConfig) -> list[Variant]:
    """The variants ``cfg.only`` names, plus the baselines (every speed is relative to them,
    every output checked against one machine); an unknown name is one line."""
    every = variants(cfg.draft is not None)
    unknown = set(cfg.only) - {v.label for v in every}
    if unknown:
        raise PotluckError(f"no cluster bench variant {sorted(unknown)[0]!r}; choose from: "
                           + ", ".join(v.label for v in every))
    chosen = [v for v in every if not cfg.only or v.label in (*cfg.only, ONE_MACHINE, SYNC)]
    taken = {key for v in chosen for key in get_strategy_class(v.strategy).options}
    stray = sorted(set(cfg.options) - taken)
    if stray:
        raise PotluckError(f"no chosen variant takes the option {stray[0]!r} (their options: "
                           + (", ".join(sorted(taken)) or "none") + ")")
    return chosen


def variant_options(v: Variant, cfg: ClusterBenchConfig) -> dict[str, object]:
    """The ``--option``s this variant's strategy takes (``adaptive`` reaches anpd and pipeinfer
    alike), then the variant's own (an ablation's switch wins)."""
    takes = get_strategy_class(v.strategy).options
    return {**{k: val for k, val in cfg.options.items() if k in takes}, **v.options}


def run_cluster_bench(
    cfg: ClusterBenchConfig,
    addresses: Sequence[str],
    keys: CurveKeys,
    progress: Callable[[str], None] | None = None,
) -> list[ClusterRow]:
    """Run every variant on every prompt ``cfg.reps`` times over one pipeline."""
    say = progress or (lambda _msg: None)
    if cfg.reps <= 0 or cfg.max_tokens <= 1:
        raise PotluckError("--reps must be >= 1 and --max-tokens >= 2")
    chosen = chosen_variants(cfg)
    prompts = {fam: load_prompts(fam) for fam in cfg.families}
    path = resolve_model(cfg.model)
    model = Model(path)
    pipeline = open_pipeline(path, addresses, keys, n_ctx=cfg.n_ctx, split=cfg.split)
    try:
        say("plan: " + ", ".join(f"{lk.node_id} layers {lk.layers}" for lk in pipeline.links))
        accs = {(v.label, fam): _Acc() for v in chosen for fam in cfg.families}
        reference: dict[tuple[str, int], list[int]] = {}
        for rep in range(cfg.reps):
            for v in chosen:
                spec = EngineSpec(
                    model=path, strategy=v.strategy, draft=cfg.draft, n_ctx=cfg.n_ctx,
                    n_threads=cfg.n_threads if not v.on_pipeline else 1,
                    strategy_options=variant_options(v, cfg),
                    cluster=ClusterSpec(tuple(addresses), keys) if v.on_pipeline else None,
                )
                strategy = get_strategy_class(v.strategy).build(model, spec)
                try:
                    for fam in cfg.families:
                        for i, prompt in enumerate(prompts[fam]):
                            acc = accs[(v.label, fam)]
                            tokens = _reply(model, pipeline, v, cfg, strategy, prompt, rep, acc)
                            key = (fam, i)
                            if key not in reference and v.label == ONE_MACHINE:
                                reference[key] = tokens
                            elif key in reference and tokens != reference[key]:
                                acc.identical = False
                            say(f"rep {rep + 1}/{cfg.reps} {fam}[{i}] {v.label}: {len(tokens)} tokens")
                finally:
                    strategy.close()
        return [_row(v, fam, accs, len(pipeline.links)) for v in chosen for fam in cfg.families]
    finally:
        pipeline.close()
        model.close()


def _reply(
    model: Model, pipeline: PipelineTarget, v: Variant, cfg: ClusterBenchConfig, strategy: Strategy,
    prompt: str, rep: int, acc: _Acc,
) -> list[int]:
    strategy.reset()
    target: Target
    if v.on_pipeline:
        pipeline.reset()
        target = pipeline
        before = pipeline.busy_ms()
        bytes0, fed0 = pipeline.links[-1].bytes_in, pipeline.stats.tokens
    else:
        threads = cfg.n_threads or default_threads()
        target = LocalTarget(model, ContextParams(n_ctx=cfg.n_ctx, n_threads=threads))
    session = Session(model, target, strategy)
    try:
        *_, fin = session.generate(prompt, SamplingParams(), cfg.max_tokens)
    finally:
        if not v.on_pipeline:
            target.close()
    assert isinstance(fin, Finished)
    n = len(fin.tokens) - 1  # the first token comes from prompt processing
    acc.tokens[rep] = acc.tokens.get(rep, 0) + n
    acc.seconds[rep] = acc.seconds.get(rep, 0.0) + fin.decode_s
    acc.ttft.append(fin.ttft_s)
    acc.drafted += fin.drafted
    acc.accepted += fin.accepted
    acc.replies += 1
    counters = getattr(strategy, "counters", None)
    acc.cancelled += getattr(counters, "cancelled", 0)
    if v.on_pipeline:
        acc.last_bytes += pipeline.links[-1].bytes_in - bytes0
        acc.fed += pipeline.stats.tokens - fed0
        acc.prompt += fin.prefill_tokens
        busy = [b - a for a, b in zip(before, pipeline.busy_ms())]
        acc.busy_ms = [x + y for x, y in zip(acc.busy_ms, busy)] if acc.busy_ms else busy
        acc.wall_ms += (fin.prefill_s + fin.decode_s) * 1e3
        acc.generated += len(fin.tokens)
    return list(fin.tokens)


def _row(v: Variant, fam: str, accs: dict[tuple[str, str], _Acc], stages: int) -> ClusterRow:
    acc = accs[(v.label, fam)]
    tps = acc.tokens_per_s()

    def ratio(label: str) -> float:
        base = accs.get((label, fam))
        return tps / base.tokens_per_s() if base and base.tokens_per_s() > 0 else 0.0

    return ClusterRow(
        family=fam,
        variant=v.label,
        tokens_per_s=tps,
        vs_pipeline=ratio(SYNC),
        vs_one_machine=ratio(ONE_MACHINE),
        ttft_s=statistics.median(acc.ttft) if acc.ttft else 0.0,
        acceptance_rate=acc.accepted / acc.drafted if acc.drafted else None,
        judged_per_token=acc.drafted / acc.generated if acc.generated and acc.drafted else None,
        identical_to_one_machine=acc.identical,
        stage_busy=tuple(b / acc.wall_ms for b in acc.busy_ms) if acc.wall_ms else (),
        last_stage_bytes_per_token=acc.last_bytes / acc.fed if acc.fed else None,
        fed_per_token=(acc.fed - acc.prompt) / acc.generated if acc.generated else None,
        cancelled_per_reply=acc.cancelled / acc.replies if v.strategy == "pipeinfer" and acc.replies else None,
        stages=stages if v.on_pipeline else 1,
    )
