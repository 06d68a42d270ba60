"""The numba N-gram kernels agree with the plain-Python reference on random token streams."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from potluck.engine.speculation.kernels.ngram import NgramReference, NgramTables, warm_up

warm_up()

streams = st.lists(st.integers(0, 5), min_size=0, max_size=120)


@settings(max_examples=150, deadline=None)
@given(
    tokens=streams,
    n_max=st.integers(2, 6),
    k=st.integers(1, 9),
    cuts=st.lists(st.integers(0, 120), max_size=4),
    rate=st.lists(st.floats(0.0, 1.0), min_size=7, max_size=7),
    threshold=st.floats(0.0, 1.0),
)
def test_kernel_matches_reference(
    tokens: list[int], n_max: int, k: int, cuts: list[int], rate: list[float], threshold: float
) -> None:
    """Extended in several pieces (as accepted tokens arrive), drafts equal the reference's."""
    fast = NgramTables(n_max, capacity=4)  # tiny: exercises growth and rehashing
    ref = NgramReference(n_max)
    rates = np.array(rate[: n_max + 1], dtype=np.float64)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c < len(tokens))})
    for lo, hi in zip(bounds, bounds[1:]):
        fast.extend(tokens[lo:hi])
        ref.extend(tokens[lo:hi])
        assert fast.draft(k) == ref.draft(k)
        assert fast.draft(k, rates, threshold) == ref.draft(k, rates.tolist(), threshold)


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 200_000), min_size=1, max_size=60))
def test_large_vocabulary_ids(tokens: list[int]) -> None:
    fast, ref = NgramTables(4), NgramReference(4)
    fast.extend(tokens)
    ref.extend(tokens)
    assert fast.draft(7) == ref.draft(7)


def test_multilevel_prefers_longest_context() -> None:
    # after "... 7 1 2" the contexts "1 2" and "2" say 9 (seen twice) but "7 1 2" says 3
    t = NgramTables(4)
    t.extend([1, 2, 9, 1, 2, 9, 7, 1, 2, 3, 5, 7, 1, 2])
    assert t.draft(1) == ([3], [4])
    t2 = NgramTables(3)
    t2.extend([1, 2, 9, 1, 2, 9, 7, 1, 2, 3, 5, 7, 1, 2])
    assert t2.draft(1) == ([9], [3])


def test_draft_stops_when_nothing_matches() -> None:
    t = NgramTables(5)
    t.extend([1, 2, 3, 4])
    assert t.draft(7) == ([], [])  # 4 was never followed by anything
