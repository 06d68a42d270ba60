"""The sampler's numba kernels: the candidates equal what their plain-numpy reference keeps, with
the same probabilities (llama.cpp's filters in llama.cpp's order), on small vocabularies with
ties (hypothesis) and on the bundled model's 49,152-token one (the heap, the min-p threshold and
the widening window that finds top-p's prefix without a top-k); a draw picks numpy's token."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from potluck.engine.core.sampling_kernel import candidates, candidates_reference, token_index, top_k_ids


def same(logits: np.ndarray, top_k: int, top_p: float, min_p: float, temperature: float) -> None:
    ids, probs = candidates(logits, top_k, top_p, min_p, temperature)
    want_ids, want_probs = candidates_reference(logits, top_k, top_p, min_p, temperature)
    assert ids.tolist() == want_ids.tolist()
    np.testing.assert_allclose(probs, want_probs, rtol=1e-12, atol=1e-15)
    assert abs(probs.sum() - 1.0) < 1e-12 and ids.shape[0] >= 1


@settings(max_examples=400, deadline=None)
@given(
    logits=st.lists(st.integers(-8, 8), min_size=1, max_size=80).map(
        lambda v: (np.array(v, dtype=np.float32) * np.float32(0.75))  # many ties
    ),
    top_k=st.integers(0, 90),
    top_p=st.sampled_from([1.0, 0.999, 0.95, 0.9, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.01, 0.05, 0.3, 0.99]),
    temperature=st.sampled_from([0.05, 0.5, 0.8, 1.0, 1.7]),
)
def test_kernel_matches_the_reference(
    logits: np.ndarray, top_k: int, top_p: float, min_p: float, temperature: float
) -> None:
    same(logits, top_k, top_p, min_p, temperature)


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(st.integers(0, 6), min_size=1, max_size=60).filter(any),
    u=st.one_of(st.sampled_from([0.0, 0.5, 1.0 - 2**-53]), st.floats(0.0, 1.0, exclude_max=True)),
)
def test_a_draw_picks_the_token_numpys_running_sum_picks(weights: list[int], u: float) -> None:
    """Every draw goes through token_index: it must pick what np.cumsum and searchsorted pick,
    on ties and zeros too, so a seed draws the same tokens as before it existed."""
    probs = np.array(weights, dtype=np.float64) / 7.0
    cum = np.cumsum(probs)
    want = min(int(np.searchsorted(cum, u * cum[-1], side="right")), probs.shape[0] - 1)
    assert token_index(probs, u) == want


def test_top_k_breaks_ties_by_the_lower_id() -> None:
    logits = np.array([1.0, 3.0, 3.0, 2.0, 3.0], dtype=np.float32)
    assert top_k_ids(logits, 2).tolist() == [1, 2]
    assert top_k_ids(logits, 4).tolist() == [1, 2, 3, 4]


def test_a_model_sized_vocabulary() -> None:
    rng = np.random.default_rng(7)
    for spread in (0.5, 3.0, 8.0):  # flat to peaked
        logits = rng.normal(0.0, spread, 49152).astype(np.float32)
        for args in [(40, 0.95, 0.05, 0.8), (0, 0.95, 0.0, 0.8), (0, 0.5, 0.0, 1.3), (0, 1.0, 0.0, 0.8),
                     (0, 0.9, 0.01, 0.7), (1, 1.0, 0.0, 1.0), (5000, 0.99, 0.0, 1.0)]:
            same(logits, *args)
