"""Dense probability rows <-> the sampler's :class:`Candidates`, for test oracles that reason
over a whole (small) vocabulary."""

from __future__ import annotations

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
