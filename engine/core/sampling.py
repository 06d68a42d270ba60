"""Turn logits into the distribution a token is drawn from, and draw from it with an explicitly
seeded RNG.

The same :func:`distribution` serves plain sampling and every verifier, so that a draft's q and
the target's p go through the same penalties and filters (the lossless acceptance rule needs
this). Both are kept as :class:`Candidates`, the few tokens the filters leave (40 at most with
llama.cpp's defaults) rather than a row over the whole vocabulary, so drawing, accepting and
the residual all cost microseconds (docs/facts.md §34).

The order and meaning of the filters are llama.cpp's (:mod:`.sampling_kernel`): penalties,
top-k, top-p, min-p, then temperature; the penalties are llama.cpp's too (repeat, frequency and
presence, over the last ``repeat_last_n`` tokens of the conversation).

**Under a grammar** (structured output, forced tool calls) the distribution is the filtered one
restricted to the tokens the grammar allows next, renormalized; if it allows none of them, the
filters run again over the allowed tokens only (the logits of every other token at -inf).
Greedy is the likeliest allowed token either way. Only the few candidates the filters leave are
checked against the grammar in the usual case (a check costs about a microsecond a token, the
whole vocabulary tens of milliseconds, docs/facts.md §36). llama.cpp's own sampler does the
same first check (sample, then test the one token against the grammar) but spreads the
refused mass differently; this rule is a plain function of the logits and the grammar's state,
so speculative decoding can keep it exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # <= 0 means greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off (llama.cpp's rule: divide positive logits)
    frequency_penalty: float = 0.0  # 0.0: off (minus this times the token's count in the window)
    presence_penalty: float = 0.0  # 0.0: off (minus this once for a token in the window)
    repeat_last_n: int = 64  # the penalties' window: the conversation's last tokens
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty is on: the distribution depends on the tokens before it."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


GREEDY = SamplingParams()


@dataclass(frozen=True)
class Candidates:
    """A filtered distribution over the tokens it can produce.

    ``tokens``: int64 [n], ascending token ids; ``probs``: float64 [n], summing to 1. Every other
    token has probability 0. Greedy parameters give one candidate (q = delta), so deterministic
    and sampled drafts share one code path in the verifier.
    """

    tokens: np.ndarray
    probs: np.ndarray

    @classmethod
    def only(cls, token: int) -> Candidates:
        return cls(np.array([token], dtype=np.int64), np.ones(1))

    def prob(self, token: int) -> float:
        """p(token); 0 for a token the filters removed."""
        i = int(np.searchsorted(self.tokens, token))
        return float(self.probs[i]) if i < self.tokens.shape[0] and self.tokens[i] == token else 0.0

    def probs_at(self, tokens: np.ndarray) -> np.ndarray:
        """p at each of ``tokens`` (ascending), 0 where it has no mass: float64 [len(tokens)]."""
        i = np.minimum(np.searchsorted(self.tokens, tokens), self.tokens.shape[0] - 1)
        return np.where(self.tokens[i] == tokens, self.probs[i], 0.0)

    def most_likely(self) -> tuple[int, float]:
        """The likeliest token and its probability."""
        i = int(np.argmax(self.probs))
        return int(self.tokens[i]), float(self.probs[i])

    def token_at(self, u: float) -> int:
        """The token where the cumulative probability, in token order, first passes ``u`` in
        [0, 1): the one rule every draw uses (plain sampling, recovered and bonus tokens)."""
        return int(self.tokens[_kernels().token_index(self.probs, u)])


class TokenFilter(Protocol):
    """Which tokens may come next (a grammar's state, :class:`~.runtime.Grammar`)."""

    def allows(self, tokens: np.ndarray) -> np.ndarray:
        """bool [len(tokens)]: whether each of ``tokens`` may come next."""
        ...


class NoTokenAllowed(Exception):
    """A grammar that allows no token at all where a token must come (never for a grammar
    whose every state can go on or end)."""


def penalize(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """llama.cpp's penalties over the last ``repeat_last_n`` tokens of ``history`` (a copy;
    ``logits`` itself when no penalty is on). A token seen ``c`` times there: its logit is
    divided by ``repeat_penalty`` (multiplied when negative), then lowered by
    ``c * frequency_penalty + presence_penalty``."""
    if not params.penalized or not history or params.repeat_last_n <= 0:
        return logits
    seen, count = np.unique(np.asarray(history[-params.repeat_last_n :], dtype=np.int64), return_counts=True)
    out = np.array(logits, dtype=np.float32, copy=True)
    vals = out[seen]
    if params.repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / params.repeat_penalty, vals * params.repeat_penalty)
    out[seen] = vals - (count * params.frequency_penalty + params.presence_penalty)
    return out


@functools.cache
def _kernels() -> ModuleType:
    """The numba kernels, imported on first use: importing numba costs 0.4 s, which neither the
    CLI's start nor a worker's stage process (it imports this module) should pay."""
    from . import sampling_kernel

    return sampling_kernel


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel: with the model's load, off any UI
    thread, not in the first sampled token."""
    from . import sampling_kernel

    sampling_kernel.warm_up()


def distribution(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int] = (), allowed: TokenFilter | None = None
) -> Candidates:
    """The distribution one position is drawn from: penalties over ``history`` (the tokens
    before it), then the filters and temperature, then ``allowed`` (a grammar: see the
    module's docstring). ``logits`` is [vocab]."""
    logits = penalize(logits, history, params)
    if params.greedy:
        best = int(np.argmax(logits))
        if allowed is None or allowed.allows(np.array([best]))[0]:
            return Candidates.only(best)
        return Candidates.only(int(np.argmax(only_allowed(logits, 1, allowed))))
    tokens, probs = _filtered(logits, params)
    if allowed is None:
        return Candidates(tokens, probs)
    ok = allowed.allows(tokens)
    if not ok.any():
        tokens, probs = _filtered(only_allowed(logits, params.top_k, allowed), params)
        ok = probs > 0.0  # tokens the mask left at -inf (fewer allowed than top_k)
    kept = probs[ok]
    return Candidates(tokens[ok], kept / kept.sum())


def _filtered(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    return _kernels().candidates(
        np.ascontiguousarray(logits, dtype=np.float32),
        params.top_k, params.top_p, params.min_p, params.temperature,
    )


# Blocks of the likeliest tokens checked against a grammar before the whole vocabulary is.
_SCAN_BLOCKS = (256, 4096)


def only_allowed(logits: np.ndarray, top_k: int, allowed: TokenFilter) -> np.ndarray:
    """``logits`` at -inf wherever the grammar refuses, as far as filters keeping the ``top_k``
    likeliest tokens can tell (0: no top-k, every token is checked). Blocks of the likeliest
    tokens are checked first: once ``top_k`` allowed ones in a block all beat every logit
    outside it, nothing outside can enter the filters' pool."""
    n = logits.shape[0]
    out = np.full(n, -np.inf, dtype=np.float32)
    for m in _SCAN_BLOCKS if top_k > 0 else ():
        if m >= n:
            break
        order = np.argpartition(-logits, m)  # order[:m]: the m largest; order[m]: the next one
        block = order[:m]
        found = block[allowed.allows(block)]
        if found.shape[0] >= top_k and np.partition(logits[found], -top_k)[-top_k] > logits[order[m]]:
            out[found] = logits[found]
            return out
    ids = np.arange(n)
    ok = allowed.allows(ids)
    if not ok.any():
        raise NoTokenAllowed("the grammar allows no token here")
    out[ok] = logits[ok]
    return out


def logprobs(row: np.ndarray, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under the softmax of ``row`` (raw logits [vocab]) and the
    ``n_top`` likeliest tokens' (likeliest first, ties by lower id)."""
    r = np.asarray(row, dtype=np.float64)
    top = float(r.max())
    lse = top + float(np.log(np.exp(r - top).sum()))
    best: list[tuple[int, float]] = []
    if n_top > 0:
        ids = np.argpartition(-r, n_top - 1)[:n_top] if n_top < r.shape[0] else np.arange(r.shape[0])
        ids = ids[np.lexsort((ids, -r[ids]))]
        best = [(int(i), float(r[i] - lse)) for i in ids]
    return float(r[token] - lse), best


class Grammar(Protocol):
    """A reply's grammar (:class:`~.grammar.ReplyGrammar`): what may come after the
    conversation so far plus ``after``, tokens guessed past it."""

    def at(self, after: Sequence[int] = ()) -> TokenFilter: ...


class Sampler:
    """Draws tokens for one generation; owns its RNG so runs with one seed repeat exactly.
    Each draw takes one uniform, so the RNG stream is easy to reason about. With a
    ``grammar``, every token it draws is one the grammar allows there."""

    def __init__(
        self, params: SamplingParams, rng: np.random.Generator | None = None, grammar: Grammar | None = None
    ) -> None:
        self.params = params
        self.rng = rng if rng is not None else np.random.default_rng(params.seed)
        self.grammar = grammar

    def distribution(self, logits: np.ndarray, history: Sequence[int] = (), after: Sequence[int] = ()) -> Candidates:
        """The target's distribution after the conversation and ``after`` (guessed tokens past
        it); ``history`` is what the penalties see."""
        return distribution(logits, self.params, history, self.grammar.at(after) if self.grammar else None)

    def sample(self, logits: np.ndarray, history: Sequence[int] = (), after: Sequence[int] = ()) -> int:
        if self.params.greedy and not self.params.penalized and self.grammar is None:
            return int(np.argmax(logits))
        return self.draw(self.distribution(logits, history, after))

    def draw(self, p: Candidates) -> int:
        return p.token_at(self.rng.random())

    def uniform(self) -> float:
        return float(self.rng.random())
