"""ANPD's drafter (Ou et al. 2024): multi-level N-gram tables over the conversation itself.

Tables are initialised from the prompt and updated with every accepted token; drafting
asks the longest context first and stops as soon as no level matches, so a round with no
evidence costs nothing but a plain decode. All per-token work runs in
:mod:`potluck.engine.speculation.kernels.ngram` over numpy token arrays.

One addition to the paper: each level's hit rate is learned from what the target accepted
(``accept``), and drafting stops once the chance that the whole draft so far is accepted
(the product of the hit rates of the levels that produced it, plus an exploration bonus)
falls below the request's ``min_accept_p``, the acceptance probability a draft token needs
to pay for its share of the verify batch (:class:`potluck.engine.speculation.adaptive.DraftBreakEven`).
With ``min_accept_p = 0`` this is exactly ANPD's K-step multi-level drafting.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..kernels.ngram import NgramTables, warm_up
from . import Draft, DraftRequest

# Hit rates by level measured on SmolLM2 replies (code editing, summaries, chat), used
# as a weak prior (PRIOR_WEIGHT pseudo-drafts) until this conversation's own rates arrive.
PRIOR_HIT_RATE = {2: 0.2, 3: 0.45, 4: 0.65}
PRIOR_HIT_RATE_LONG = 0.85
PRIOR_WEIGHT = 4.0
EXPLORE = 0.2  # bonus / sqrt(attempts): levels with little evidence still get tried


class NgramDrafter:
    name = "ngram"
    step_ms = 0.0  # a table lookup: microseconds, not a model step

    def __init__(self, n_max: int = 5) -> None:
        self.n_max = n_max
        warm_up()  # compile or load the kernels now, not in the first round
        self.tables = NgramTables(n_max)
        self.attempts = np.zeros(n_max + 1)
        self.hits = np.zeros(n_max + 1)
        for n in range(2, n_max + 1):
            self.attempts[n] = PRIOR_WEIGHT
            self.hits[n] = PRIOR_WEIGHT * PRIOR_HIT_RATE.get(n, PRIOR_HIT_RATE_LONG)
        self._last_levels: list[int] = []  # level that produced each token of the last draft

    # -- the drafter contract
    def begin(self, context: Sequence[int], rng: np.random.Generator) -> None:
        self._sync(context)  # drafts are deterministic: the generator is not needed

    def draft(self, req: DraftRequest) -> Draft:
        self._sync(req.context)
        tokens, levels = self.tables.draft(req.max_tokens, self.level_rates(), req.min_accept_p)
        self._last_levels = levels
        return Draft(tokens)

    def accept(self, n_accepted: int) -> None:
        """Score the levels of the last draft: each token up to the first rejection was judged."""
        for j, lvl in enumerate(self._last_levels):
            self.attempts[lvl] += 1
            if j >= n_accepted:
                break  # later drafts were never judged on their own
            self.hits[lvl] += 1
        self._last_levels = []

    def reset(self) -> None:
        self.__init__(self.n_max)  # type: ignore[misc]

    def close(self) -> None:
        pass

    # -- internals
    def _sync(self, context: Sequence[int]) -> None:
        """Append the tokens of ``context`` the tables have not seen.

        The conversation normally only grows; if it was edited (its length shrank or the
        last token we saw changed) the tables are rebuilt. The check is O(1): a change
        deeper in the history only makes drafts worse, never the output wrong.
        """
        t = self.tables
        if len(context) < t.n or (t.n and context[t.n - 1] != t.last_token()):
            self.tables = t = NgramTables(self.n_max)
        if len(context) > t.n:
            t.extend(context[t.n :])

    def level_rates(self) -> np.ndarray:
        """Optimistic hit rate per level: measured rate plus a bonus that fades with evidence."""
        rate = self.hits / np.maximum(self.attempts, 1e-9)
        bonus = EXPLORE / np.sqrt(np.maximum(self.attempts, 1.0))
        return np.minimum(1.0, rate + bonus)
