"""Prompt lookup drafter: copy the span that followed the longest earlier match of the
conversation's tail (Saxena 2023, "Prompt Lookup Decoding"; llama.cpp's ``lookup``).

Why a third cheap source next to the N-gram tables: a reply that quotes its input (code
editing, summaries, answers about a document) continues ONE earlier passage for many tokens.
The tables pick each next token by its own statistics, so a chain can hop to another passage
after a common 4-gram; the lookup keeps copying the passage whose match is longest (up to
``max_match`` tokens, far more context than ANPD's N), and proposes nothing below
``min_match`` tokens of evidence. Per-token work is a numba kernel
(:mod:`potluck.engine.speculation.kernels.lookup`).

Like :class:`~potluck.engine.speculation.drafters.ngram.NgramDrafter` it learns its hit rate from what the
target accepted (per match length: a 12-token match is better evidence than a 2-token one)
and stops once the chance that the whole copy so far is accepted falls below the request's
``min_accept_p``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..kernels.lookup import lookup_draft, warm_up
from . import Draft, DraftRequest

PRIOR_RATE = 0.5  # weak prior per token (PRIOR_WEIGHT pseudo-drafts), replaced by measurements
PRIOR_WEIGHT = 4.0
EXPLORE = 0.2  # bonus / sqrt(attempts), as in the N-gram drafter


class LookupDrafter:
    name = "lookup"
    step_ms = 0.0  # one scan of the token array: microseconds

    def __init__(self, min_match: int = 2, max_match: int = 16) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match = min_match
        self.max_match = max_match
        warm_up()
        self.toks = np.zeros(1024, dtype=np.int32)
        self.n = 0
        self.attempts = np.full(max_match + 1, PRIOR_WEIGHT)
        self.hits = np.full(max_match + 1, PRIOR_WEIGHT * PRIOR_RATE)
        self._last: tuple[int, int] = (0, 0)  # (match length, tokens) of the last draft

    # -- the drafter contract
    def begin(self, context: Sequence[int], rng: np.random.Generator) -> None:
        self._sync(context)  # copies are deterministic: no generator needed

    def draft(self, req: DraftRequest) -> Draft:
        self._sync(req.context)
        tokens, length = lookup_draft(self.toks, self.n, self.min_match, self.max_match, req.max_tokens)
        if tokens and req.min_accept_p > 0.0:
            rate = self.rate(length)
            # the longest prefix whose chance of being accepted whole still pays
            keep = 0
            chance = 1.0
            while keep < len(tokens):
                chance *= rate
                if chance < req.min_accept_p:
                    break
                keep += 1
            tokens = tokens[:keep]
        self._last = (length, len(tokens))
        return Draft(tokens)

    def accept(self, n_accepted: int) -> None:
        """Score the match length of the last copy: tokens up to the first rejection were judged."""
        length, drafted = self._last
        if drafted:
            self.attempts[length] += min(drafted, n_accepted + 1)
            self.hits[length] += n_accepted
        self._last = (0, 0)

    def reset(self) -> None:
        self.__init__(self.min_match, self.max_match)  # type: ignore[misc]

    def close(self) -> None:
        pass

    def rate(self, length: int) -> float:
        """Optimistic per-token hit rate of copies from ``length``-token matches."""
        a = max(self.attempts[length], 1.0)
        return min(1.0, float(self.hits[length] / a + EXPLORE / np.sqrt(a)))

    # -- internals
    def _sync(self, context: Sequence[int]) -> None:
        """Append what the array has not seen; rebuild when the conversation was edited
        (O(1) check, as in the N-gram drafter: a deeper edit only makes copies worse)."""
        n = len(context)
        if n < self.n or (self.n and context[self.n - 1] != self.toks[self.n - 1]):
            self.n = 0
        if n > self.toks.shape[0]:
            bigger = np.zeros(max(n, 2 * self.toks.shape[0]), dtype=np.int32)
            bigger[: self.n] = self.toks[: self.n]
            self.toks = bigger
        if n > self.n:
            self.toks[self.n : n] = np.asarray(context[self.n :], dtype=np.int32)
            self.n = n
