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
- several candidate children of one tree node are tried in turn; each rejection replaces
  ``p`` by ``norm(max(0, p - q_child))`` (SpecInfer's multi-step speculative sampling).

``p`` and ``q`` must come from the same temperature / top-k / top-p filters
(:func:`potluck.engine.core.sampling.probs`). Shapes: ``p_rows`` is ``[k + 1, vocab]`` (row i is
the target's distribution after ``i`` drafts), ``q_rows`` is ``[k, vocab]`` or ``None`` for
deterministic drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# --------------------------------------------------------------------------- building blocks


def accept_prob(p: np.ndarray, q: np.ndarray | None, x: int) -> float:
    """Probability of keeping draft ``x``: ``min(1, p(x)/q(x))``; ``q = None`` means delta(x)."""
    if q is None:
        return float(p[x])
    qx = float(q[x])
    if qx <= 0.0:  # a draft the drafter could not have produced: never trust it
        return 0.0
    return min(1.0, float(p[x]) / qx)


def residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """Distribution to draw from after rejecting ``x``: ``norm(max(0, p - q))`` (float64 [vocab]).

    If ``p - q`` has no positive mass left (p == q up to rounding) ``p`` itself is returned:
    that case is reached with probability zero, and ``p`` is the only unbiased choice.
    """
    r = np.array(p, dtype=np.float64, copy=True)
    if q is None:
        r[x] = 0.0
    else:
        r -= q
        np.maximum(r, 0.0, out=r)
    total = r.sum()
    if total <= 0.0:
        return np.asarray(p, dtype=np.float64)
    return r / total


def draw(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw with one uniform ``u`` in [0, 1) (same rule as ``Sampler.draw``)."""
    idx = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
    return min(idx, p.shape[0] - 1)


# --------------------------------------------------------------------------- single chain


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one chain of drafts."""

    n_accepted: int  # drafts kept, a prefix of the chain
    token: int  # recovered token (a draft was rejected) or bonus token (all kept)

    def tokens(self, drafts: Sequence[int]) -> list[int]:
        """What the round emits: the kept drafts followed by the target's own token."""
        return [*drafts[: self.n_accepted], self.token]


def verify_greedy(drafts: Sequence[int], target_tokens: Callable[[int], int]) -> Verdict:
    """Greedy acceptance: keep drafts while each equals the target's choice at its position.

    ``target_tokens(i)`` returns the target's greedy token after ``i`` drafts; it is called
    lazily so that the caller only computes the rows it needs.
    """
    for i, x in enumerate(drafts):
        t = target_tokens(i)
        if t != x:
            return Verdict(i, t)
    return Verdict(len(drafts), target_tokens(len(drafts)))


def verify_chain(
    drafts: Sequence[int],
    p_rows: Callable[[int], np.ndarray],
    q_rows: Sequence[np.ndarray] | None,
    uniform: Callable[[], float],
    residual_fn: Callable[[np.ndarray, np.ndarray | None, int], np.ndarray] = residual,
) -> Verdict:
    """Speculative sampling over one chain; the emitted tokens follow the target's distribution.

    ``p_rows(i)``: target distribution after ``i`` drafts (called lazily, rows 0..k).
    ``q_rows[i]``: the draft distribution ``drafts[i]`` was sampled from, or ``None`` for
    deterministic drafts. ``uniform()`` draws from the sampler's seeded RNG.
    ``residual_fn`` exists so tests can show that a wrong residual is detected.
    """
    for i, x in enumerate(drafts):
        recovered = judge(p_rows(i), None if q_rows is None else q_rows[i], x, uniform, residual_fn)
        if recovered is not None:
            return Verdict(i, recovered)
    return Verdict(len(drafts), draw(p_rows(len(drafts)), uniform()))


def judge(
    p: np.ndarray,
    q: np.ndarray | None,
    x: int,
    uniform: Callable[[], float],
    residual_fn: Callable[[np.ndarray, np.ndarray | None, int], np.ndarray] = residual,
) -> int | None:
    """One draft position of a chain: None if ``x`` is kept, else the recovered token.

    Strategies that verify a chain position by position as rows arrive (pearl) call this;
    :func:`verify_chain` is the same rule over a whole chain.
    """
    if uniform() < accept_prob(p, q, x):
        return None
    return draw(residual_fn(p, q, x), uniform())


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
    q: tuple[np.ndarray | None, ...]

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


@dataclass(frozen=True)
class TreeVerdict:
    path: tuple[int, ...]  # accepted nodes, root excluded, in order
    token: int  # recovered or bonus token after the last accepted node


def verify_tree(
    tree: TokenTree,
    p_at: Callable[[int], np.ndarray],
    uniform: Callable[[], float],
) -> TreeVerdict:
    """SpecInfer's multi-step speculative sampling down a token tree.

    ``p_at(node)`` is the target's distribution after the path ending at ``node``. At each
    node the children are tried in turn: accept child ``c`` with ``min(1, p(c)/q_c(c))``;
    on rejection ``p <- norm(max(0, p - q_c))`` and the next child is tried. If no child is
    accepted the recovered token is drawn from the final ``p``; at a leaf it is the bonus.
    """
    node, path = 0, []
    while True:
        p = p_at(node)
        for child in tree.children(node):
            x, q = tree.tokens[child], tree.q[child]
            if uniform() < accept_prob(p, q, x):
                path.append(child)
                node = child
                break
            p = residual(p, q, x)
        else:
            return TreeVerdict(tuple(path), draw(p, uniform()))


def tree_first_token_dist(tree: TokenTree, p: np.ndarray) -> np.ndarray:
    """Exact distribution of the first emitted token of :func:`verify_tree` (test oracle).

    Walks the children of the root with the same :func:`accept_prob` and :func:`residual`
    the verifier uses; for any tree it must equal ``p`` (the target's distribution).
    """
    out = np.zeros_like(p, dtype=np.float64)
    reach = 1.0  # probability that every earlier child was rejected
    cur = np.asarray(p, dtype=np.float64)
    for child in tree.children(0):
        x, q = tree.tokens[child], tree.q[child]
        if q is None:
            a = accept_prob(cur, None, x)
            out[x] += reach * a
        else:  # x ~ q: expectation over the drafted token
            a_vec = np.minimum(1.0, np.divide(cur, q, out=np.zeros_like(cur), where=q > 0))
            out += reach * q * a_vec
            a = float((q * a_vec).sum())
        if a >= 1.0:
            return out
        cur = residual(cur, q, x) if q is None else _expected_residual(cur, q)
        reach *= 1.0 - a
    return out + reach * cur


def _expected_residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else p


def chain_first_token_dist(
    p: np.ndarray,
    q: np.ndarray | None,
    draft: int | None = None,
    residual_fn: Callable[[np.ndarray, np.ndarray | None, int], np.ndarray] = residual,
) -> np.ndarray:
    """Exact distribution of the first emitted token of :func:`verify_chain` (test oracle).

    ``q`` given: the draft is ``x ~ q`` and we take the expectation over ``x``;
    ``q = None``: the deterministic draft ``draft``.
    """
    p = np.asarray(p, dtype=np.float64)
    if q is None:
        assert draft is not None
        a = accept_prob(p, None, draft)
        out = (1.0 - a) * residual_fn(p, None, draft)
        out[draft] += a
        return out
    out = np.zeros_like(p)
    for x in np.flatnonzero(q > 0):
        a = accept_prob(p, q, int(x))
        out[x] += q[x] * a
        out += q[x] * (1.0 - a) * residual_fn(p, q, int(x))
    return out
