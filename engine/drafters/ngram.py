"""ANPD's drafter (Ou et al. 2024): multi-level N-gram tables over the conversation itself.

Tables are initialised from the prompt and updated with every accepted token; drafting
asks the longest context first and stops as soon as no level matches, so a round with no
evidence costs nothing but a plain decode. All per-token work runs in
:mod:`potluck.engine.kernels.ngram` over numpy token arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..kernels.ngram import NgramTables, warm_up
from ..sampling import Sampler
from . import Draft


class NgramDrafter:
    name = "ngram"

    def __init__(self, n_max: int = 5) -> None:
        self.n_max = n_max
        warm_up()  # compile or load the kernels now, not in the first round
        self.tables = NgramTables(n_max)

    def observe(self, context: Sequence[int]) -> None:
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

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        self.observe(context)
        return Draft(self.tables.draft(k))

    def reset(self) -> None:
        self.tables = NgramTables(self.n_max)

    def close(self) -> None:
        pass
