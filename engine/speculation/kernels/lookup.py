"""Prompt lookup (Saxena 2023; llama.cpp's ``lookup``): copy what followed the longest earlier
match of the conversation's suffix.

The N-gram tables (:mod:`.ngram`) re-ask their statistics for every drafted token, so a
chain can hop between passages. This kernel finds ONE earlier occurrence (the longest
suffix match, the most recent among equals) and copies the span after it, which is what a
reply that quotes its input or rewrites code does. Past the end of the conversation the
copy reads its own drafted tokens, so a periodic tail continues its period.

Cost: one backward scan of the token array with early exits, O(n) compares per draft
(microseconds for a few thousand tokens). :func:`lookup_reference` is the plain-Python
specification the kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba as nb
import numpy as np


@nb.njit(cache=True)
def lookup_match(toks: np.ndarray, n: int, min_match: int, max_match: int) -> tuple[int, int]:
    """(end, length) of the longest earlier match of the suffix of ``toks[:n]``.

    ``end`` is the index of the match's last token (``end < n - 1``); the most recent match
    wins among equal lengths; ``(-1, 0)`` when no match of ``min_match`` tokens exists.
    """
    best_end, best_len = -1, 0
    for end in range(n - 2, -1, -1):
        length = 0
        while length < max_match and length <= end and toks[end - length] == toks[n - 1 - length]:
            length += 1
        if length > best_len:
            best_end, best_len = end, length
            if length == max_match:
                break
    if best_len < min_match:
        return -1, 0
    return best_end, best_len


@nb.njit(cache=True)
def lookup_copy(toks: np.ndarray, n: int, end: int, k: int, out: np.ndarray) -> int:
    """Copy up to ``k`` tokens that follow ``toks[end]``; reads drafted ones past ``n``."""
    for j in range(k):
        src = end + 1 + j
        out[j] = toks[src] if src < n else out[src - n]
    return k


def lookup_draft(
    toks: np.ndarray, n: int, min_match: int, max_match: int, k: int
) -> tuple[list[int], int]:
    """Up to ``k`` copied tokens and the length of the match they came from (0: none)."""
    if k <= 0 or n < 2:
        return [], 0
    end, length = lookup_match(toks, n, min_match, max_match)
    if end < 0:
        return [], 0
    out = np.empty(k, dtype=np.int32)
    lookup_copy(toks, n, end, k, out)
    return out.tolist(), length


def lookup_reference(
    toks: Sequence[int], min_match: int, max_match: int, k: int
) -> tuple[list[int], int]:
    """The specification :func:`lookup_draft` must match: lists, no early exits."""
    n = len(toks)
    if k <= 0 or n < 2:
        return [], 0
    best_end, best_len = -1, 0
    for end in range(n - 2, -1, -1):
        length = 0
        for i in range(min(max_match, end + 1)):
            if toks[end - i] != toks[n - 1 - i]:
                break
            length = i + 1
        if length > best_len:
            best_end, best_len = end, length
    if best_len < min_match:
        return [], 0
    seq = list(toks)
    for j in range(k):
        seq.append(seq[best_end + 1 + j])
    return seq[n:], best_len


def warm_up() -> None:
    """Compile (or load from the numba cache) the kernels: call off the UI thread."""
    toks = np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32)
    lookup_draft(toks, toks.shape[0], 2, 8, 3)
