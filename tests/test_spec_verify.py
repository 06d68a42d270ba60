"""The verifier keeps the target's distribution: exactly (computed) and empirically (sampled).

Each property is also shown to *fail* for a deliberately broken residual step, so that the
tests could notice a real bug.
"""

from __future__ import annotations

import numpy as np
import pytest

from potluck.engine.core.sampling import Candidates
from potluck.engine.speculation.verify import TokenTree, residual, verify_chain, verify_greedy

from .support.distributions import candidates, chi2_sf, chisquare_pvalue, dense
from .support.trees import chain_first_token_dist, tree_first_token_dist, verify_tree

VOCAB = 7


def random_dist(rng: np.random.Generator, zeros: int = 2) -> np.ndarray:
    """A distribution with some exact zeros, as top-k/top-p filtering produces."""
    d = rng.dirichlet(np.full(VOCAB, 0.7))
    d[rng.choice(VOCAB, size=zeros, replace=False)] = 0.0
    return d / d.sum()


def broken_residual(p: Candidates, q: Candidates | None, x: int) -> Candidates:
    """The classic bug: resample from p itself after a rejection."""
    return p


# --------------------------------------------------------------------------- exact


@pytest.mark.parametrize("seed", range(20))
def test_chain_output_distribution_is_exactly_p(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p, q = random_dist(rng), random_dist(rng)
    np.testing.assert_allclose(chain_first_token_dist(p, q), p, atol=1e-12)
    for x in range(VOCAB):  # deterministic drafts, q = delta(x)
        np.testing.assert_allclose(chain_first_token_dist(p, None, x), p, atol=1e-12)


def test_exact_check_detects_a_broken_residual() -> None:
    rng = np.random.default_rng(1)
    p, q = random_dist(rng, zeros=0), random_dist(rng, zeros=0)
    wrong = chain_first_token_dist(p, q, residual_fn=broken_residual)
    assert np.abs(wrong - p).max() > 1e-2
    x = int(np.argmax(p))
    wrong_det = chain_first_token_dist(p, None, x, residual_fn=broken_residual)
    assert np.abs(wrong_det - p).max() > 1e-2


@pytest.mark.parametrize("seed", range(20))
def test_tree_first_token_distribution_is_exactly_p(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    p = random_dist(rng)
    n_children = int(rng.integers(1, 5))
    # deterministic branches with distinct first tokens (N-gram candidates)
    firsts = rng.choice(VOCAB, size=n_children, replace=False)
    chains = [[int(f), int(rng.integers(VOCAB))] for f in firsts]
    tree = TokenTree.from_chains(root=0, chains=chains)
    np.testing.assert_allclose(tree_first_token_dist(tree, p), p, atol=1e-12)
    # stochastic branches, each from its own drafter's q (Minions-style voters)
    qs = tuple(random_dist(rng) for _ in range(n_children))
    stoch = TokenTree(
        tokens=(0, *([0] * n_children)), parent=(-1, *([0] * n_children)), q=(None, *map(candidates, qs))
    )
    np.testing.assert_allclose(tree_first_token_dist(stoch, p), p, atol=1e-12)


def test_residual_zeroes_the_rejected_deterministic_draft() -> None:
    p = candidates(np.array([0.5, 0.25, 0.25]))
    np.testing.assert_allclose(dense(residual(p, None, 0), 3), [0.0, 0.5, 0.5])


def test_greedy_accepts_the_matching_prefix() -> None:
    target = [5, 6, 9, 1]  # target argmax after 0, 1, 2, 3 drafts
    v = verify_greedy([5, 6, 7], lambda i: target[i])
    assert (v.n_accepted, v.token) == (2, 9)
    assert v.tokens([5, 6, 7]) == [5, 6, 9]
    v = verify_greedy([5, 6, 9], lambda i: target[i])
    assert (v.n_accepted, v.token) == (3, 1)  # bonus token


# --------------------------------------------------------------------------- sampled


def sample_stream(
    p: np.ndarray, q: np.ndarray | None, k: int, n_tokens: int, rng: np.random.Generator, **kw
) -> list[int]:
    """``n_tokens`` from draft/verify rounds; the target is i.i.d. ``p`` at every position."""
    out: list[int] = []
    while len(out) < n_tokens:
        if q is None:  # deterministic drafter: always proposes the same guess
            drafts, q_rows = [int(np.argmax(q_det))] * k, None
        else:
            drafts = [int(rng.choice(VOCAB, p=q)) for _ in range(k)]
            q_rows = [candidates(q)] * k
        v = verify_chain(drafts, lambda i: candidates(p), q_rows, rng.random, **kw)
        out += v.tokens(drafts)
    return out[:n_tokens]


q_det = np.array([0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.7])  # guess = token 6


def chi2_pvalue(tokens: list[int], p: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=VOCAB)
    keep = p > 0
    assert counts[~keep].sum() == 0, "emitted a token of probability zero"
    return chisquare_pvalue(counts[keep], p[keep] * len(tokens))


@pytest.mark.parametrize("deterministic", [False, True])
def test_sampled_rounds_follow_p_and_broken_residual_is_caught(deterministic: bool) -> None:
    rng = np.random.default_rng(7)
    p = np.array([0.30, 0.05, 0.15, 0.0, 0.10, 0.25, 0.15])
    q = None if deterministic else np.array([0.05, 0.40, 0.05, 0.0, 0.30, 0.05, 0.15])
    trials = 3000
    # position 2 of each stream: reached through accepted drafts, recoveries and bonuses
    good = [sample_stream(p, q, 3, 3, rng)[2] for _ in range(trials)]
    assert chi2_pvalue(good, p) > 1e-4
    bad = [sample_stream(p, q, 3, 3, rng, residual_fn=broken_residual)[2] for _ in range(trials)]
    assert chi2_pvalue(bad, p) < 1e-6


def test_sampled_tree_follows_p_and_missing_residual_update_is_caught() -> None:
    rng = np.random.default_rng(11)
    p = np.array([0.30, 0.05, 0.15, 0.0, 0.10, 0.25, 0.15])
    tree = TokenTree.from_chains(0, [[5, 1], [2, 2], [6]])
    trials = 4000
    good = [verify_tree(tree, lambda n: candidates(p), rng.random) for _ in range(trials)]
    firsts = [tree.tokens[v.path[0]] if v.path else v.token for v in good]
    assert chi2_pvalue(firsts, p) > 1e-4

    def forgetful_tree(t: TokenTree) -> int:
        """Tries each child against the *original* p: over-accepts later children."""
        for child in t.children(0):
            if rng.random() < p[t.tokens[child]]:
                return t.tokens[child]
        return int(rng.choice(VOCAB, p=dense(residual(candidates(p), None, t.tokens[t.children(0)[-1]]), VOCAB)))

    bad = [forgetful_tree(tree) for _ in range(trials)]
    assert chi2_pvalue(bad, p) < 1e-6


@pytest.mark.parametrize(
    ("df", "at_05", "at_001"),
    [(1, 3.841, 10.828), (2, 5.991, 13.816), (5, 11.070, 20.515), (10, 18.307, 29.588), (30, 43.773, 59.703),
     (100, 124.342, 149.449)],
)
def test_the_chi_square_p_value_meets_the_published_critical_values(df: int, at_05: float, at_001: float) -> None:
    """The distribution tests' p-value (tests/support/distributions.py) against a chi-square
    table's 5 % and 0.1 % points (three decimals), odd and even orders."""
    assert chi2_sf(at_05, df) == pytest.approx(0.05, rel=1e-3)
    assert chi2_sf(at_001, df) == pytest.approx(0.001, rel=1e-3)
    assert chisquare_pvalue([10, 10, 10], [10, 10, 10]) == 1.0
