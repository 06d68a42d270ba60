"""TriForce's retrieval-cache scoring: which chunks of the context the current query needs.

TriForce (Sun et al. 2024, section 4.2) splits the KV cache into chunks of consecutive
tokens and scores each chunk by the dot product of the current query with the chunk's mean
key; the top chunks within a budget, plus the first tokens (attention sinks) and the recent
window, form the retrieval cache that the target drafts with.

Example: keys of 5 positions with one KV head of width 2, chunks of 2, one query head::

    keys  = [[1, 0], [3, 0], [0, 2], [0, 4], [1, 1]]     (positions 0..4)
    query = [1, 1]
    chunk means: [2, 0], [0, 3], [1, 1]  ->  scores 2, 3, 2

Grouped-query attention: query head ``h`` reads KV head ``h // (n_head / n_head_kv)``; the
score of a chunk sums the per-head dot products over every query head.

:func:`chunk_scores` is the numba kernel; :func:`chunk_scores_reference` is the plain numpy
definition the tests hold it to. :func:`retrieval_ranges` turns scores into the position
ranges to drop from the retrieval sequence (plain numpy: it runs once per rebuild).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def chunk_scores(keys: np.ndarray, query: np.ndarray, n_tokens: int, chunk: int) -> np.ndarray:
    """Score each chunk of positions ``[0, n_tokens)``.

    keys: [n_pos >= n_tokens, n_head_kv, head_dim] float32 (RoPE'd keys by position);
    query: [n_head, head_dim] float32, ``n_head`` a multiple of ``n_head_kv``;
    returns [ceil(n_tokens / chunk)] float32: query · mean key of the chunk (a last, shorter
    chunk averages the keys it has).
    """
    n_kv = keys.shape[1]
    dim = keys.shape[2]
    n_head = query.shape[0]
    group = n_head // n_kv
    n_chunks = (n_tokens + chunk - 1) // chunk
    # fold the query heads onto their KV head: sum_h q_h · k_{h // group}
    q_kv = np.zeros((n_kv, dim), dtype=np.float32)
    for h in range(n_head):
        for d in range(dim):
            q_kv[h // group, d] += query[h, d]
    scores = np.empty(n_chunks, dtype=np.float32)
    for c in range(n_chunks):
        t0 = c * chunk
        t1 = min(t0 + chunk, n_tokens)
        acc = 0.0
        for t in range(t0, t1):
            for j in range(n_kv):
                for d in range(dim):
                    acc += keys[t, j, d] * q_kv[j, d]
        scores[c] = acc / (t1 - t0)
    return scores


def chunk_scores_reference(keys: np.ndarray, query: np.ndarray, n_tokens: int, chunk: int) -> np.ndarray:
    """The definition :func:`chunk_scores` implements, in float64 numpy."""
    n_kv = keys.shape[1]
    group = query.shape[0] // n_kv
    k = keys[:n_tokens].astype(np.float64)
    q = query.astype(np.float64)
    out = []
    for t0 in range(0, n_tokens, chunk):
        mean_key = k[t0 : t0 + chunk].mean(axis=0)  # [n_kv, dim]
        out.append(sum(float(q[h] @ mean_key[h // group]) for h in range(q.shape[0])))
    return np.asarray(out, dtype=np.float64)


def retrieval_ranges(
    scores: np.ndarray, n_tokens: int, chunk: int, budget: int, sinks: int, recent: int
) -> list[tuple[int, int]]:
    """Position ranges ``[p0, p1)`` to remove so that the sequence keeps the ``sinks`` first
    positions, the ``recent`` last ones and the best chunks of the middle (at most ``budget``
    positions of them). ``scores``: one per chunk of positions ``[sinks, n_tokens - recent)``
    (chunks counted from ``sinks``). Adjacent removed chunks merge into one range.
    """
    lo, hi = sinks, max(sinks, n_tokens - recent)
    n_chunks = (hi - lo + chunk - 1) // chunk
    if n_chunks == 0:
        return []
    keep_n = max(0, min(n_chunks, budget // chunk))
    keep = np.zeros(n_chunks, dtype=bool)
    if keep_n:
        keep[np.argsort(-np.asarray(scores[:n_chunks], dtype=np.float64), kind="stable")[:keep_n]] = True
    ranges: list[tuple[int, int]] = []
    for c in np.flatnonzero(~keep):
        p0, p1 = lo + int(c) * chunk, min(hi, lo + (int(c) + 1) * chunk)
        if ranges and ranges[-1][1] == p0:
            ranges[-1] = (ranges[-1][0], p1)
        else:
            ranges.append((p0, p1))
    return ranges


def warm_up() -> None:
    """Compile (or load from cache) the kernel before the first rebuild needs it."""
    chunk_scores(np.zeros((2, 1, 2), np.float32), np.zeros((1, 2), np.float32), 2, 1)
