"""Scripted voters for Minions' vote (tests/test_minions.py): drafters whose chains and
q rows the tests choose."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from potluck.engine.speculation.drafters import Draft, DraftRequest

from .distributions import candidates


class Fixed:
    """A voter that always proposes ``chain`` (deterministic) after any context."""

    step_ms = 0.0

    def __init__(self, name: str, chain: list[int]) -> None:
        self.name, self.chain = name, chain
        self.accepted: list[int] = []

    def begin(self, context: Sequence[int], rng: np.random.Generator) -> None:
        pass

    def draft(self, req: DraftRequest) -> Draft:
        return Draft(self.chain[: req.max_tokens])

    def accept(self, n_accepted: int) -> None:
        self.accepted.append(n_accepted)

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class Sampled(Fixed):
    """A 'draft model': draws each token from ``q`` with its own generator; records threads."""

    def __init__(self, q: np.ndarray) -> None:
        super().__init__("sampled", [])
        self.q = q
        self.rng = np.random.default_rng()
        self.threads: set[int] = set()
        self.requests: list[tuple[int, int]] = []  # (context length, max tokens)

    def begin(self, context: Sequence[int], rng: np.random.Generator) -> None:
        self.rng = rng

    def draft(self, req: DraftRequest) -> Draft:
        self.threads.add(threading.get_ident())
        self.requests.append((len(req.context), req.max_tokens))
        toks = [int(self.rng.choice(self.q.shape[0], p=self.q)) for _ in range(req.max_tokens)]
        return Draft(toks, [candidates(self.q)] * len(toks))


class PerPosition(Sampled):
    """A sampled voter whose q differs at every position of the reply."""

    def __init__(self, qs: np.ndarray) -> None:
        super().__init__(qs[0])
        self.qs = qs

    def draft(self, req: DraftRequest) -> Draft:
        start = len(req.context) - 1  # position in the reply of the first drafted token
        rows = [self.qs[start + i] for i in range(req.max_tokens)]
        toks = [int(self.rng.choice(q.shape[0], p=q)) for q in rows]
        return Draft(toks, [candidates(q) for q in rows])
