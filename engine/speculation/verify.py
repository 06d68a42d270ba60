"""Lossless acceptance of drafted tokens, as pure array functions (this module never decodes).

Terms (as in vLLM's rejection sampler):
- *accepted* tokens: drafts the target keeps;
- *recovered* token: drawn from the residual distribution where a draft is rejected;
- *bonus* token: drawn from the target's next distribution when every draft was accepted.
Every round therefore yields ``n_accepted + 1`` tokens.

Rules (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023; SpecInfer, Miao et al. 2024, for token trees):
- draft ``x ~ q`` is accepted with probability ``min(1, p(x) / q(x))``; on rejection the
  recovered token is drawn from ``norm(max(0, p - q))`` and the round stops;
- a deterministic draft (N-gram lookup, draft argmax) is ``q = delta(x)``: accept with
  probability ``p(x)``, otherwise draw from ``p`` with ``x`` zeroed and renormalized;
- greedy decoding is the special case where ``p`` is one-hot: accept while the draft equals
  the target's argmax (no randomness, so it needs no distributions at all);
- every verifier walks the chain with one loop, :func:`verify_lazily`, which fetches each
  row and guess only when it reaches it (rows that arrive batch by batch stop it undecided).

:class:`TokenTree` merges several drafters' chains for Minions' vote (:mod:`.voting`), which
picks one chain to verify; SpecInfer's multi-step sampling down a whole tree is not used by
any strategy (the tests check it with these rules: tests/support/trees.py).

``p`` and ``q`` must come from the same penalties and filters
(:func:`potluck.engine.core.sampling.distribution`), each a
:class:`~potluck.engine.core.sampling.Candidates`: the tokens the filters left and their
probabilities, so every rule here costs the size of that set, not of the vocabulary.
``p_rows(i)`` is the target's distribution after ``i`` drafts (rows 0..k), ``q_rows[i]`` the
one ``drafts[i]`` was drawn from, or ``q_rows`` is ``None`` for deterministic drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ..core.sampling import Candidates

# --------------------------------------------------------------------------- building blocks


def accept_prob(p: Candidates, q: Candidates | None, x: int) -> float:
    """Probability of keeping draft ``x``: ``min(1, p(x)/q(x))``; ``q = None`` means delta(x)."""
    if q is None:
        return p.prob(x)
    qx = q.prob(x)
    if qx <= 0.0:  # a draft the drafter could not have produced: never trust it
        return 0.0
    return min(1.0, p.prob(x) / qx)


def residual(p: Candidates, q: Candidates | None, x: int) -> Candidates:
    """Distribution to draw from after rejecting ``x``: ``norm(max(0, p - q))``, over p's
    candidates (``max(0, p - q)`` is 0 wherever p is).

    If ``p - q`` has no positive mass left (p == q up to rounding) ``p`` itself is returned:
    that case is reached with probability zero, and ``p`` is the only unbiased choice.
    """
    if q is None:
        r = np.where(p.tokens == x, 0.0, p.probs)
    else:
        r = np.maximum(p.probs - q.probs_at(p.tokens), 0.0)
    total = r.sum()
    if total <= 0.0:
        return p
    return Candidates(p.tokens, r / total)


# --------------------------------------------------------------------------- single chain


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one chain of drafts."""

    n_accepted: int  # drafts kept, a prefix of the chain
    token: int  # recovered token (a draft was rejected) or bonus token (all kept)

    def tokens(self, drafts: Sequence[int]) -> list[int]:
        """What the round emits: the kept drafts followed by the target's own token."""
        return [*drafts[: self.n_accepted], self.token]


Guess = tuple[int, Candidates | None]  # a drafted token and the q it was drawn from (None: q = delta)
Row = TypeVar("Row")


@dataclass(frozen=True)
class Decision:
    """What one pass of the accept loop decided, as far as the rows reached."""

    tokens: list[int]  # kept guesses, then the target's own token when one was decided
    n_accepted: int  # guesses kept: a prefix of ``tokens``
    judged: int  # guesses judged: the kept ones and the rejected one, if any
    rows: list = field(default_factory=list)  # the target's row each of ``tokens`` was decided at

    @property
    def own(self) -> bool:
        """The last token is the target's own (a guess was rejected, or none was left):
        guesses after it are void."""
        return len(self.tokens) > self.n_accepted


def verify_lazily(
    guess_at: Callable[[int], Guess | None],
    row_at: Callable[[int], Row | None],
    keep: Callable[[Row, int, Candidates | None, list[int]], int | None],
    own_token: Callable[[Row, list[int]], int],
) -> Decision:
    """The accept loop: position by position, each fetched only when reached.

    At position ``i`` (after ``i`` kept guesses): ``row_at(i)`` is the target's row there
    (None: not computed yet, so the pass stops undecided); ``guess_at(i)`` the guess for it
    (None: no guess, the target's own token ``own_token(row, kept)`` ends the pass);
    ``keep(row, x, q, kept)`` judges guess ``x``: None keeps it, else it returns the token
    the target emits instead, which ends the pass. Every verifier is this loop: whole chains
    (:func:`verify_greedy`, :func:`verify_chain`) and rows that arrive one batch at a time
    (pearl, pipeinfer: :class:`~.inflight.RowJudge`).
    """
    kept: list[int] = []
    rows: list[Row] = []
    judged = 0
    while True:
        row = row_at(len(kept))
        if row is None:
            return Decision(kept, len(kept), judged, rows)
        rows.append(row)
        guess = guess_at(len(kept))
        if guess is None:
            return Decision([*kept, own_token(row, kept)], len(kept), judged, rows)
        x, q = guess
        judged += 1
        fix = keep(row, x, q, kept)
        if fix is not None:
            return Decision([*kept, fix], len(kept), judged, rows)
        kept.append(x)


def verify_greedy(drafts: Sequence[int], target_tokens: Callable[[int], int]) -> Verdict:
    """Greedy acceptance: keep drafts while each equals the target's choice at its position.

    ``target_tokens(i)`` returns the target's greedy token after ``i`` drafts; it is called
    lazily so that the caller only computes the rows it needs.
    """

    def keep(i: int, x: int, q: Candidates | None, kept: list[int]) -> int | None:
        t = target_tokens(i)
        return None if t == x else t

    d = verify_lazily(
        lambda i: (drafts[i], None) if i < len(drafts) else None,
        lambda i: i,
        keep,
        lambda i, kept: target_tokens(i),
    )
    return Verdict(d.n_accepted, d.tokens[-1])


def verify_chain(
    drafts: Sequence[int],
    p_rows: Callable[[int], Candidates],
    q_rows: Sequence[Candidates] | None,
    uniform: Callable[[], float],
    residual_fn: Callable[[Candidates, Candidates | None, int], Candidates] = residual,
) -> Verdict:
    """Speculative sampling over one chain; the emitted tokens follow the target's distribution.

    ``p_rows(i)``: target distribution after ``i`` drafts (called lazily, rows 0..k).
    ``q_rows[i]``: the draft distribution ``drafts[i]`` was sampled from, or ``None`` for
    deterministic drafts. ``uniform()`` draws from the sampler's seeded RNG.
    ``residual_fn`` exists so tests can show that a wrong residual is detected.
    """
    d = verify_lazily(
        lambda i: (drafts[i], None if q_rows is None else q_rows[i]) if i < len(drafts) else None,
        p_rows,
        lambda p, x, q, kept: judge(p, q, x, uniform, residual_fn),
        lambda p, kept: p.token_at(uniform()),
    )
    return Verdict(d.n_accepted, d.tokens[-1])


def judge(
    p: Candidates,
    q: Candidates | None,
    x: int,
    uniform: Callable[[], float],
    residual_fn: Callable[[Candidates, Candidates | None, int], Candidates] = residual,
) -> int | None:
    """One draft position of a chain: None if ``x`` is kept, else the recovered token.

    :func:`verify_chain` applies it position by position; so do the strategies that verify
    as rows arrive (pearl, pipeinfer), through :func:`verify_lazily`.
    """
    if uniform() < accept_prob(p, q, x):
        return None
    return residual_fn(p, q, x).token_at(uniform())


# --------------------------------------------------------------------------- token trees


@dataclass(frozen=True)
class TokenTree:
    """Candidate continuations merged into a tree (node 0 is the root, the last known token).

    ``parent[i]`` precedes ``i`` (``parent[0] == -1``); children of a node are tried in the
    order they appear. ``q[i]`` is the draft distribution node ``i``'s token was drawn from,
    or ``None`` when that branch is deterministic.
    """

    tokens: tuple[int, ...]
    parent: tuple[int, ...]
    q: tuple[Candidates | None, ...]

    def children(self, node: int) -> list[int]:
        return [i for i, par in enumerate(self.parent) if par == node]

    @classmethod
    def from_chains(cls, root: int, chains: Sequence[Sequence[int]]) -> TokenTree:
        """Deterministic tree from several drafted chains; shared prefixes become one path."""
        tokens, parent = [root], [-1]
        index: dict[tuple[int, int], int] = {}
        for chain in chains:
            node = 0
            for tok in chain:
                key = (node, tok)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(tok)
                    parent.append(node)
                node = index[key]
        return cls(tuple(tokens), tuple(parent), (None,) * len(tokens))
