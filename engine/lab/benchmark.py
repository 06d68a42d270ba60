"""`potluck bench`: strategies side by side in one process, on the same prompts and tokens.

Every figure is relative to plain decoding measured in the same run, because absolute
speed on a shared 2-core box drifts by tens of percent within minutes. Runs are
interleaved (rep -> family -> prompt -> strategy) so that drift hits every strategy alike.
Speed is decode speed: ``(tokens - 1) / seconds`` after the prompt is processed (the first
token comes from the prompt's logits), the same measure for our strategies and the prompt-lookup baseline.

The long-context family (``--families long``: chronicles of about 2K, 4K and 8K tokens,
summarized and asked about a detail in the middle, ``scripts/make_long_prompts.py``) needs
``--ctx 8192``; its rows add the time to first token, TriForce's acceptance at each level
and its retrieval budget.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ...assets import asset
from ..core import validate as limits
from ..core.chat import ChatFormat, Message
from ..core.errors import PotluckError
from ..core.events import Finished, RoundStats
from ..core.measure import decode_ms_per_token
from ..core.prompt import PromptTokenizer
from ..core.runtime import Model
from ..core.sampling import SamplingParams
from ..core.session import Session
from ..core.spec import EngineSpec
from ..core.strategy import Strategy
from ..core.target import LocalTarget
from ..loader import resolve_model, target_params
from ..speculation.strategies.registry import get_strategy_class

log = logging.getLogger(__name__)

FAMILIES = ("code_editing", "summarization", "chat")
LONG_FAMILY = "long"  # not in the default families: it needs --ctx 8192 and minutes per prompt
PROMPT_LOOKUP = "prompt-lookup"  # the baseline llama-cpp-python's LlamaPromptLookupDecoding, see .baselines
OLD_NAMES = {"peer": PROMPT_LOOKUP}  # the name it had before "peer" meant a network peer (still accepted)
BASELINE = "plain"
DRAFT_USERS = {"sd", "pearl", "minions"}  # strategies that use --draft when one is given


def load_prompts(family: str) -> list[str]:
    """Prompts of one family: ``assets/prompts/<family>.txt``, or a file of the user's own
    (a path ending in .txt), separated by ``%%`` lines; leading ``#`` lines are comments."""
    path = Path(family) if family.endswith(".txt") else asset(f"prompts/{family}.txt")
    if not path.is_file():
        raise PotluckError(
            f"unknown prompt family {family!r}; choose from {', '.join((*FAMILIES, LONG_FAMILY))} "
            "or give a .txt file of prompts separated by %% lines"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PotluckError(f"cannot read prompts from {path}: {e}") from None
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    prompts, cur = [], []
    for line in [*lines, "%%"]:
        if line.strip() == "%%":
            if "".join(cur).strip():
                prompts.append("\n".join(cur).strip())
            cur = []
        else:
            cur.append(line)
    return prompts


def chat_prompt_tokens(model: Model, user: str) -> list[int]:
    """The tokens a fresh :class:`Session` would prefill for ``user`` (for the prompt-lookup baseline)."""
    bos = model.detokenize([model.bos], special=True) if model.bos >= 0 else ""
    eos = model.detokenize([model.eos], special=True) if model.eos >= 0 else ""
    chat = ChatFormat(model.chat_template, bos_token=bos, eos_token=eos)
    return PromptTokenizer(model, chat).conversation([Message("user", user)], limits.MAX_CTX).tokens()


@dataclass(frozen=True)
class BenchConfig:
    model: Path | None = None  # target; None: bundled model
    draft: Path | None = None  # for `sd`
    recipe: str | None = None  # layer recipe the target was built with (reported)
    strategies: tuple[str, ...] = (BASELINE, "anpd", PROMPT_LOOKUP)
    families: tuple[str, ...] = FAMILIES
    max_tokens: int = 128
    reps: int = 3
    n_ctx: int = 4096
    n_threads: int = 0
    options: dict[str, object] = field(default_factory=dict)
    kv_cache: str = "bf16"  # the target's KV cache setting (EngineSpec.kv_cache)


@dataclass(frozen=True)
class BenchRow:
    """One strategy on one prompt family (medians over repetitions)."""

    family: str
    strategy: str
    tokens_per_s: float
    speedup: float  # vs plain decoding in the same run
    acceptance_rate: float | None
    mean_accepted_len: float | None  # accepted drafts per round
    mean_draft_len: float | None  # speculation length chosen per round
    identical_to_ar: bool
    tokens: int  # tokens generated per repetition, all prompts of the family
    prompts: int
    reps: int
    draft_ms_per_token: float | None  # busy drafting, per emitted token
    verify_ms_per_token: float | None  # busy verifying, per emitted token
    overlap_ms_per_token: float | None  # busy at both at once (pearl): the parallelism
    target: str
    target_layers: int
    recipe: str | None
    draft: str | None
    cost_ratio: float | None  # target ms/token over draft ms/token (sd only)
    max_tokens: int
    threads: int
    ttft_s: float | None = None  # median time to first token (prompt processing included)
    prefill_tokens_per_s: float | None = None  # median prompt tokens per second of prefill
    kv_cache: str = "bf16"
    # TriForce's hierarchy (None for other strategies); acceptance_rate above counts every
    # draft the full cache judged (retrieval drafts and, where those did not pay, N-gram ones)
    ngram_acceptance: float | None = None  # level 1: N-gram drafts the retrieval cache kept
    retrieval_acceptance: float | None = None  # level 2: retrieval drafts the full cache kept
    retrieval_budget: int | None = None  # positions the retrieval cache held (last rebuild)
    retrieval_context: int | None = None  # positions of the full cache at that rebuild
    rebuilds_per_reply: float | None = None

    def as_json(self) -> dict[str, object]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class _Acc:
    """Totals of one (strategy, family) across prompts, per repetition."""

    tokens_per_rep: dict[int, int] = field(default_factory=dict)
    seconds_per_rep: dict[int, float] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    draft_len: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    overlap_ms: float = 0.0
    emitted: int = 0
    identical: bool = True
    ttft_s: list[float] = field(default_factory=list)
    prefill_tps: list[float] = field(default_factory=list)
    replies: int = 0
    # TriForce's counters, summed over replies
    ngram_drafted: int = 0
    ngram_accepted: int = 0
    retrieval_drafted: int = 0
    retrieval_accepted: int = 0
    rebuilds: int = 0
    budget: int | None = None
    context: int | None = None

    def add_run(self, rep: int, n_tokens: int, decode_s: float) -> None:
        self.tokens_per_rep[rep] = self.tokens_per_rep.get(rep, 0) + n_tokens
        self.seconds_per_rep[rep] = self.seconds_per_rep.get(rep, 0.0) + decode_s

    def tokens_per_s(self) -> float:
        rates = [
            max(0, self.tokens_per_rep[r]) / s for r, s in self.seconds_per_rep.items() if s > 0
        ]
        return statistics.median(rates) if rates else 0.0


class _Runner:
    """One strategy (or the prompt-lookup baseline) ready to answer prompts from scratch."""

    def __init__(self, name: str, model: Model, cfg: BenchConfig) -> None:
        self.name = name
        self.model = model
        self.cfg = cfg
        self.lookup = None
        self.strategy: Strategy | None = None
        if name == PROMPT_LOOKUP:
            from .baselines import PromptLookupBaseline

            self.lookup = PromptLookupBaseline(model.path, n_ctx=cfg.n_ctx, n_threads=cfg.n_threads)
        else:
            self.spec = EngineSpec(
                model=model.path,
                strategy=name,
                draft=cfg.draft,
                n_ctx=cfg.n_ctx,
                n_threads=cfg.n_threads,
                strategy_options=dict(cfg.options),
                kv_cache=cfg.kv_cache,
            )
            self.strategy = get_strategy_class(name).build(model, self.spec)

    def run(self, prompt: str, rep: int, acc: _Acc) -> list[int]:
        """Answer ``prompt`` greedily; add its counters to ``acc``; return its tokens."""
        if self.lookup is not None:
            tokens = chat_prompt_tokens(self.model, prompt)
            res = self.lookup.generate(tokens, self.cfg.max_tokens, self.model.is_eog)
            acc.add_run(rep, len(res.tokens) - 1, res.decode_s)
            acc.ttft_s.append(res.prefill_s)
            acc.prefill_tps.append(len(tokens) / res.prefill_s if res.prefill_s > 0 else 0.0)
            return res.tokens
        assert self.strategy is not None
        self.strategy.reset()
        # the context the strategy gets from open_session (side sequences, observed tensors)
        target = LocalTarget(self.model, target_params(self.model, self.spec, type(self.strategy)))
        session = Session(self.model, target, self.strategy)
        finished: Finished | None = None
        try:
            for ev in session.generate(prompt, SamplingParams(), self.cfg.max_tokens):
                if isinstance(ev, RoundStats):
                    acc.draft_len += ev.draft_len
                    acc.draft_ms += ev.draft_ms
                    acc.verify_ms += ev.verify_ms
                    acc.overlap_ms += ev.overlap_ms
                    acc.emitted += ev.emitted
                elif isinstance(ev, Finished):
                    finished = ev
        finally:
            target.close()
        assert finished is not None
        acc.add_run(rep, len(finished.tokens) - 1, finished.decode_s)
        acc.ttft_s.append(finished.ttft_s)
        acc.prefill_tps.append(finished.prefill_tokens_per_s)
        acc.replies += 1
        levels = getattr(self.strategy, "counters", None)  # TriForce's LevelCounters
        if levels is not None:
            acc.ngram_drafted += levels.ngram_drafted
            acc.ngram_accepted += levels.ngram_accepted
            acc.retrieval_drafted += levels.retrieval_drafted
            acc.retrieval_accepted += levels.retrieval_accepted
            acc.rebuilds += levels.rebuilds
            if levels.rebuilds:
                acc.budget, acc.context = levels.budget, levels.context
        acc.drafted += finished.drafted
        acc.accepted += finished.accepted
        acc.rounds += finished.rounds
        return list(finished.tokens)

    def close(self) -> None:
        if self.lookup is not None:
            self.lookup.close()
        if self.strategy is not None:
            self.strategy.close()


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Run every strategy on every prompt of every family ``cfg.reps`` times."""
    say = progress or (lambda _msg: None)
    strategies = [BASELINE] + [s for s in cfg.strategies if s != BASELINE]
    for name in strategies:
        if name != PROMPT_LOOKUP:
            get_strategy_class(name)  # unknown names fail before anything loads
    if cfg.reps <= 0 or cfg.max_tokens <= 1:
        raise PotluckError("--reps must be >= 1 and --max-tokens >= 2")
    prompts = {fam: load_prompts(fam) for fam in cfg.families}
    for fam, found in prompts.items():
        if not found:
            raise PotluckError(f"no prompts in {fam!r} (separate prompts with lines holding %%)")
    model = Model(resolve_model(cfg.model))
    runners: list[_Runner] = []
    try:
        limits.context_fits_model(model, cfg.n_ctx)
        for fam, found in prompts.items():
            longest = max(len(chat_prompt_tokens(model, p)) for p in found)
            if longest + cfg.max_tokens > cfg.n_ctx:
                raise PotluckError(
                    f"family {fam!r} has a prompt of {longest} tokens, which with --max-tokens "
                    f"{cfg.max_tokens} does not fit --ctx {cfg.n_ctx}; raise --ctx (the long family needs 8192)"
                )
        cost_ratio = None
        if cfg.draft is not None and DRAFT_USERS & set(strategies):
            with Model(cfg.draft) as draft_model:
                target_ms = decode_ms_per_token(model, cfg.n_threads)
                draft_ms = decode_ms_per_token(draft_model, cfg.n_threads)
                cost_ratio = target_ms / draft_ms
                say(f"cost ratio: target {target_ms:.1f} ms/token, draft {draft_ms:.1f} ms/token")
        runners = [_Runner(name, model, cfg) for name in strategies]
        accs = {(r.name, fam): _Acc() for r in runners for fam in cfg.families}
        reference: dict[tuple[str, int], list[int]] = {}
        for rep in range(cfg.reps):
            for fam in cfg.families:
                for i, prompt in enumerate(prompts[fam]):
                    for runner in runners:
                        acc = accs[(runner.name, fam)]
                        tokens = runner.run(prompt, rep, acc)
                        key = (fam, i)
                        if runner.name == BASELINE and key not in reference:
                            reference[key] = tokens
                        elif tokens != reference[key]:
                            acc.identical = False
                        say(f"rep {rep + 1}/{cfg.reps} {fam}[{i}] {runner.name}: {len(tokens)} tokens")
        rows = []
        for runner in runners:
            for fam in cfg.families:
                rows.append(_row(runner.name, fam, accs, cfg, model, cost_ratio, len(prompts[fam])))
        return rows
    finally:
        for r in reversed(runners):
            r.close()
        model.close()


def _row(
    name: str,
    fam: str,
    accs: dict[tuple[str, str], _Acc],
    cfg: BenchConfig,
    model: Model,
    cost_ratio: float | None,
    n_prompts: int,
) -> BenchRow:
    acc, base = accs[(name, fam)], accs[(BASELINE, fam)]
    tps, base_tps = acc.tokens_per_s(), base.tokens_per_s()
    spec = acc.drafted > 0 or name not in (BASELINE, PROMPT_LOOKUP)
    return BenchRow(
        family=Path(fam).stem if fam.endswith(".txt") else fam,
        strategy=name,
        tokens_per_s=tps,
        speedup=tps / base_tps if base_tps > 0 else 0.0,
        acceptance_rate=acc.accepted / acc.drafted if acc.drafted else None,
        mean_accepted_len=acc.accepted / acc.rounds if acc.rounds and acc.drafted else None,
        mean_draft_len=acc.draft_len / acc.rounds if spec and acc.rounds else None,
        identical_to_ar=acc.identical,
        tokens=int(statistics.median(acc.tokens_per_rep.values())) + n_prompts,
        prompts=n_prompts,
        reps=cfg.reps,
        draft_ms_per_token=acc.draft_ms / acc.emitted if spec and acc.emitted else None,
        verify_ms_per_token=acc.verify_ms / acc.emitted if spec and acc.emitted else None,
        overlap_ms_per_token=acc.overlap_ms / acc.emitted if spec and acc.emitted else None,
        target=model.path.name,
        target_layers=model.n_layer,
        recipe=cfg.recipe,
        draft=cfg.draft.name if cfg.draft is not None and name in DRAFT_USERS else None,
        cost_ratio=cost_ratio if name in DRAFT_USERS else None,
        max_tokens=cfg.max_tokens,
        threads=cfg.n_threads,
        ttft_s=statistics.median(acc.ttft_s) if acc.ttft_s else None,
        prefill_tokens_per_s=statistics.median(acc.prefill_tps) if acc.prefill_tps else None,
        kv_cache=cfg.kv_cache,
        ngram_acceptance=acc.ngram_accepted / acc.ngram_drafted if acc.ngram_drafted else None,
        retrieval_acceptance=acc.retrieval_accepted / acc.retrieval_drafted if acc.retrieval_drafted else None,
        retrieval_budget=acc.budget,
        retrieval_context=acc.context,
        rebuilds_per_reply=acc.rebuilds / acc.replies if acc.rebuilds and acc.replies else None,
    )


# --------------------------------------------------------------------------- N-gram cost scaling


def ngram_scaling(
    sizes: Sequence[int] = (1_000, 4_000, 16_000, 64_000),
    steps: int = 2_000,
    n_max: int = 5,
    k: int = 7,
    seed: int = 0,
) -> list[dict[str, float]]:
    """Drafter cost per generated token (take in one token + draft k) at several context sizes.

    The stream is Zipf-distributed token ids over a 49k vocabulary with repeated spans, so
    that queries hit, miss and chain like they do on text. Flat figures across sizes show
    the cost does not grow with the context.
    """
    from ..speculation.drafters import ContextView, DraftRequest
    from ..speculation.drafters.ngram import NgramDrafter

    rng = np.random.default_rng(seed)
    total = max(sizes) + steps
    stream = (rng.zipf(1.3, size=total) % 49_152).astype(np.int64)
    for start in range(0, total - 64, 512):  # copy spans, as code edits and summaries do
        src = int(rng.integers(0, max(1, start)))
        stream[start : start + 32] = stream[src : src + 32]
    history = stream.tolist()
    out = []
    for size in sizes:
        drafter = NgramDrafter(n_max)
        t = time.perf_counter()
        drafter.begin(history[:size], rng)
        init_s = time.perf_counter() - t
        t = time.perf_counter()
        drafted = 0
        for i in range(size, size + steps):
            draft = drafter.draft(DraftRequest(ContextView(history, i + 1), k, 0.0, SamplingParams()))
            drafter.accept(0)
            drafted += len(draft.tokens)
        step_s = time.perf_counter() - t
        out.append(
            {
                "context_tokens": size,
                "us_per_token": step_s / steps * 1e6,
                "prefill_us_per_token": init_s / size * 1e6,
                "mean_draft_len": drafted / steps,
            }
        )
    return out
