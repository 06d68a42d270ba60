"""Turn logits into a probability vector and draw from it with an explicitly seeded RNG.

The same :func:`probs` is used by plain sampling and by every verifier, so that a draft's
q and the target's p go through the same temperature / top-k / top-p / min-p filters
(the lossless acceptance rule needs this).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # <= 0 means greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off (llama.cpp's rule: divide positive logits)
    repeat_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams()


def apply_repeat_penalty(
    logits: np.ndarray, history: Sequence[int], params: SamplingParams
) -> np.ndarray:
    """llama.cpp's repetition penalty over the last ``repeat_last_n`` tokens (a copy)."""
    if params.repeat_penalty == 1.0 or not history:
        return logits
    recent = np.unique(np.asarray(history[-params.repeat_last_n :], dtype=np.int64))
    out = np.array(logits, dtype=np.float32, copy=True)
    vals = out[recent]
    out[recent] = np.where(vals > 0, vals / params.repeat_penalty, vals * params.repeat_penalty)
    return out


def probs(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """The filtered distribution for one position: float64 [vocab], sums to 1.

    Greedy parameters give a one-hot vector on the argmax (q = delta), so deterministic and
    sampled drafts share one code path in the verifier.
    """
    logits = apply_repeat_penalty(np.asarray(logits), history, params)
    p = np.zeros(logits.shape[-1], dtype=np.float64)
    if params.greedy:
        p[int(np.argmax(logits))] = 1.0
        return p
    z = logits.astype(np.float64) / params.temperature
    z -= z.max()
    e = np.exp(z)
    keep = np.ones_like(e, dtype=bool)
    if params.top_k and params.top_k < e.shape[0]:
        kth = np.partition(e, -params.top_k)[-params.top_k]
        keep &= e >= kth
    if params.top_p < 1.0:
        order = np.argsort(-e, kind="stable")
        sorted_e = np.where(keep[order], e[order], 0.0)
        cum = np.cumsum(sorted_e) / sorted_e.sum()
        cutoff = int(np.searchsorted(cum, params.top_p)) + 1  # smallest set with mass >= top_p
        top = np.zeros_like(keep)
        top[order[:cutoff]] = True
        keep &= top
    if params.min_p > 0.0:
        keep &= e >= params.min_p * e[keep].max()
    e = np.where(keep, e, 0.0)
    p[:] = e / e.sum()
    return p


def inverse_cdf(p: np.ndarray, u: float) -> int:
    """The token where the cumulative probability first passes ``u`` in [0, 1): the one rule
    every draw uses (plain sampling here, recovered and bonus tokens in the verifier)."""
    idx = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
    return min(idx, p.shape[0] - 1)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw: one uniform per token, so the RNG stream is easy to reason about."""
    return inverse_cdf(p, rng.random())


class Sampler:
    """Draws tokens for one generation; owns its RNG so runs with one seed repeat exactly."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator | None = None) -> None:
        self.params = params
        self.rng = rng if rng is not None else np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        if self.params.greedy and self.params.repeat_penalty == 1.0:
            return int(np.argmax(logits))
        return self.draw(probs(logits, self.params, history))

    def draw(self, p: np.ndarray) -> int:
        return draw(p, self.rng)

    def uniform(self) -> float:
        return float(self.rng.random())
