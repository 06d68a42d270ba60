"""The candidate set a sampled token is drawn from, as one numba kernel over the logits.

llama.cpp's default chain (``common_sampler``: penalties, top-k, top-p, min-p, temperature,
dist), with the same meaning for each number, so a client's ``top_p: 0.95`` here is
llama-server's:

- **top-k** keeps the ``k`` largest logits (ties: the lower token id);
- **top-p** keeps the smallest prefix of those, by falling logit, whose softmax mass at
  temperature 1 reaches ``top_p``;
- **min-p** keeps the tokens whose logit is at least ``max + log(min_p)``, i.e. whose
  probability at temperature 1 is at least ``min_p`` times the top one's;
- **temperature** then divides the survivors' logits, and the softmax over them is the
  distribution.

Example (logits of a 6-token vocabulary, top_k 4, top_p 0.9, min_p 0.1, temperature 0.5)::

    logits       [2.0, 0.0, 3.0, -1.0, 2.5, 1.0]
    top-k 4      tokens 2, 4, 0, 5          (by falling logit)
    top-p 0.9    softmax over them at T=1: 0.48, 0.29, 0.18, 0.06 -> 0.48+0.29+0.18 >= 0.9
                 keeps 2, 4, 0
    min-p 0.1    3.0 + log(0.1) = 0.70: all three stay
    T = 0.5      softmax of [2.0, 3.0, 2.5] / 0.5 over tokens [0, 2, 4]

The kernel never sorts the vocabulary: top-k is one pass with a heap of ``k`` entries, min-p
one pass with a threshold, and only the survivors (tens of tokens with llama.cpp's defaults)
are sorted for top-p. A 49,152-token vocabulary costs one or two passes over the logits.
:func:`candidates_reference` is the plain-numpy definition the tests hold the kernel to.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# Below this many tokens the survivors of top-k/min-p are sorted at once for top-p; above it
# (no top-k, no min-p) the prefix is found by widening a logit window first.
_SORT_AT_ONCE = 2048


@njit(cache=True, nogil=True, inline="always")
def _worse(vals: np.ndarray, ids: np.ndarray, a: int, b: int) -> bool:
    """Heap order: entry ``a`` ranks below ``b`` (smaller logit; on a tie, the higher id)."""
    return vals[a] < vals[b] or (vals[a] == vals[b] and ids[a] > ids[b])


@njit(cache=True, nogil=True)
def _sift_down(vals: np.ndarray, ids: np.ndarray, i: int, n: int) -> None:
    while True:
        child = 2 * i + 1
        if child >= n:
            return
        if child + 1 < n and _worse(vals, ids, child + 1, child):
            child += 1
        if not _worse(vals, ids, child, i):
            return
        vals[i], vals[child] = vals[child], vals[i]
        ids[i], ids[child] = ids[child], ids[i]
        i = child


@njit(cache=True, nogil=True)
def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest logits (ties: lower ids first), ascending. One pass over
    ``logits`` with a min-heap of ``k`` entries: most tokens cost one comparison."""
    vals = logits[:k].copy()
    ids = np.arange(k)
    for i in range(k // 2 - 1, -1, -1):
        _sift_down(vals, ids, i, k)
    weakest = vals[0]  # the entry a new token must beat
    for i in range(k, logits.shape[0]):
        v = logits[i]
        if v > weakest:  # a tie with the weakest kept entry keeps the lower id (already in)
            vals[0] = v
            ids[0] = i
            _sift_down(vals, ids, 0, k)
            weakest = vals[0]
    return np.sort(ids)


@njit(cache=True, nogil=True)
def _at_least(logits: np.ndarray, pool: np.ndarray, floor: float) -> np.ndarray:
    """The ids of ``pool`` (ascending) whose logit is at least ``floor``, in pool order."""
    n = 0
    for i in pool:
        if logits[i] >= floor:
            n += 1
    out = np.empty(n, dtype=np.int64)
    n = 0
    for i in pool:
        if logits[i] >= floor:
            out[n] = i
            n += 1
    return out


@njit(cache=True, nogil=True)
def _mass(logits: np.ndarray, ids: np.ndarray, top: float) -> float:
    total = 0.0
    for i in ids:
        total += math.exp(float(logits[i]) - top)
    return total


# The entry points keep the GIL (no nogil): they run between a step's logits and the next
# step's send, where giving the GIL up for 60 us meant waiting to get it back from serve's
# other threads (0.19 against 0.10 ms a call in serve, docs/facts.md §34).
@njit(cache=True)
def candidates(
    logits: np.ndarray, top_k: int, top_p: float, min_p: float, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64 [n] ascending, probabilities float64 [n] summing to 1) after top-k,
    top-p, min-p and temperature, in llama.cpp's order (module docstring). ``logits`` is
    float32 [vocab]; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 turn a filter off;
    ``temperature`` > 0."""
    n_vocab = logits.shape[0]
    if 0 < top_k < n_vocab:
        pool = top_k_ids(logits, top_k)
    else:
        pool = np.arange(n_vocab)
    top = -np.inf
    for i in pool:
        top = max(top, float(logits[i]))
    # survivors: a prefix of the pool by falling logit that holds the answer
    if min_p > 0.0:
        keep = _at_least(logits, pool, top + math.log(min_p))
    else:
        keep = pool
    if top_p < 1.0:
        goal = top_p * _mass(logits, pool, top)
        if min_p <= 0.0 and keep.shape[0] > _SORT_AT_ONCE:
            width = 8.0  # widen a window under the top logit until it holds the goal's mass
            while True:
                keep = _at_least(logits, pool, top - width)
                if keep.shape[0] == pool.shape[0] or _mass(logits, keep, top) >= goal:
                    break
                width *= 2.0
        order = np.argsort(-logits[keep], kind="mergesort")  # ties: lower id first
        cum = 0.0
        cut = keep.shape[0]
        for j in range(keep.shape[0]):
            cum += math.exp(float(logits[keep[order[j]]]) - top)
            if cum >= goal:
                cut = j + 1
                break
        keep = np.sort(keep[order[:cut]])
    probs = np.empty(keep.shape[0], dtype=np.float64)
    total = 0.0
    for j in range(keep.shape[0]):
        probs[j] = math.exp((float(logits[keep[j]]) - top) / temperature)
        total += probs[j]
    probs /= total
    return keep, probs


@njit(cache=True)
def token_index(probs: np.ndarray, u: float) -> int:
    """Where the running sum of ``probs`` first passes ``u`` times their total: np.cumsum's
    sequential sums and searchsorted(side="right"), without two numpy calls' overhead on a
    list of tens of candidates."""
    n = probs.shape[0]
    total = 0.0
    for j in range(n):
        total += probs[j]
    goal = u * total
    running = 0.0  # the same sums in the same order: the same floats as the first pass
    for j in range(n):
        running += probs[j]
        if running > goal:
            return j
    return n - 1


def candidates_reference(
    logits: np.ndarray, top_k: int, top_p: float, min_p: float, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """The specification :func:`candidates` must match: sort everything, cut, softmax."""
    lg = np.asarray(logits, dtype=np.float64)
    order = np.argsort(-lg, kind="stable")  # falling logit, ties by lower id
    if 0 < top_k < lg.shape[0]:
        order = order[:top_k]
    top = lg[order[0]]
    if top_p < 1.0:
        cum = np.cumsum(np.exp(lg[order] - top))
        order = order[: int(np.searchsorted(cum, top_p * cum[-1])) + 1]  # first prefix reaching it
    if min_p > 0.0:
        order = order[lg[order] >= top + math.log(min_p)]
    ids = np.sort(order)
    e = np.exp((lg[ids] - top) / temperature)
    return ids.astype(np.int64), e / e.sum()


def warm_up() -> None:
    """Compile (or load from numba's cache) every specialization the sampler uses."""
    logits = np.linspace(-4.0, 4.0, 4096).astype(np.float32)
    candidates(logits, 40, 0.95, 0.05, 0.8)
    candidates(logits, 0, 0.9, 0.0, 1.0)
    token_index(np.full(4, 0.25), 0.5)
