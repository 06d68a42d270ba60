"""Speculative sampling keeps the target's distribution at EVERY draft position.

A toy language model over a 5-token vocabulary gives logits that depend on the whole prefix,
for the target and for a different draft, so p and q differ at each position; both go
through the product's filters (temperature, top-k, top-p, min-p and the repeat, frequency and
presence penalties over the history plus the drafts so far) exactly as the strategies call
them.

A round drafts k tokens from q, verifies them, and emits the kept prefix plus one token; the
text then continues with plain sampling. The first k + 1 tokens of that process must follow
the target's own joint distribution:
- exactly, by enumerating every draft chain and every accept / reject branch;
- empirically, by running the production :class:`RowJudge` (what every strategy verifies
  with: it keeps the penalties' window over the conversation and the drafts kept before
  each position) with a seeded generator.
Both checks also run with a deliberately broken residual and must catch it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import numpy as np
import pytest

from potluck.engine.core.sampling import Candidates, Sampler, SamplingParams, distribution
from potluck.engine.speculation import inflight
from potluck.engine.speculation.inflight import RowJudge
from potluck.engine.speculation.verify import accept_prob, judge, residual, verify_chain

from .support.distributions import chisquare_pvalue, dense

VOCAB = 5
K = 3  # drafts per round: positions 0..3 are all checked
HISTORY = (1, 3)  # earlier conversation, seen by the repetition penalty

FILTERS = {
    "temperature": SamplingParams(temperature=0.9),
    "top_k": SamplingParams(temperature=1.1, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "min_p": SamplingParams(temperature=1.2, min_p=0.15),
    "repeat_penalty": SamplingParams(temperature=0.8, repeat_penalty=1.6, repeat_last_n=8),
    "frequency_presence": SamplingParams(temperature=1.0, frequency_penalty=0.9, presence_penalty=0.6,
                                         repeat_last_n=4),
    "all": SamplingParams(temperature=0.9, top_k=4, top_p=0.9, min_p=0.05, repeat_penalty=1.3,
                          frequency_penalty=0.4, presence_penalty=0.3),
}


def toy_logits(seed: int, prefix: tuple[int, ...]) -> np.ndarray:
    """Logits that depend on the whole prefix (a different model per seed)."""
    rng = np.random.default_rng([seed, len(prefix), *prefix])
    return rng.normal(0.0, 2.0, VOCAB).astype(np.float32)


@functools.cache
def candidates(seed: int, params: SamplingParams, prefix: tuple[int, ...]) -> Candidates:
    """The filtered distribution the product samples from after HISTORY + prefix (a pure
    function: memoized, the enumerations ask for the same prefixes again and again)."""
    return distribution(toy_logits(seed, prefix), params, [*HISTORY, *prefix])


def dist(seed: int, params: SamplingParams, prefix: tuple[int, ...]) -> np.ndarray:
    """The same as a dense row over the vocabulary."""
    return dense(candidates(seed, params, prefix), VOCAB)


def broken_residual(p: Candidates, q: Candidates | None, x: int) -> Candidates:
    return p


TARGET, DRAFT = 11, 29  # model seeds


def target_joint(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first K + 1 tokens) under plain sampling from the target."""
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=K + 1):
        pr = 1.0
        for i in range(K + 1):
            pr *= dist(TARGET, params, seq[:i])[seq[i]]
            if pr == 0.0:
                break
        if pr > 0:
            out[seq] = pr
    return out


def round_joint(
    params: SamplingParams, residual_fn: Callable = residual
) -> dict[tuple[int, ...], float]:
    """P(first K + 1 tokens) of one speculative round followed by plain sampling, exactly."""
    out: dict[tuple[int, ...], float] = {}

    def extend(seq: tuple[int, ...], pr: float) -> None:
        """Plain sampling from the target after what the round emitted."""
        if len(seq) == K + 1:
            out[seq] = out.get(seq, 0.0) + pr
            return
        p = dist(TARGET, params, seq)
        for t in np.flatnonzero(p):
            extend((*seq, int(t)), pr * p[t])

    def verify(chain: tuple[int, ...], i: int, pr: float) -> None:
        """Position i of the round: accept chain[i], or emit the recovered token."""
        p = dist(TARGET, params, chain[:i])
        if i == len(chain):  # every draft kept: the bonus token
            for t in np.flatnonzero(p):
                extend((*chain, int(t)), pr * p[t])
            return
        q = candidates(DRAFT, params, chain[:i])
        x = chain[i]
        pc = candidates(TARGET, params, chain[:i])
        a = accept_prob(pc, q, x)
        if a > 0:
            verify(chain, i + 1, pr * a)
        if a < 1:
            r = dense(residual_fn(pc, q, x), VOCAB)
            for t in np.flatnonzero(r):
                extend((*chain[:i], int(t)), pr * (1 - a) * r[t])

    for chain in itertools.product(range(VOCAB), repeat=K):
        pr = 1.0
        for i in range(K):
            pr *= dist(DRAFT, params, chain[:i])[chain[i]]
            if pr == 0.0:
                break
        if pr > 0:
            verify(chain, 0, pr)
    return out


def max_gap(a: dict[tuple[int, ...], float], b: dict[tuple[int, ...], float]) -> float:
    return max(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


@pytest.mark.parametrize("name", list(FILTERS))
def test_every_position_keeps_the_target_distribution_exactly(name: str) -> None:
    params = FILTERS[name]
    want = target_joint(params)
    assert abs(sum(want.values()) - 1.0) < 1e-9
    # p and q really differ at every position (otherwise every draft would be accepted)
    for i in range(K):
        prefix = next(iter(want))[:i]
        assert np.abs(dist(TARGET, params, prefix) - dist(DRAFT, params, prefix)).max() > 0.05
    assert max_gap(round_joint(params), want) < 1e-12
    assert max_gap(round_joint(params, broken_residual), want) > 1e-3  # the control is caught


def sampled_sequences(
    params: SamplingParams, n: int, residual_fn: Callable = residual, monkeypatch: pytest.MonkeyPatch | None = None
) -> list[tuple[int, ...]]:
    """Rounds through the production :class:`RowJudge` (seeded), continued by plain sampling:
    the judge sees the raw target logits after each draft prefix and applies the penalties
    over the conversation and the drafts itself, as in every strategy."""
    if monkeypatch is not None:
        monkeypatch.setattr(inflight, "verify_chain", functools.partial(verify_chain, residual_fn=residual_fn))
    rng = np.random.default_rng(2024)
    out = []
    for _ in range(n):
        chain: list[int] = []
        qs = []
        for _ in range(K):
            q = candidates(DRAFT, params, tuple(chain))
            chain.append(int(rng.choice(VOCAB, p=dense(q, VOCAB))))
            qs.append(q)
        history = list(HISTORY)
        judge_ = RowJudge(Sampler(params, rng), history)
        verdict = judge_.chain(chain, qs, [toy_logits(TARGET, tuple(chain[:i])) for i in range(K + 1)])
        seq = verdict.tokens(chain)
        while len(seq) < K + 1:
            seq.append(int(rng.choice(VOCAB, p=dist(TARGET, params, tuple(seq)))))
        out.append(tuple(seq[: K + 1]))
    return out


def chi2_p(samples: list[tuple[int, ...]], want: dict[tuple[int, ...], float]) -> float:
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    big = [s for s, pr in want.items() if pr * n >= 5]
    obs = [counts.get(s, 0) for s in big]
    exp = [want[s] * n for s in big]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    return chisquare_pvalue(obs, exp)


@pytest.mark.parametrize("name", ["all", "repeat_penalty", "frequency_presence"])
def test_seeded_rounds_follow_the_target_joint(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    params = FILTERS[name]
    want = target_joint(params)
    assert chi2_p(sampled_sequences(params, 6000), want) > 1e-3
    assert chi2_p(sampled_sequences(params, 6000, broken_residual, monkeypatch), want) < 1e-3


def test_a_judge_that_forgets_the_drafts_kept_this_round_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Penalties depend on every token before a position, drafts kept earlier in the same
    round included: a judge whose window stops at the conversation must fail the test."""
    params = FILTERS["frequency_presence"]
    want = target_joint(params)
    monkeypatch.setattr(RowJudge, "recent", lambda self, extra: [*self.history][-self.params.repeat_last_n :])
    assert chi2_p(sampled_sequences(params, 6000), want) < 1e-3


def test_judge_is_the_chain_rule_position_by_position() -> None:
    """pearl verifies position by position with judge(): same tokens as verify_chain."""
    params = FILTERS["all"]
    for seed in range(200):
        rng = np.random.default_rng(seed)
        chain = [int(x) for x in rng.integers(0, VOCAB, K)]
        ps = [candidates(TARGET, params, tuple(chain[:i])) for i in range(K + 1)]
        qs = [candidates(DRAFT, params, tuple(chain[:i])) for i in range(K)]
        uniform = functools.partial(lambda g: float(g.random()), np.random.default_rng(seed + 1000))
        whole = verify_chain(chain, ps.__getitem__, qs, uniform)
        uniform = functools.partial(lambda g: float(g.random()), np.random.default_rng(seed + 1000))
        tokens: list[int] = []
        for i, x in enumerate(chain):
            rec = judge(ps[i], qs[i], x, uniform)
            if rec is not None:
                tokens.append(rec)
                break
            tokens.append(x)
        assert tokens == whole.tokens(chain)[: len(tokens)]
