"""`minions`: voters merge into a weighted tree, weights follow acceptance, a draft model drafts
ahead on a worker thread, and the output is plain decoding's (greedy) or the target's
distribution (sampling, with a broken voting rule as the control the test must catch)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from potluck.app.cli import main
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.events import Finished, RoundStats
from potluck.engine.core.gguf_tools import merge_layer_ranges
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import Sampler, SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.strategy import Round, Strategy
from potluck.engine.core.target import LocalTarget
from potluck.engine.speculation.drafters import DraftRequest
from potluck.engine.speculation.drafters.draft_model import DraftModelDrafter
from potluck.engine.speculation.drafters.lookup import LookupDrafter
from potluck.engine.speculation.inflight import RowJudge
from potluck.engine.speculation.kernels.lookup import lookup_draft, lookup_reference
from potluck.engine.speculation.strategies.minions import AheadGate, MajorityVote, Minions, MinionsRound
from potluck.engine.speculation.strategies.registry import get_strategy_class
from potluck.engine.speculation.voting import DrafterWeights, WeightConfig, heaviest_path, score_chain

from .conftest import flat_cost_line
from .support.distributions import chisquare_pvalue, dense_probs
from .support.prompts import LONG_PROMPTS, TURNS
from .support.references import plain_conversation, plain_reply
from .support.voters import Fixed, PerPosition, Sampled

THREADS = 1  # BF16 KV keeps batches and single steps identical at any count (docs/facts.md §3)
PROMPTS = LONG_PROMPTS[1:]  # a code edit, a summary, an explanation
MAX_TOKENS = 128
TURN_TOKENS = 48


# --------------------------------------------------------------------------- pure parts


def test_lookup_kernel_matches_reference() -> None:
    rng = np.random.default_rng(0)
    for case in range(300):
        n = int(rng.integers(1, 80))
        toks = rng.integers(0, 4 if case % 2 else 12, size=n).astype(np.int32)  # small vocab: matches
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 10))
        k = int(rng.integers(0, 9))
        assert lookup_draft(toks, n, lo, hi, k) == lookup_reference(toks.tolist(), lo, hi, k), case


def test_lookup_copies_the_longest_match_and_continues_a_period() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    toks = [5, 1, 2, 9, 7, 1, 2, 3, 4, 1, 2, 3]
    arr = np.array(toks, dtype=np.int32)
    # "1 2 3" matched at 5..7 beats "2 3"-less "1 2" at 1..2: copies 4 1 2 3 ...
    assert lookup_draft(arr, len(toks), 2, 8, 4) == ([4, 1, 2, 3], 3)
    period = np.array([7, 8, 7, 8], dtype=np.int32)
    assert lookup_draft(period, 4, 2, 8, 5)[0] == [7, 8, 7, 8, 7]


def test_lookup_drafter_learns_its_hit_rate_and_stops_where_drafting_no_longer_pays() -> None:
    drafter = LookupDrafter(min_match=2, max_match=8)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    drafter.begin(context, np.random.default_rng(0))
    assert drafter.draft(DraftRequest(context, 5, 0.0, GREEDY)).tokens == [4, 5, 6, 7, 8]
    drafter.accept(5)  # all kept: copies from 3-token matches are trusted more
    rate = drafter.rate(3)
    assert rate > drafter.rate(2)
    n = len(drafter.draft(DraftRequest(context, 5, rate**2.5, GREEDY)).tokens)
    assert n == 2  # rate**3 < threshold: the third token would not pay
    drafter.accept(0)
    assert drafter.rate(3) < rate
    # the conversation was edited: the copy follows the new text
    edited = [1, 2, 3, 9, 9, 1, 2, 3]
    assert drafter.draft(DraftRequest(edited, 2, 0.0, GREEDY)).tokens == [9, 9]


def test_heaviest_path_follows_the_weighted_majority() -> None:
    chains = [[1, 2, 3], [1, 2, 4, 5], [6, 7]]
    # 1 carries 1 + 1 = 2 > 1.5 (the third), then 3 vs 4: the heavier second voter wins
    assert heaviest_path(chains, [1.0, 1.2, 1.5]) == ([1, 2, 4, 5], 1)
    assert heaviest_path(chains, [1.0, 1.0, 2.5]) == ([6, 7], 2)
    assert heaviest_path(chains, [1.0, 1.0, 1.0]) == ([1, 2, 3], 0)  # ties: the first listed
    assert heaviest_path([[], []], [1.0, 1.0]) == ([], -1)
    assert heaviest_path([[4, 5], [4, 5]], [1.0, 3.0]) == ([4, 5], 1)  # same chain: the heavier


def test_judge_scores_up_to_the_first_wrong_token() -> None:
    assert score_chain([1, 2, 3, 4], [1, 2, 9]) == (2, 4)  # wrong at 3: the rest of the chain is lost
    assert score_chain([1, 2, 3, 4], [1, 2]) == (2, 2)  # agrees with all that is known: judged on that
    assert score_chain([1], [1, 2, 3]) == (1, 1)


def test_weights_follow_acceptance() -> None:
    cfg = WeightConfig(window=4, reward_threshold=0.6, punish_threshold=0.3, reward=1.5, punish=0.5)
    w = DrafterWeights(3, cfg)
    for _ in range(48):
        w.record(0, 4, 5)  # right most of the time
        w.record(1, 0, 5)  # always wrong
        w.record(2, 2, 5)  # in between: neither rewarded nor punished
    assert w.weights[0] == cfg.w_max and w.weights[1] == cfg.w_min and w.weights[2] == 1.0
    assert w.leader() == 0 and w.acceptance(1) == 0.0 and w.acceptance(0) == pytest.approx(0.8)
    # the punished voter recovers once it is right again
    for _ in range(8):
        w.record(1, 5, 5)
    assert w.weights[1] == cfg.w_min * 1.5**2


# --------------------------------------------------------------------------- the vote as a drafter


GREEDY = SamplingParams()


def test_vote_scores_every_voter_against_the_target() -> None:
    right, wrong = Fixed("right", [1, 2, 3]), Fixed("wrong", [7, 8, 9])
    vote = MajorityVote([("wrong", wrong), ("right", right)], weights=WeightConfig(window=2))
    vote.begin([0], np.random.default_rng(0))
    history = [0]
    for _ in range(6):
        d = vote.draft(DraftRequest(history, 3, 0.0, GREEDY))
        vote.accept(0)
        truth = [1, 2, 3]  # the target's tokens: what "right" proposed
        vote.settle(len(history), truth)
        history = history + truth
    # at first the tie goes to the first voter; after a window the right one leads
    assert d.tokens == [1, 2, 3]
    report = {v.name: v for v in vote.report()}
    assert report["right"].weight > 1.0 > report["wrong"].weight and report["right"].voted
    assert report["right"].acceptance == 1.0 and report["wrong"].acceptance == 0.0
    assert right.accepted == [3] * 6 and wrong.accepted == [0] * 6
    vote.close()


def test_pool_serves_the_next_round_only_when_the_conversation_grew_as_assumed() -> None:
    q = np.array([0.0, 0.5, 0.5])
    model = Sampled(q)
    vote = MajorityVote([("draft-model", model), ("ngram", Fixed("ngram", []))], ahead=[0])
    vote.begin([0], np.random.default_rng(1))
    sampled = SamplingParams(temperature=1.0)
    history = [0]
    d = vote.draft(DraftRequest(history, 2, 0.0, sampled))
    assert vote.pool_hits == 0 and len(d.tokens) == 2
    vote.accept(2)
    vote._join()  # the worker drafted 3 tokens after history + path: bonus guess + 2
    ahead = vote._pool[0]
    assert ahead.seq[:2] == d.tokens and len(ahead.seq) == 5
    assert model.threads - {threading.get_ident()}  # drafted ahead on another thread
    # the whole path was kept and the target's own token is the guessed one: a pool hit
    history = history + ahead.seq[:3]
    d2 = vote.draft(DraftRequest(history, 2, 0.0, sampled))
    assert vote.pool_hits == 1 and d2.tokens == ahead.seq[3:5] and d2.q is not None
    n_requests = len(model.requests)
    vote.accept(0)
    vote._join()
    # the target rejected the path: the entry is dropped, the voter drafts afresh
    history = history + [d2.tokens[0] ^ 3]
    vote.draft(DraftRequest(history, 2, 0.0, sampled))
    assert vote.pool_hits == 0 and model.requests[n_requests + 1] == (len(history), 2)
    assert vote.ahead_ms > 0.0
    vote.close()


def test_ahead_gate_pauses_while_the_pool_misses_and_backs_off() -> None:
    gate = AheadGate(min_hit=0.25, window=4, backoff=2, max_backoff=8)

    def paused_rounds() -> int:
        n = 0
        while not gate.allow():
            n += 1
        return n

    for _ in range(4):
        gate.record(False)
    assert gate.pauses == 1 and paused_rounds() == 2
    for _ in range(4):
        gate.record(False)
    assert paused_rounds() == 4  # still missing: twice as long
    for hit in (True, False, False, False):  # 1 in 4 used: enough, the back-off resets
        gate.record(hit)
    assert paused_rounds() == 0 and gate.backoff == 2


# --------------------------------------------------------------------------- sampling exactness

V = 5
P = np.array([0.1, 0.4, 0.2, 0.2, 0.1])  # the target's distribution after the context
Q = np.array([0.5, 0.1, 0.1, 0.2, 0.1])  # the sampled voter's
TRIALS = 6000
ALPHA = 1e-4


class UsesQWhenItsChainWins(MajorityVote):
    """The tempting broken rule: verify with q whenever the voted chain is the sampled
    voter's, although whether it wins depends on the token it drew."""

    def _choose(self, chains, qs, greedy):  # type: ignore[no-untyped-def]
        path, voted = heaviest_path(chains, self.weights.weights)
        if not greedy and voted >= 0 and path == chains[0] and qs[0] is not None:
            return path, voted, qs[0]
        return path, voted, None


def first_token_counts(cls: type[MajorityVote], w_sampled: float, w_fixed: float) -> np.ndarray:
    """Emitted first tokens of TRIALS rounds: a sampled voter against one always saying 0."""
    params = SamplingParams(temperature=1.0)
    logits = np.log(P).astype(np.float32)
    counts = np.zeros(V)
    vote = cls([("sampled", Sampled(Q)), ("zero", Fixed("zero", [0]))])
    vote.weights.weights = [w_sampled, w_fixed]
    seeds = np.random.SeedSequence(7)
    vote.begin([3], np.random.default_rng(seeds.spawn(1)[0]))
    sampler = Sampler(params, np.random.default_rng(seeds))
    for _ in range(TRIALS):
        d = vote.draft(DraftRequest([3], 1, 0.0, params))
        vote._pending = None  # every trial starts from the same context
        verdict = RowJudge(sampler, [3]).chain(d.tokens, d.q, [logits] * (len(d.tokens) + 1))
        counts[verdict.tokens(d.tokens)[0]] += 1
    vote.close()
    return counts


@pytest.mark.parametrize("weights", [(2.0, 1.0), (1.0, 2.0)])
def test_sampled_votes_keep_the_target_distribution(weights: tuple[float, float]) -> None:
    """The sampled voter leads (its chain, with q) or not (the vote, deterministic): both exact."""
    counts = first_token_counts(MajorityVote, *weights)
    assert chisquare_pvalue(counts, P * TRIALS) > ALPHA


def test_broken_vote_rule_is_caught() -> None:
    # the zero voter leads; the sampled chain wins only when it drew 0 too: P(0) = 0.15, not 0.1
    counts = first_token_counts(UsesQWhenItsChainWins, 1.0, 2.0)
    assert chisquare_pvalue(counts, P * TRIALS) < ALPHA



class MisalignedPool(MajorityVote):
    """Broken on purpose: a pooled chain keeps the q rows from the start of the worker's
    draft instead of from the target's bonus token on."""

    def _from_pool(self, i, context, k):  # type: ignore[no-untyped-def]
        e = self._pool.get(i)
        got = super()._from_pool(i, context, k)
        if got is None or e is None or e.q is None:
            return got
        return got[0], e.q[: len(got[0])]


FILTERED = SamplingParams(temperature=1.0, top_k=4, top_p=0.95, min_p=0.05)
POSITIONS = 4  # reply tokens checked: the later ones often come from the pool


def reply_position_counts(cls: type[MajorityVote]) -> tuple[np.ndarray, np.ndarray, int]:
    """Counts of the first POSITIONS reply tokens over TRIALS seeded replies, the target's
    filtered distribution at each (independent of the prefix, so the marginals must match),
    and how many rounds were served from the pool."""
    rng = np.random.default_rng(5)
    n_pos = 12
    logits = rng.normal(0.0, 1.2, size=(n_pos, V)).astype(np.float32)
    p = np.array([dense_probs(row, FILTERED) for row in logits])
    # q near enough to p to be kept often, far enough from its neighbours to show misalignment
    qs = 0.3 * p + 0.7 * rng.dirichlet(np.full(V, 0.5), size=n_pos)
    vote = cls([("draft-model", PerPosition(qs)), ("zero", Fixed("zero", [0]))], ahead=[0],
               weights=WeightConfig(window=10**9))
    vote.weights.weights = [2.0, 1.0]  # the sampled voter leads: its q rows are used
    counts = np.zeros((POSITIONS, V))
    hits = 0
    for trial in range(TRIALS // 2):
        seeds = np.random.SeedSequence(trial)
        sampler = Sampler(FILTERED, np.random.default_rng(seeds))
        history = [0]
        vote.begin(history, np.random.default_rng(seeds.spawn(1)[0]))
        while len(history) <= POSITIONS:
            d = vote.draft(DraftRequest(history, 1, 0.0, FILTERED))
            hits += vote.pool_hits
            pos = len(history) - 1
            verdict = RowJudge(sampler, history).chain(d.tokens, d.q, list(logits[pos : pos + len(d.tokens) + 1]))
            vote.accept(verdict.n_accepted)
            toks = verdict.tokens(d.tokens)
            vote.settle(len(history), toks)
            history = history + toks
        for j in range(POSITIONS):
            counts[j, history[1 + j]] += 1
    vote.close()
    return counts, p[:POSITIONS], hits


def test_pooled_sampled_drafts_keep_the_target_distribution_at_every_position() -> None:
    counts, p, hits = reply_position_counts(MajorityVote)
    assert hits > TRIALS // 10  # later positions were drafted ahead, during verification
    n = counts[0].sum()
    for j in range(POSITIONS):
        keep = p[j] > 0  # top-k / top-p / min-p removed the rest: never emitted
        assert counts[j][~keep].sum() == 0
        assert chisquare_pvalue(counts[j][keep], p[j][keep] * n) > ALPHA, j
    broken, p, _ = reply_position_counts(MisalignedPool)
    assert min(chisquare_pvalue(broken[j][p[j] > 0], p[j][p[j] > 0] * n) for j in range(POSITIONS)) < ALPHA


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def draft_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target less one of its 30 layers: about half its drafts are kept, so whole paths
    are accepted (the pool serves the next round) and many are rejected."""
    dst = tmp_path_factory.mktemp("draft") / "d.gguf"
    return merge_layer_ranges(model_path, dst, [(0, 14), (16, 29)])


def build(model: Model, draft: Path | None = None, **options: object) -> Strategy:
    spec = EngineSpec(
        strategy="minions", draft=draft, n_ctx=2048, n_threads=THREADS, strategy_options=dict(options)
    )
    return get_strategy_class("minions").build(model, spec)


def make_session(model: Model, strategy: Strategy) -> Session:
    return Session(model, LocalTarget(model, ContextParams(n_ctx=2048, n_threads=THREADS)), strategy)


def reply(
    session: Session, prompt: str, max_tokens: int, sampling: SamplingParams = GREEDY
) -> tuple[list[int], list[Round]]:
    """The reply's tokens and the strategy's own rounds (MinionsRound: the pool's counters);
    the voters' standings reach the session's events (the chat app's panel) unchanged."""
    rounds: list[Round] = []
    standings = []
    run = session.strategy.run

    def spy(g):  # type: ignore[no-untyped-def]
        for rnd in run(g):
            rounds.append(rnd)
            yield rnd

    session.strategy.run = spy  # type: ignore[method-assign]
    try:
        for ev in session.generate(prompt, sampling, max_tokens):
            if isinstance(ev, RoundStats):
                standings.append(ev.drafters)
            if isinstance(ev, Finished):
                assert standings == [r.drafters for r in rounds]
                return list(ev.tokens), rounds
    finally:
        del session.strategy.run
    raise AssertionError("no Finished event")


@pytest.fixture(scope="module")
def reference(model: Model) -> dict[str, list[int]]:
    out = {prompt: plain_reply(model, prompt, MAX_TOKENS) for prompt in PROMPTS}
    for i, tokens in enumerate(plain_conversation(model, TURNS, TURN_TOKENS)):
        out[f"turn{i}"] = tokens
    return out


def check_counters(rounds: list[Round]) -> None:
    drafted = sum(r.drafted for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)


def test_greedy_equals_plain_decoding(model: Model, reference: dict[str, list[int]]) -> None:
    strategy = build(model, max_draft=6, adaptive=False)  # fixed: rejections whatever the timings
    rounds: list[Round] = []
    for prompt in PROMPTS:
        session = make_session(model, strategy)
        tokens, got = reply(session, prompt, MAX_TOKENS)
        session.target.close()
        assert tokens == reference[prompt], prompt[:30]
        rounds += got
    check_counters(rounds)
    votes = [v for r in rounds for v in r.drafters]
    names = {v.name for v in votes if v.voted}
    assert len(names) >= 2, names  # the vote went to more than one voter
    assert any(v.weight != 1.0 for v in votes)  # weights moved with acceptance
    strategy.close()


def test_multi_turn_greedy_equals_plain_decoding(model: Model, reference: dict[str, list[int]]) -> None:
    strategy = build(model, max_draft=4, adaptive=False)
    session = make_session(model, strategy)
    rounds: list[Round] = []
    for i, turn in enumerate(TURNS):
        tokens, got = reply(session, turn, TURN_TOKENS)
        assert tokens == reference[f"turn{i}"], i
        rounds += got
    check_counters(rounds)
    session.close()


def test_adaptive_greedy_equals_plain_decoding(model: Model, reference: dict[str, list[int]]) -> None:
    """Default options: adaptive length, break-even threshold and the floor's gate (with a
    kept cost line that lets drafts through, so probes draft whatever this machine's load)."""
    flat_cost_line(model, THREADS)
    session = make_session(model, build(model))
    tokens, rounds = reply(session, PROMPTS[0], MAX_TOKENS)
    assert tokens == reference[PROMPTS[0]]
    assert sum(r.drafted for r in rounds) > 0
    session.close()


@pytest.mark.parametrize("ahead", [True, False])
def test_draft_model_stays_exact_ahead_or_in_turn(
    model: Model, draft_path: Path, reference: dict[str, list[int]], ahead: bool
) -> None:
    # Drafting ahead, the draft model computes beside the target on the strategy's worker;
    # in turn, it takes turns with the target on the target's own thread, so the process has
    # one OpenMP team (docs/facts.md §27).
    strategy = build(model, draft_path, max_draft=4, adaptive=False, ahead=ahead)
    assert isinstance(strategy, Minions)
    draft = strategy.vote.voters[0]
    assert isinstance(draft, DraftModelDrafter)
    session = make_session(model, strategy)
    prompt = PROMPTS[2]
    tokens, rounds = reply(session, prompt, 64)
    assert tokens == reference[prompt][:64]
    check_counters(rounds)
    computed = session.target.stage.ctx.compute_threads  # type: ignore[attr-defined]
    if ahead:
        mr = [r for r in rounds if isinstance(r, MinionsRound)]
        assert sum(r.pool_hits for r in mr) > 0  # rounds served from what the worker drafted ahead
        assert sum(r.ahead_ms for r in mr) > 0 and sum(r.overlap_ms for r in mr) > 0
        assert any(v.name == "draft-model" and v.voted for r in mr for v in r.drafters)
        assert draft.ctx.compute_threads.isdisjoint(computed)
    else:
        assert draft.ctx.compute_threads == computed and len(computed) == 1
    session.close()


def sampled_reply(model: Model, draft_path: Path, seed: int) -> tuple[list[int], list[Round]]:
    strategy = build(model, draft_path, max_draft=2, adaptive=False, ahead=True)
    session = make_session(model, strategy)
    try:
        return reply(session, "Tell me about cats.", 40, SamplingParams(temperature=0.7, seed=seed))
    finally:
        session.close()


@pytest.mark.slow  # seeded replies repeat with a draft thread by default: test_pearl
def test_seeded_sampling_repeats_with_a_worker_drafting(model: Model, draft_path: Path) -> None:
    first, rounds = sampled_reply(model, draft_path, 11)
    check_counters(rounds)
    assert sum(r.pool_hits for r in rounds if isinstance(r, MinionsRound)) > 0  # drafted ahead
    assert sampled_reply(model, draft_path, 11)[0] == first
    assert sampled_reply(model, draft_path, 12)[0] != first


def test_generate_cli_runs_minions(capsys: pytest.CaptureFixture[str], draft_path: Path) -> None:
    argv = ["generate", "--strategy", "minions", "-t", "1", "--max-tokens", "24", "--json"]
    assert main([*argv, "List the numbers 1, 2, 3, 4, 5, 6, 7, 8, 9."]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["strategy"] == "minions" and out["tokens"] and "drafted" in out
    assert main([*argv, "--draft", str(draft_path), "Say hi."]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"] == "minions"


def test_bad_options_are_one_line_errors(model: Model) -> None:
    with pytest.raises(PotluckError, match="ngram_short and ngram_max are both 5"):
        build(model, ngram_short=5)
    with pytest.raises(PotluckError, match="no option 'min_draft_p'"):
        build(model, min_draft_p=0.5)
    with pytest.raises(PotluckError, match="ahead must be true or false"):
        build(model, ahead="yes")


@pytest.mark.slow
def test_drafting_ahead_stops_at_a_full_context(model: Model, draft_path: Path) -> None:
    """The worker never drafts past the context: a reply that fills it ends as plain decoding's.
    One thread: the context's end, not the thread count, is what this checks."""
    n_ctx = 256
    prompt = "Write a long, detailed story about a robot who learns to cook. Use many paragraphs."
    outs = []
    for strategy in (Plain(), None):
        if strategy is None:
            spec = EngineSpec(
                strategy="minions", draft=draft_path, n_ctx=n_ctx, n_threads=1,
                strategy_options={"max_draft": 8, "adaptive": False, "ahead": True},
            )
            strategy = get_strategy_class("minions").build(model, spec)
        session = Session(model, LocalTarget(model, ContextParams(n_ctx=n_ctx, n_threads=1)), strategy)
        *_, fin = session.generate(prompt, GREEDY, 1024)
        session.close()
        assert isinstance(fin, Finished) and fin.reason == "context_full"
        outs.append(fin)
    assert outs[0].tokens == outs[1].tokens and outs[1].drafted > outs[1].accepted > 0
