"""TriForce's chunk scoring: the numba kernel equals the numpy definition; chunk selection."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from potluck.engine.speculation.kernels.retrieval import chunk_scores, chunk_scores_reference, retrieval_ranges


@settings(max_examples=150, deadline=None)
@given(
    n_tokens=st.integers(1, 70),
    extra=st.integers(0, 5),
    n_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    dim=st.integers(1, 8),
    chunk=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_kernel_matches_reference(
    n_tokens: int, extra: int, n_kv: int, group: int, dim: int, chunk: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(n_tokens + extra, n_kv, dim)).astype(np.float32)
    query = rng.normal(size=(n_kv * group, dim)).astype(np.float32)
    got = chunk_scores(keys, query, n_tokens, chunk)
    want = chunk_scores_reference(keys, query, n_tokens, chunk)
    assert got.shape == want.shape == (-(-n_tokens // chunk),)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * (1 + np.abs(want).max()))


def test_docstring_example() -> None:
    keys = np.array([[1, 0], [3, 0], [0, 2], [0, 4], [1, 1]], np.float32).reshape(5, 1, 2)
    query = np.array([[1, 1]], np.float32)
    assert chunk_scores(keys, query, 5, 2).tolist() == [2.0, 3.0, 2.0]


def test_grouped_query_heads_read_their_kv_head() -> None:
    """Query heads 0-1 read KV head 0, heads 2-3 KV head 1: a chunk whose keys only match
    the second KV head scores by the second pair of query heads alone."""
    keys = np.zeros((2, 2, 1), np.float32)
    keys[1, 1, 0] = 1.0  # position 1, KV head 1
    query = np.array([[5.0], [5.0], [1.0], [2.0]], np.float32)
    assert chunk_scores(keys, query, 2, 1).tolist() == [0.0, 3.0]


@settings(max_examples=150, deadline=None)
@given(
    n_tokens=st.integers(0, 400),
    chunk=st.integers(1, 16),
    budget=st.integers(0, 200),
    sinks=st.integers(0, 40),
    recent=st.integers(0, 60),
    seed=st.integers(0, 2**32 - 1),
)
def test_ranges_keep_sinks_recent_and_the_best_chunks_within_budget(
    n_tokens: int, chunk: int, budget: int, sinks: int, recent: int, seed: int
) -> None:
    lo, hi = sinks, max(sinks, n_tokens - recent)
    n_chunks = -(-(hi - lo) // chunk)
    scores = np.random.default_rng(seed).permutation(n_chunks).astype(np.float64)  # distinct
    ranges = retrieval_ranges(scores, n_tokens, chunk, budget, sinks, recent)
    removed = np.zeros(max(n_tokens, hi), bool)
    for p0, p1 in ranges:
        assert lo <= p0 < p1 <= hi  # never a sink or a recent position
        assert not removed[p0:p1].any()
        removed[p0:p1] = True
    for a, b in zip(ranges, ranges[1:]):
        assert a[1] < b[0]  # merged: no two ranges touch
    kept_chunks = [c for c in range(n_chunks) if not removed[lo + c * chunk]]
    assert len(kept_chunks) == min(n_chunks, budget // chunk)
    if kept_chunks and len(kept_chunks) < n_chunks:
        dropped = [c for c in range(n_chunks) if c not in kept_chunks]
        assert min(scores[kept_chunks]) > max(scores[dropped])
