"""Multi-level token N-gram tables (ANPD, Ou et al. 2024) as numba kernels over token arrays.

The model: for every level n = 2..N, count how often each n-gram occurred; a query with a
context of n-1 tokens returns the most frequent next token (ties: the most recently seen),
asking the largest n first and falling back to smaller n (ANPD's Multi-Level N-gram).

Storage avoids Python objects entirely. The conversation's tokens live in one int32 array
``toks``; both tables are open-addressing hash tables whose slots store a *position* in
``toks`` instead of a key, so a slot's key is read back from the token array:

- n-gram table: slot ``(pos, level)`` stands for ``toks[pos-level+1 .. pos]``; ``cnt_val``
  holds its count;
- context table: slot ``(pos, level)`` stands for the context ``toks[pos-level+1 .. pos-1]``
  and its best next token is ``toks[pos]``; ``ctx_val`` holds that token's count.

Worked example, N = 3, tokens ``a b c a b`` (positions 0..4). After the update, the context
``(a, b)`` at level 3 points at position 2 (next token ``c``, count 1) and the context
``(b,)`` at level 2 points at position 2 as well. Drafting after ``... a b`` asks level 3
with ``(a, b)`` -> ``c``, then level 3 with ``(b, c)`` -> ``a``, and so on, until no level
matches or K tokens are drafted.

Each update touches N-1 slots per token and each draft step at most N-1 probes: the cost
per token does not grow with the context. Tables double (rehash) when half full.
Every kernel has a plain-Python counterpart (:class:`NgramReference`) used by the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba as nb
import numpy as np

EMPTY = -1
_PRIME = np.uint64(0x100000001B3)
_SEED = np.uint64(0xCBF29CE484222325)


# --------------------------------------------------------------------------- kernels


@nb.njit(cache=True, inline="always")
def _hash(src: np.ndarray, end: int, klen: int, level: int) -> np.uint64:
    """FNV-style hash of ``src[end-klen+1 .. end]`` salted with the level."""
    h = _SEED ^ np.uint64(level)
    for i in range(end - klen + 1, end + 1):
        h = (h ^ np.uint64(src[i] & 0xFFFFFFFF)) * _PRIME
    return h ^ (h >> np.uint64(29))


@nb.njit(cache=True, inline="always")
def _same_key(toks: np.ndarray, slot_end: int, src: np.ndarray, end: int, klen: int) -> bool:
    for i in range(klen):
        if toks[slot_end - i] != src[end - i]:
            return False
    return True


@nb.njit(cache=True)
def _find(
    toks: np.ndarray,
    src: np.ndarray,
    end: int,
    level: int,
    offset: int,
    tab_pos: np.ndarray,
    tab_lvl: np.ndarray,
) -> int:
    """Slot holding the key ``src[end-klen+1 .. end]`` (klen = level - offset), or the empty
    slot where it would go, encoded as ``-(slot + 1)``."""
    klen = level - offset
    mask = tab_pos.shape[0] - 1
    i = np.int64(_hash(src, end, klen, level) & np.uint64(mask))
    while True:
        pos = tab_pos[i]
        if pos == EMPTY:
            return -(i + 1)
        if tab_lvl[i] == level and _same_key(toks, pos - offset, src, end, klen):
            return i
        i = (i + 1) & mask


@nb.njit(cache=True)
def ngram_add(
    toks: np.ndarray,  # int32 [capacity], tokens 0..end-1 valid
    start: int,
    end: int,
    n_max: int,
    cnt_pos: np.ndarray,  # int64 [cap_c]
    cnt_lvl: np.ndarray,  # int8 [cap_c]
    cnt_val: np.ndarray,  # int32 [cap_c]
    ctx_pos: np.ndarray,  # int64 [cap_x]
    ctx_lvl: np.ndarray,  # int8 [cap_x]
    ctx_val: np.ndarray,  # int32 [cap_x]
) -> tuple[int, int]:
    """Count every n-gram (n = 2..n_max) that ends at a position in ``[start, end)``.

    Returns how many new slots each table used (the caller keeps the load factor low).
    """
    new_c = 0
    new_x = 0
    for t in range(start, end):
        for n in range(2, n_max + 1):
            if t - n + 1 < 0:
                break
            s = _find(toks, toks, t, n, 0, cnt_pos, cnt_lvl)
            if s < 0:
                s = -s - 1
                cnt_pos[s] = t
                cnt_lvl[s] = n
                cnt_val[s] = 1
                new_c += 1
            else:
                cnt_val[s] += 1
            count = cnt_val[s]
            x = _find(toks, toks, t - 1, n, 1, ctx_pos, ctx_lvl)
            if x < 0:
                x = -x - 1
                ctx_pos[x] = t
                ctx_lvl[x] = n
                ctx_val[x] = count
                new_x += 1
            elif count >= ctx_val[x]:  # ties go to the most recent occurrence
                ctx_pos[x] = t
                ctx_val[x] = count
    return new_c, new_x


@nb.njit(cache=True)
def ngram_draft(
    toks: np.ndarray,
    n_toks: int,
    n_max: int,
    k: int,
    ctx_pos: np.ndarray,
    ctx_lvl: np.ndarray,
    rate: np.ndarray,  # float64 [n_max + 1]: estimated hit rate of each level
    threshold: float,  # stop once the chance that the whole draft is accepted falls below
    out: np.ndarray,  # int32 [>= k] drafted tokens
    out_lvl: np.ndarray,  # int8 [>= k] level that produced each token
) -> int:
    """Draft up to ``k`` tokens after ``toks[:n_toks]`` by iterated multi-level queries.

    Stops early when no level matches (ANPD drafts nothing it has no evidence for), or
    when the product of the hit rates of the levels used so far (the chance that every
    draft up to here is accepted) drops below ``threshold``; with ``threshold = 0`` this
    is ANPD's plain K-step drafting. Returns the number of tokens written to ``out``.
    """
    chance = 1.0
    win = np.empty(n_max - 1 + k, dtype=np.int32)
    w = 0
    for i in range(max(0, n_toks - (n_max - 1)), n_toks):
        win[w] = toks[i]
        w += 1
    for j in range(k):
        found = -1
        for n in range(n_max, 1, -1):
            if w < n - 1:
                continue
            x = _find(toks, win, w - 1, n, 1, ctx_pos, ctx_lvl)
            if x >= 0:
                found = toks[ctx_pos[x]]
                out_lvl[j] = n
                break
        if found < 0:
            return j
        chance *= rate[out_lvl[j]]
        if chance < threshold:
            return j
        out[j] = found
        win[w] = found
        w += 1
    return k


@nb.njit(cache=True)
def rehash(
    toks: np.ndarray,
    offset: int,
    old_pos: np.ndarray,
    old_lvl: np.ndarray,
    old_val: np.ndarray,
    new_pos: np.ndarray,
    new_lvl: np.ndarray,
    new_val: np.ndarray,
) -> None:
    """Move every slot of a table into a bigger one (keys are re-read from ``toks``)."""
    for i in range(old_pos.shape[0]):
        pos = old_pos[i]
        if pos == EMPTY:
            continue
        level = np.int64(old_lvl[i])
        s = -_find(toks, toks, pos - offset, level, offset, new_pos, new_lvl) - 1
        new_pos[s] = pos
        new_lvl[s] = old_lvl[i]
        new_val[s] = old_val[i]


# --------------------------------------------------------------------------- owner of the arrays


class _Table:
    """One open-addressing table: positions, levels, values (counts)."""

    def __init__(self, capacity: int) -> None:
        self.pos = np.full(capacity, EMPTY, dtype=np.int64)
        self.lvl = np.zeros(capacity, dtype=np.int8)
        self.val = np.zeros(capacity, dtype=np.int32)
        self.used = 0

    def grown(self, toks: np.ndarray, offset: int, needed: int) -> _Table:
        cap = self.pos.shape[0]
        while (self.used + needed) * 2 > cap:
            cap *= 2
        if cap == self.pos.shape[0]:
            return self
        bigger = _Table(cap)
        rehash(toks, offset, self.pos, self.lvl, self.val, bigger.pos, bigger.lvl, bigger.val)
        bigger.used = self.used
        return bigger


class NgramTables:
    """Multi-level N-gram statistics over a growing token stream (numba-backed).

    ``extend(tokens)`` appends tokens and counts the n-grams they complete;
    ``draft(k)`` proposes up to ``k`` continuation tokens.
    """

    def __init__(self, n_max: int = 5, capacity: int = 1024) -> None:
        if not 2 <= n_max <= 16:
            raise ValueError(f"N must be in 2..16, got {n_max}")
        self.n_max = n_max
        self.toks = np.zeros(capacity, dtype=np.int32)
        self.n = 0
        self.counts = _Table(capacity * 2)
        self.contexts = _Table(capacity * 2)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        new = np.asarray(tokens, dtype=np.int32)
        end = self.n + new.shape[0]
        if end > self.toks.shape[0]:
            bigger = np.zeros(max(end, 2 * self.toks.shape[0]), dtype=np.int32)
            bigger[: self.n] = self.toks[: self.n]
            self.toks = bigger
        self.toks[self.n : end] = new
        needed = new.shape[0] * (self.n_max - 1)
        self.counts = self.counts.grown(self.toks, 0, needed)
        self.contexts = self.contexts.grown(self.toks, 1, needed)
        c, x = ngram_add(
            self.toks, self.n, end, self.n_max,
            self.counts.pos, self.counts.lvl, self.counts.val,
            self.contexts.pos, self.contexts.lvl, self.contexts.val,
        )  # fmt: skip
        self.counts.used += c
        self.contexts.used += x
        self.n = end

    def draft(
        self, k: int, rate: np.ndarray | None = None, threshold: float = 0.0
    ) -> tuple[list[int], list[int]]:
        """Up to ``k`` tokens and the level that produced each (see :func:`ngram_draft`)."""
        if k <= 0 or self.n == 0:
            return [], []
        if rate is None:
            rate = np.ones(self.n_max + 1, dtype=np.float64)
        out = np.empty(k, dtype=np.int32)
        lvl = np.empty(k, dtype=np.int8)
        pos, levels = self.contexts.pos, self.contexts.lvl
        m = ngram_draft(self.toks, self.n, self.n_max, k, pos, levels, rate, threshold, out, lvl)
        return out[:m].tolist(), lvl[:m].tolist()

    def last_token(self) -> int:
        return int(self.toks[self.n - 1]) if self.n else -1


def warm_up() -> None:
    """Compile (or load from the numba cache) every kernel: call off the UI thread."""
    t = NgramTables(3, capacity=8)
    t.extend([1, 2, 3, 1, 2, 3, 1, 2] * 3)
    t.draft(3)
    t.draft(3, np.full(4, 0.5), 0.3)


# --------------------------------------------------------------------------- plain-Python reference


class NgramReference:
    """The specification the kernels must match: dictionaries of counts, no hashing tricks."""

    def __init__(self, n_max: int = 5) -> None:
        self.n_max = n_max
        self.toks: list[int] = []
        # (level, context) -> {next token: (count, time of last occurrence)}
        self.stats: dict[tuple[int, tuple[int, ...]], dict[int, tuple[int, int]]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            t = len(self.toks)
            self.toks.append(int(tok))
            for n in range(2, self.n_max + 1):
                if t - n + 1 < 0:
                    break
                ctx = tuple(self.toks[t - n + 1 : t])
                nexts = self.stats.setdefault((n, ctx), {})
                count, _ = nexts.get(int(tok), (0, -1))
                nexts[int(tok)] = (count + 1, t)

    def query(self, context: Sequence[int]) -> tuple[int, int] | None:
        """(token, level) from the longest context that was seen, or None."""
        for n in range(self.n_max, 1, -1):
            if len(context) < n - 1:
                continue
            nexts = self.stats.get((n, tuple(context[len(context) - n + 1 :])))
            if nexts:
                return max(nexts.items(), key=lambda kv: kv[1])[0], n  # (count, recency)
        return None

    def draft(
        self, k: int, rate: Sequence[float] | None = None, threshold: float = 0.0
    ) -> tuple[list[int], list[int]]:
        rate = [1.0] * (self.n_max + 1) if rate is None else list(rate)
        window = list(self.toks)
        out: list[int] = []
        levels: list[int] = []
        chance = 1.0
        for _ in range(k):
            hit = self.query(window)
            if hit is None:
                break
            chance *= rate[hit[1]]
            if chance < threshold:
                break
            out.append(hit[0])
            levels.append(hit[1])
            window.append(hit[0])
        return out, levels
