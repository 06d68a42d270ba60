"""Dense probability rows <-> the sampler's :class:`Candidates`, for test oracles that reason
over a whole (small) vocabulary, and the chi-square test the distribution tests use."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from potluck.engine.core.sampling import Candidates, SamplingParams, distribution, penalize


def candidates(p: np.ndarray) -> Candidates:
    """The tokens of a dense row ``p`` with mass, as the sampler keeps them."""
    tokens = np.flatnonzero(np.asarray(p) > 0).astype(np.int64)
    return Candidates(tokens, np.asarray(p, dtype=np.float64)[tokens])


def dense(c: Candidates, n_vocab: int) -> np.ndarray:
    """float64 [n_vocab]: ``c``'s probabilities, 0 elsewhere."""
    out = np.zeros(n_vocab, dtype=np.float64)
    out[c.tokens] = c.probs
    return out


def dense_probs(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """The sampler's distribution for ``logits`` as a dense row over the vocabulary."""
    return dense(distribution(logits, params, history), np.asarray(logits).shape[-1])


def constrained_probs(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int], allowed: np.ndarray
) -> np.ndarray:
    """The rule a grammar samples by (core/sampling.py), written from its definition over the
    whole vocabulary: the filtered distribution restricted to the ``allowed`` tokens (bool
    [vocab]) and renormalized; if none of its tokens is allowed, the filters over the allowed
    tokens only (every other logit at -inf)."""
    p = dense_probs(logits, params, history) * allowed
    if p.sum() > 0:
        return p / p.sum()
    masked = np.where(allowed, penalize(np.asarray(logits, dtype=np.float32), history, params), -np.inf)
    return dense_probs(masked.astype(np.float32), params)


def chisquare_pvalue(observed: Sequence[float] | np.ndarray, expected: Sequence[float] | np.ndarray) -> float:
    """Pearson's chi-square test of counts against expected counts (``scipy.stats.chisquare``'s
    p-value). Written here rather than imported: scipy made every numba process the suite
    starts 0.4 s dearer (numba imports scipy.linalg whenever it is installed; facts §38)."""
    obs = np.asarray(observed, dtype=np.float64)
    exp = np.asarray(expected, dtype=np.float64)
    assert obs.shape == exp.shape and abs(obs.sum() - exp.sum()) <= 1e-8 * exp.sum(), "counts and expectation differ"
    return chi2_sf(float(((obs - exp) ** 2 / exp).sum()), obs.size - 1)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with ``df`` degrees of freedom: the regularized upper gamma
    Q(df/2, x/2), exact for whole and half-whole orders by Q(a+1, h) = Q(a, h) + h^a e^-h / a!
    from Q(1, h) = e^-h or Q(1/2, h) = erfc(sqrt h)."""
    assert df >= 1
    h = x / 2
    if h <= 0:
        return 1.0
    a, q = (1.0, math.exp(-h)) if df % 2 == 0 else (0.5, math.erfc(math.sqrt(h)))
    while a < df / 2:
        q += math.exp(a * math.log(h) - h - math.lgamma(a + 1))
        a += 1
    return min(q, 1.0)
