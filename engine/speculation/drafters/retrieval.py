"""TriForce's first level (Sun et al. 2024) as a drafter: the target itself over a small
*retrieval cache* drafts for the target over its full cache.

The retrieval cache is KV sequence 1 of the target's own context. With one KV stream per
sequence (docs/facts.md §4) a whole-sequence copy of sequence 0 into sequence 1 followed by
``seq_rm`` of the chunks not chosen builds it without recomputing a token, and work in
sequence 1 never changes a number of sequence 0. Chunks of ``chunk`` positions are scored
by the current query against their mean key (:mod:`..kernels.retrieval`, over the RoPE'd
keys and queries the target's context observes in a few layers, ``ContextParams.observe``);
the top chunks within the budget, the first positions (attention sinks) and the recent
window are kept. The cache is rebuilt every ``stride`` tokens, or sooner when the rolling
acceptance of its drafts drops.

A draft: N-gram tables propose up to ``gamma1`` tokens; sequence 1 runs them after the
tokens it lacks in one batch and keeps the prefix its own argmax agrees with, plus one token
of its own; repeat until the round's length is drafted or the drafts' estimated chance of
surviving verification falls below ``min_accept_p``. The drafts are deterministic (q =
delta). :meth:`RetrievalDrafter.accept` drops from sequence 1 what the full cache rejected.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...core.jobs import DecodeJob
from ...core.kv import KvOp
from ...core.target import MAX_EXACT_BATCH, Target
from ..adaptive import DraftBreakEven
from ..kernels.retrieval import chunk_scores, retrieval_ranges, warm_up
from . import Draft, DraftRequest
from .ngram import NgramDrafter

if TYPE_CHECKING:
    from ...core.runtime import Model

RETRIEVAL_SEQ = 1


def score_layers(n_layer: int) -> tuple[int, ...]:
    """Layers whose keys and queries score chunks: two in the middle of the stack (the first
    layers attend broadly, the last ones mostly to the recent window)."""
    return tuple(sorted({n_layer // 2, (3 * n_layer) // 4}))


@dataclass(frozen=True)
class RetrievalConfig:
    budget: int = 256  # tokens of chosen chunks (besides sinks and the recent window)
    chunk: int = 8  # positions per chunk (TriForce's choice)
    sinks: int = 16  # first positions always kept (attention sinks, StreamingLLM)
    recent: int = 64  # last positions always kept
    stride: int = 64  # rebuild after this many new tokens
    accept_floor: float = 0.5  # rebuild sooner when the rolling acceptance falls below
    min_context: int = 1024  # shorter conversations run as anpd
    gamma1: int = 4  # most N-gram tokens per retrieval-cache step

    @property
    def kept(self) -> int:
        return self.budget + self.sinks + self.recent


@dataclass
class LevelCounters:
    """What each level drafted and kept since the last reset (the bench reads these)."""

    ngram_drafted: int = 0  # N-gram tokens judged by the retrieval-cache target
    ngram_accepted: int = 0
    retrieval_drafted: int = 0  # retrieval-cache tokens judged by the full target
    retrieval_accepted: int = 0
    retrieval_steps: int = 0  # batches run in the retrieval sequence
    direct_drafted: int = 0  # N-gram tokens judged by the full cache directly (level 1 skipped)
    direct_accepted: int = 0
    rebuilds: int = 0
    budget: int = 0  # positions the retrieval cache held after its last rebuild
    context: int = 0  # positions of the full cache then
    long_replies: int = 0  # replies that used the retrieval cache
    short_replies: int = 0  # replies that ran as anpd


class RetrievalDrafter:
    """The target over its retrieval cache, N-gram guesses verified on the way (level 1).

    It drafts in the target's own context, so a reply starts with :meth:`start` (the
    target and the conversation), not the drafter contract's ``begin``."""

    name = "retrieval"

    def __init__(self, model: Model, config: RetrievalConfig, ngram: NgramDrafter, *, adaptive: bool = True) -> None:
        warm_up()
        self.config = config
        self.ngram = ngram  # level 1's own drafter (TriForce also drafts with it directly)
        self.adaptive = adaptive
        self.l1_break_even = DraftBreakEven()  # retrieval-cache batches
        self.counters = LevelCounters()
        self.layers = score_layers(model.n_layer)
        self.n_head = _meta_int(model, "attention.head_count", 1)
        self.step_ms = 0.0  # retrieval-cache ms per drafted token, measured
        self._target: Target | None = None
        self._n1 = 0  # positions 0.._n1-1 of sequence 1 hold the conversation (sparse)
        self._built_at = 0  # n_past of sequence 0 at the last rebuild
        self._acceptance = 1.0  # rolling acceptance of retrieval drafts
        self._base = 0  # conversation length when the last draft was made
        self._drafted = 0  # tokens in the last draft

    # -- the drafter contract
    def start(self, target: Target, context: Sequence[int], rng: np.random.Generator) -> None:
        """A long reply starts: the N-grams read the prompt. The cache is built at the first
        draft (scored against the prompt's last query all the same: the first round only
        samples the prompt's token), so it never delays the first token."""
        self._target = target
        self.ngram.begin(context, rng)
        self._n1 = 0  # sequence 1 holds nothing of this reply yet: the first draft rebuilds

    def begin(self, context: Sequence[int], rng: np.random.Generator) -> None:
        """Only :meth:`start` can begin a reply (it needs the target)."""
        raise TypeError("RetrievalDrafter starts with start(target, context, rng)")

    def draft(self, req: DraftRequest) -> Draft:
        target = self._target
        assert target is not None, "start() first"
        lagging = len(req.context) - self._n1 > MAX_EXACT_BATCH // 2  # many plain steps since
        if lagging or self._needs_rebuild(target.n_past):
            self._rebuild(target)
        self._base = len(req.context)
        drafts = self._retrieval_drafts(target, req)
        self._drafted = len(drafts)
        return Draft(drafts)

    def accept(self, n_accepted: int) -> None:
        """The full cache kept ``n_accepted`` drafts: sequence 1 forgets the rest."""
        if self._drafted:
            self.counters.retrieval_drafted += self._drafted
            self.counters.retrieval_accepted += n_accepted
            self._acceptance = 0.8 * self._acceptance + 0.2 * n_accepted / self._drafted
        self._trim_retrieval(self._base + n_accepted)

    def reset(self) -> None:
        self.ngram.reset()
        self.counters = LevelCounters()
        self._n1 = self._built_at = 0
        self._acceptance = 1.0

    def close(self) -> None:
        self.ngram.close()

    # -- level 1
    def _retrieval_drafts(self, target: Target, req: DraftRequest) -> list[int]:
        """Up to ``req.max_tokens`` tokens the target over the retrieval cache would write
        after the conversation (greedy), N-gram guesses verified in its own batches on the way."""
        k, min_accept_p = req.max_tokens, req.min_accept_p
        drafts: list[int] = []
        survive = 1.0  # estimated chance that the full cache accepts every draft so far
        ngram_cfg = self.config.gamma1
        while len(drafts) < k:
            context = [*req.context, *drafts]
            unfed = context[self._n1 :]  # tokens sequence 1 lacks (at least the last one)
            room = min(k - len(drafts) - 1, ngram_cfg, MAX_EXACT_BATCH - len(unfed))
            guess = Draft([])
            if room > 0:
                p1 = self.l1_break_even.threshold()
                guess = self.ngram.draft(DraftRequest(context, room, p1, req.sampling))
            guesses = guess.tokens[: max(0, room)]
            batch = unfed + guesses
            t = time.perf_counter()
            run = target.new_group()
            ticket = target.submit(
                DecodeJob.tokens(run, batch, self._n1, seq_id=RETRIEVAL_SEQ, outputs="all")
            )
            logits = target.wait(ticket)  # [len(batch), vocab]
            step_ms = (time.perf_counter() - t) * 1e3
            self.l1_break_even.record(len(batch), step_ms)
            self.counters.retrieval_steps += 1
            rows = logits[len(unfed) - 1 :]  # row i: after the context and guesses[:i]
            n_ok = 0
            while n_ok < len(guesses) and int(np.argmax(rows[n_ok])) == guesses[n_ok]:
                n_ok += 1
            if guesses:
                self.ngram.accept(n_ok)
                self.counters.ngram_drafted += len(guesses)
                self.counters.ngram_accepted += n_ok
            own = int(np.argmax(rows[n_ok]))
            new = guesses[:n_ok] + [own]
            self._n1 += len(unfed) + n_ok
            if n_ok < len(guesses):  # the rejected guesses leave sequence 1
                target.kv(KvOp.rm(RETRIEVAL_SEQ, self._n1))
            per_token = step_ms / len(new)
            self.step_ms = per_token if self.step_ms == 0.0 else 0.8 * self.step_ms + 0.2 * per_token
            for i, tok in enumerate(new):
                if len(drafts) >= k:
                    break
                survive *= _top_prob(rows[i]) if self.adaptive else 1.0
                drafts.append(tok)
            if survive < min_accept_p:
                break
        return drafts[:k]

    def _trim_retrieval(self, n_kept: int) -> None:
        """Sequence 1 keeps only positions below ``n_kept`` (the verified conversation)."""
        if self._n1 > n_kept:
            assert self._target is not None
            self._target.kv(KvOp.rm(RETRIEVAL_SEQ, n_kept))
            self._n1 = n_kept

    # -- the retrieval cache
    def _needs_rebuild(self, n_past: int) -> bool:
        since = n_past - self._built_at
        if since >= self.config.stride:
            return True
        return self._acceptance < self.config.accept_floor and since >= max(1, self.config.stride // 4)

    def _rebuild(self, target: Target) -> None:
        """Copy sequence 0 whole into sequence 1, then drop every chunk not chosen."""
        cfg = self.config
        n0 = target.n_past
        scores = self.chunk_scores(target, n0)
        ranges = retrieval_ranges(scores, n0, cfg.chunk, cfg.budget, cfg.sinks, cfg.recent)
        target.kv(KvOp.cp(0, RETRIEVAL_SEQ))
        for p0, p1 in ranges:
            target.kv(KvOp.rm(RETRIEVAL_SEQ, p0, p1))
        self._n1 = n0
        self._built_at = n0
        self._acceptance = 1.0
        self.counters.rebuilds += 1
        self.counters.budget = n0 - sum(p1 - p0 for p0, p1 in ranges)
        self.counters.context = n0

    def chunk_scores(self, target: Target, n0: int) -> np.ndarray:
        """Chunk scores of positions [sinks, n0 - recent) summed over the scoring layers,
        each layer's scores standardised first so that no layer's scale dominates."""
        cfg = self.config
        lo, hi = cfg.sinks, max(cfg.sinks, n0 - cfg.recent)
        total = np.zeros((hi - lo + cfg.chunk - 1) // cfg.chunk, dtype=np.float64)
        if hi <= lo:
            return total
        observed = target.observed  # type: ignore[attr-defined]
        for layer in self.layers:
            # a head's width and the KV heads from the layer's own rows: Gemma 4's sliding and
            # global layers differ in both (per-layer arrays in the header)
            keys, query = observed(f"Kcur-{layer}")[lo:hi], observed(f"Qcur-{layer}")[n0 - 1]
            head_dim = query.shape[0] // self.n_head
            n_head_kv = keys.shape[1] // head_dim
            s = chunk_scores(keys.reshape(hi - lo, n_head_kv, head_dim), query.reshape(self.n_head, head_dim),
                             hi - lo, cfg.chunk)
            total += (s - s.mean()) / (s.std() + 1e-6)
        return total

def _top_prob(logits: np.ndarray) -> float:
    """Probability of the argmax token (the retrieval target's confidence in its draft)."""
    z = logits.astype(np.float64)
    z -= z.max()
    return float(1.0 / np.exp(z).sum())


def _meta_int(model: Model, key: str, default: int) -> int:
    raw = model.meta(f"{model.arch}.{key}")
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default
