"""Draft sources behind one two-method interface (``propose`` / ``observe``).

Drafters never verify: they guess, and :mod:`potluck.engine.verify` decides. A guess only
costs speed when wrong, never correctness, so a drafter may use cheap heuristics freely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..sampling import Sampler


@dataclass(frozen=True)
class Draft:
    """Proposed continuation tokens and the distributions they were drawn from.

    ``q`` is ``None`` for deterministic drafts (N-gram lookup, draft-model argmax): the
    verifier then treats each as ``q = delta(token)``. Otherwise ``q[i]`` is float64 [vocab].
    """

    tokens: list[int]
    q: list[np.ndarray] | None = None


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """Up to ``k`` tokens that may follow ``context`` (the whole conversation so far)."""
        ...

    def observe(self, context: Sequence[int]) -> None:
        """Learn from the conversation after a round (accepted tokens are its new tail)."""
        ...

    def reset(self) -> None: ...

    def close(self) -> None: ...
