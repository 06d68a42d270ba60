"""`pipeinfer` is lossless while several runs are in flight down a real pipeline.

Two kinds of pipeline: stages chained in this process (one runner thread per stage, the
same Stage class a worker runs) for the many-prompt checks, and worker processes on
loopback for the cluster itself. Counters prove the paths ran: micro-batches were sent
while others were in flight, guesses were rejected, runs built on them were cancelled (or,
without cancellation, computed and thrown away).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.events import Finished
from potluck.engine.core.gguf_tools import slice_layers
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.strategy import Strategy
from potluck.engine.core.target import LocalTarget, Target
from potluck.engine.speculation import inflight, verify
from potluck.engine.speculation.strategies.pipeinfer import PipeInfer

from .cluster_support import TOKEN, WorkerProc
from .support.breadth import beyond
from .support.distributions import dense_probs
from .support.prompts import LONG_PROMPTS, TURNS
from .support.sampled import ALPHA, DEFAULTS, SETTINGS, broken_residual, chi2_pvalue, generation, next_round
from .support.split_target import SplitTarget

N_CTX = 2048
MAX_TOKENS = 64
TURN_TOKENS = 32
PARAMS = ContextParams(n_ctx=N_CTX, n_threads=1)
SPLITS = {2: [(0, 15), (15, 30)], 3: [(0, 9), (9, 21), (21, 30)]}


def build(model: Model, draft: Path | None = None, **options: object) -> PipeInfer:
    """Without the floor unless asked: these tests must see rejected guesses and cancelled
    runs whatever this machine's load makes the gate decide."""
    options.setdefault("adaptive", False)
    spec = EngineSpec(strategy="pipeinfer", draft=draft, n_ctx=N_CTX, n_threads=1, strategy_options=dict(options))
    strategy = PipeInfer.build(model, spec)
    assert isinstance(strategy, PipeInfer)
    return strategy


@pytest.fixture(scope="module")
def stage_models(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, list[Model]]]:
    tmp = tmp_path_factory.mktemp("pipeinfer-slices")
    out = {n: [Model(slice_layers(model_path, tmp / f"{n}-{lo}.gguf", lo, hi)) for lo, hi in bounds]
           for n, bounds in SPLITS.items()}
    yield out
    for models in out.values():
        for m in models:
            m.close()


CASES = [(p, MAX_TOKENS, True) for p in LONG_PROMPTS[:2]] + [(t, TURN_TOKENS, i == 0) for i, t in enumerate(TURNS[:2])]


def replies(
    model: Model, target: Target, strategy: Strategy, before_close: Callable[[], None] = lambda: None
) -> tuple[list[list[int]], Counter[str]]:
    """Two long prompts alone (a story, a code rewrite), then a two-turn conversation: the replies' tokens and the
    counters summed over them (drafted/accepted from the replies, the rest from pipeinfer's
    per-reply counters). Closes the session (target and strategy) after ``before_close``."""
    session = Session(model, target, strategy)
    got: list[list[int]] = []
    sums: Counter[str] = Counter()
    try:
        for text, max_new, fresh in CASES:
            if fresh:
                session.load_messages([])
            *_, fin = session.generate(text, SamplingParams(), max_new)
            assert isinstance(fin, Finished)
            got.append(list(fin.tokens))
            sums.update(drafted=fin.drafted, accepted=fin.accepted)
            if isinstance(strategy, PipeInfer):
                c = strategy.counters
                sums.update(cancelled=c.cancelled, wasted=c.wasted, speculative=c.speculative_runs)
                sums["max_in_flight"] = max(sums["max_in_flight"], c.max_in_flight)
        before_close()
        return got, sums
    finally:
        session.close()


@pytest.fixture(scope="module")
def plain(model: Model) -> list[list[int]]:
    return replies(model, LocalTarget(model, PARAMS), Plain())[0]


def split(models: list[Model]) -> SplitTarget:
    return SplitTarget(models, PARAMS)


@pytest.mark.parametrize("n_stages", beyond([2, 3], keep=[2]))
def test_greedy_pipeinfer_equals_plain_decoding(
    model: Model, stage_models: dict[int, list[Model]], plain: list[list[int]], n_stages: int
) -> None:
    got, c = replies(model, split(stage_models[n_stages]), build(model))
    assert got == plain
    assert c["drafted"] > c["accepted"] > 0  # N-gram guesses were both accepted and rejected
    assert c["speculative"] > 0 and c["max_in_flight"] >= 2  # micro-batches overlapped
    assert c["cancelled"] > 0  # runs built on a rejected guess were cancelled


def test_replies_that_end_while_kept_tokens_are_in_flight(model: Model, stage_models: dict[int, list[Model]]) -> None:
    """Short replies that end on an end-of-generation token the N-gram tables guessed (they
    saw it end the turns before): the reply ends while the run holding that kept token is
    still going down the pipeline; it must finish, not be cancelled, or the next turn finds
    a hole in the stages' caches."""
    turns = ["Answer with one word: yes or no. Is water wet?"] + ["Same question, same one-word answer."] * 4

    def talk(target: Target, strategy: Strategy) -> tuple[list[tuple[int, ...]], int]:
        session = Session(model, target, strategy)
        out, kept = [], 0
        try:
            for turn in turns:
                *_, fin = session.generate(turn, SamplingParams(), 16)
                assert isinstance(fin, Finished)
                out.append(fin.tokens)
                if isinstance(strategy, PipeInfer):
                    kept += strategy.counters.kept_at_end
            return out, kept
        finally:
            session.close()

    want, _ = talk(LocalTarget(model, PARAMS), Plain())
    # one guess per run: the run holding the reply's last guess (its end-of-generation token)
    # is sent while the run before it is still on its way, so it is in flight when that run's
    # logits end the reply; with several guesses per run that depended on this machine's timing
    got, kept = talk(split(stage_models[2]), build(model, max_micro=1, max_runs=6))
    assert got == want
    assert kept > 0


def test_pipeinfer_with_a_draft_model_that_gets_rejected(
    model: Model, stage_models: dict[int, list[Model]], plain: list[list[int]], weak_draft: Path
) -> None:
    got, c = replies(model, split(stage_models[2]), build(model, weak_draft))
    assert got == plain
    assert c["drafted"] > c["accepted"] > 0 and c["cancelled"] > 0


@pytest.mark.parametrize("options", beyond([{"cancel": False}, {"continuous": False}, {"max_micro": 1, "max_runs": 6}],
                                            keep=[{"max_micro": 1, "max_runs": 6}]))
def test_ablations_stay_exact(
    model: Model, stage_models: dict[int, list[Model]], plain: list[list[int]], options: dict[str, object]
) -> None:
    strategy = build(model, **options)
    got, c = replies(model, split(stage_models[2]), strategy)
    assert got == plain
    assert c["drafted"] > c["accepted"] > 0
    if options.get("cancel") is False:
        assert c["cancelled"] == 0 and c["wasted"] > 0  # runs on rejected guesses computed to the end
    if options.get("continuous") is False:
        assert c["max_in_flight"] <= 2  # the own token and at most one speculative run


def test_the_floor_keeps_pipeinfer_exact(
    model: Model, stage_models: dict[int, list[Model]], plain: list[list[int]]
) -> None:
    """Default settings: the gate judges rounds with guesses in flight against synchronous
    ones (each reply starts open, so guesses are sent) and the output stays exact."""
    strategy = build(model, adaptive=True)
    got, c = replies(model, split(stage_models[2]), strategy)
    assert got == plain
    assert c["speculative"] > 0
    assert strategy.gate.plain_ms is not None  # synchronous rounds were measured


@pytest.mark.slow
def test_one_stage_runs_ordinary_speculation(model: Model, plain: list[list[int]]) -> None:
    got, c = replies(model, LocalTarget(model, PARAMS), build(model))
    assert got == plain
    assert c["drafted"] > 0 and c["speculative"] == 0  # drafted, but never a pipelined run


def test_options_are_checked(model: Model) -> None:
    from potluck.engine.core.errors import PotluckError

    with pytest.raises(PotluckError, match="max_micro"):
        build(model, max_micro=9)
    with pytest.raises(PotluckError, match="recovery"):
        build(model, recovery=-1.0)


# --------------------------------------------------------------------------- sampling

TRIALS = 200


def second_tokens(model: Model, stages: list[Model], strategy: PipeInfer, text: str,
                  params: SamplingParams) -> tuple[list[int], np.ndarray]:
    """The token after ``text`` plus ":" over ``TRIALS`` seeded replies, where an N-gram guess
    was judged; and the target's exact distribution at that position. The first token is ":" for
    sure (logits that give it), so every trial reaches the guess whatever the setting."""
    target = split(stages)
    try:
        prompt = model.tokenize(text, add_special=True)
        colon = model.tokenize(":", add_special=False)[0]
        target.decode(prompt)
        pending = target.decode([colon])[-1].copy()
        target.truncate(len(prompt))
        certain = np.full(model.n_vocab, -100.0, dtype=np.float32)
        certain[colon] = 100.0
        out: list[int] = []
        for seed in range(TRIALS):
            g = generation(target, prompt, certain, seed, model, params, max_new=4)
            strategy.prepare(g)
            rounds = strategy.run(g)
            assert next_round(g, rounds).tokens == [colon]  # the first token: from the given logits
            nxt = next(rounds)
            if nxt.drafted > 0:  # the verifier, not plain sampling, chose this token
                out.append(nxt.tokens[0])
            rounds.close()
            target.truncate(len(prompt))
        assert len(out) > TRIALS // 2
        return out, dense_probs(pending, params, [*prompt, colon])
    finally:
        target.close()


FRUITS = "My favourite fruits: apples, pears, plums. Her favourite fruits"  # then ":", then " apples"?


@pytest.mark.parametrize("setting", beyond(list(SETTINGS), keep=["llama.cpp defaults", "penalties"]))
def test_sampled_pipeinfer_token_follows_target_distribution(
    setting: str, model: Model, stage_models: dict[int, list[Model]]
) -> None:
    """N-gram guesses (q = delta, " apples" after "fruits:") judged as rows come back, at each
    of the settings every strategy is checked with (tests/support/sampled.py)."""
    strategy = build(model)
    tokens, p = second_tokens(model, stage_models[2], strategy, FRUITS, SETTINGS[setting])
    assert chi2_pvalue(tokens, p) > ALPHA
    strategy.close()


def test_a_broken_residual_is_caught_in_pipeinfer(
    model: Model, stage_models: dict[int, list[Model]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with a verifier that resamples from p after a rejection must fail."""
    strategy = build(model)
    monkeypatch.setattr(inflight, "judge", functools.partial(verify.judge, residual_fn=broken_residual))
    tokens, p = second_tokens(model, stage_models[2], strategy, FRUITS, DEFAULTS)
    assert chi2_pvalue(tokens, p) < ALPHA
    strategy.close()


# --------------------------------------------------------------------------- worker processes


# PipeInfer over loopback workers by default: test_cluster_pipeline (every strategy over two
# workers, drafts accepted and rejected), and stages dropping cancelled work: test_cluster_pipeline's cancels
@pytest.mark.slow
@pytest.mark.parametrize("n_workers", [2, 3])
def test_pipeinfer_over_loopback_workers_equals_one_machine(
    model: Model, model_path: Path, loopback_pool: list[WorkerProc], plain: list[list[int]], n_workers: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    target = open_pipeline(model_path, [w.address for w in loopback_pool[:n_workers]], keys_from_token(TOKEN),
                           n_ctx=N_CTX, slice_cache=SliceCache(tmp_path_factory.mktemp("pi-cache")))
    status = []
    got, c = replies(model, target, build(model), lambda: status.extend(target.status()))
    assert got == plain
    assert c["drafted"] > c["accepted"] > 0 and c["cancelled"] > 0 and c["max_in_flight"] >= 2
    assert len(status) == n_workers and all(st.busy_ms > 0 for st in status)
    assert sum(st.skipped + st.aborted for st in status) > 0  # stages dropped cancelled work


@pytest.mark.slow
def test_cluster_bench_reports_overlap_and_bytes(
    model_path: Path, loopback_pool: list[WorkerProc], tmp_path: Path
) -> None:
    """The cluster bench's rows (not its timings): every variant's output equals one
    machine's, stages report busy time, the last worker sends hidden states, not logits."""
    from potluck.engine.lab.cluster_bench import ONE_MACHINE, SYNC, ClusterBenchConfig, run_cluster_bench

    prompts = tmp_path / "mine.txt"
    prompts.write_text("Rewrite with snake_case: def addTwo(firstValue, secondValue): return firstValue + 2\n")
    # adaptive off: the floor may (rightly) stop guessing on a busy machine; the rows are under test
    cfg = ClusterBenchConfig(model=model_path, families=(str(prompts),), reps=1, max_tokens=24, only=("pipeinfer",),
                             options={"adaptive": False})
    addresses = [w.address for w in loopback_pool[:2]]
    rows = {r.variant: r for r in run_cluster_bench(cfg, addresses, keys_from_token(TOKEN))}
    assert set(rows) == {ONE_MACHINE, SYNC, "pipeinfer"}  # the baselines always run
    assert all(r.identical_to_one_machine for r in rows.values())
    for name in (SYNC, "pipeinfer"):
        r = rows[name]
        assert len(r.stage_busy) == 3 and all(0 < b < 1 for b in r.stage_busy)  # 2 workers, the head
        assert r.last_stage_bytes_per_token is not None and r.last_stage_bytes_per_token < 8192
    assert rows["pipeinfer"].fed_per_token > rows[SYNC].fed_per_token  # guesses went down the pipeline
    assert rows["pipeinfer"].cancelled_per_reply is not None
