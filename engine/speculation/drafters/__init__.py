"""Draft sources behind one contract: ``begin`` -> ``draft`` -> ``accept``.

Drafters never verify: they guess, and :mod:`potluck.engine.speculation.verify` decides. A guess only
costs speed when wrong, never correctness, so a drafter may use cheap heuristics freely.
The lifecycle follows llama.cpp's common_speculative (begin, draft, accept): a strategy only
calls these methods and reads ``step_ms``; it never sets a drafter's attributes.

Each drafter owns the random generator ``begin`` hands it (spawned from the session's seed),
so seeded runs repeat exactly even when drafting runs on another thread than verification.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ...core.sampling import Candidates, SamplingParams, TokenFilter


class TokenGrammar(TokenFilter, Protocol):
    """A grammar's state a drafter may advance (:class:`~potluck.engine.core.runtime.Grammar`)."""

    def accept(self, token: int) -> None: ...


@dataclass(frozen=True)
class Draft:
    """Proposed continuation tokens and the distributions they were drawn from.

    ``q`` is ``None`` for deterministic drafts (N-gram lookup, draft-model argmax): the
    verifier then treats each as ``q = delta(token)``. Otherwise ``q[i]`` is the distribution
    ``tokens[i]`` was drawn from.
    """

    tokens: list[int]
    q: list[Candidates] | None = None


@dataclass(frozen=True)
class DraftRequest:
    """What one round asks of a drafter.

    ``min_accept_p``: the probability that the whole draft so far is accepted must stay at or
    above this for one more token to pay for its share of the verify batch (measured at run
    time, :class:`potluck.engine.speculation.adaptive.DraftBreakEven`); 0 drafts ``max_tokens`` whenever
    the drafter has a guess.
    """

    context: Sequence[int]  # the whole conversation so far; drafts continue it
    max_tokens: int
    min_accept_p: float
    sampling: SamplingParams
    # the reply's grammar after ``context`` (None: none), the drafter's own copy to advance;
    # drafting within it is optional (a drafter that ignores it only drafts worse)
    grammar: TokenGrammar | None = None


class ContextView(Sequence[int]):
    """The first ``n`` tokens of a conversation (a list that only grows) plus guessed tokens.

    Handing a drafter a view instead of a copy keeps each draft step O(1) in the context
    length; the prefix never changes while the view is in use (the session only appends).
    """

    def __init__(self, history: list[int], n: int, tail: tuple[int, ...] = ()) -> None:
        self._history, self._n, self._tail = history, n, tail

    def __len__(self) -> int:
        return self._n + len(self._tail)

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            head = self._history[start : min(stop, self._n)] if start < self._n else []
            tail = self._tail[max(0, start - self._n) : max(0, stop - self._n)]
            return [*head, *tail]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._history[i] if i < self._n else self._tail[i - self._n]


class Drafter(Protocol):
    name: str
    step_ms: float  # measured cost of drafting one more token (0 for free sources)

    def begin(self, context: Sequence[int], rng: np.random.Generator) -> None:
        """A reply starts after ``context`` (prompt processing happens here); ``rng`` is the
        drafter's own for the whole reply."""
        ...

    def draft(self, req: DraftRequest) -> Draft:
        """Up to ``req.max_tokens`` tokens that may follow ``req.context``."""
        ...

    def accept(self, n_accepted: int) -> None:
        """The target kept the first ``n_accepted`` tokens of the last draft."""
        ...

    def reset(self) -> None:
        """Forget the conversation (a new one starts)."""
        ...

    def close(self) -> None: ...
