"""Token-tree verification (SpecInfer's multi-step speculative sampling) and the exact
first-token distributions of the chain and tree verifiers: test oracles only.

No strategy verifies a whole tree (Minions votes a tree down to one chain), so the tree
verifier lives here, built from the product's own rules (:func:`accept_prob`,
:func:`residual`, :meth:`Candidates.token_at`): the tests show those rules keep the target's
distribution for trees too, and that a broken residual step is caught. The oracles reason over
dense rows of a small vocabulary and hand the product's rules :class:`Candidates`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from potluck.engine.core.sampling import Candidates
from potluck.engine.speculation.verify import TokenTree, accept_prob, residual

from .distributions import candidates, dense


@dataclass(frozen=True)
class TreeVerdict:
    path: tuple[int, ...]  # accepted nodes, root excluded, in order
    token: int  # recovered or bonus token after the last accepted node


def verify_tree(
    tree: TokenTree,
    p_at: Callable[[int], Candidates],
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
            return TreeVerdict(tuple(path), p.token_at(uniform()))


def tree_first_token_dist(tree: TokenTree, p: np.ndarray) -> np.ndarray:
    """Exact distribution of the first emitted token of :func:`verify_tree`.

    Walks the children of the root with the same :func:`accept_prob` and :func:`residual`
    the verifier uses; for any tree it must equal ``p`` (the target's distribution).
    """
    out = np.zeros_like(p, dtype=np.float64)
    reach = 1.0  # probability that every earlier child was rejected
    cur = np.asarray(p, dtype=np.float64)
    for child in tree.children(0):
        x, qc = tree.tokens[child], tree.q[child]
        if qc is None:
            a = accept_prob(candidates(cur), None, x)
            out[x] += reach * a
        else:  # x ~ q: expectation over the drafted token
            q = dense(qc, cur.shape[0])
            a_vec = np.minimum(1.0, np.divide(cur, q, out=np.zeros_like(cur), where=q > 0))
            out += reach * q * a_vec
            a = float((q * a_vec).sum())
        if a >= 1.0:
            return out
        cur = dense(residual(candidates(cur), None, x), cur.shape[0]) if qc is None else expected_residual(cur, q)
        reach *= 1.0 - a
    return out + reach * cur


def expected_residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``norm(max(0, p - q))``, or ``p`` when nothing is left (the verifier's rule)."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else p


def chain_first_token_dist(
    p: np.ndarray,
    q: np.ndarray | None,
    draft: int | None = None,
    residual_fn: Callable[[Candidates, Candidates | None, int], Candidates] = residual,
) -> np.ndarray:
    """Exact distribution of the first emitted token of :func:`~potluck.engine.speculation.verify.verify_chain`.

    ``q`` given: the draft is ``x ~ q`` and we take the expectation over ``x``;
    ``q = None``: the deterministic draft ``draft``.
    """
    p = np.asarray(p, dtype=np.float64)
    n, pc = p.shape[0], candidates(p)
    if q is None:
        assert draft is not None
        a = accept_prob(pc, None, draft)
        out = (1.0 - a) * dense(residual_fn(pc, None, draft), n)
        out[draft] += a
        return out
    out = np.zeros_like(p)
    qc = candidates(q)
    for x in np.flatnonzero(q > 0):
        a = accept_prob(pc, qc, int(x))
        out[x] += q[x] * a
        out += q[x] * (1.0 - a) * dense(residual_fn(pc, qc, int(x)), n)
    return out
