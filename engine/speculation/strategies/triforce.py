"""TriForce (Sun et al. 2024): hierarchical speculation for long contexts.

Every decoding step of a long conversation reads the whole KV cache. TriForce drafts with
the target itself over a small *retrieval cache* (the chunks of the context that matter for
the current query) and verifies with the full cache, and lets a cheaper draft speculate for
that retrieval-cache target in turn:

    N-gram tables  --gamma1-->  target over the retrieval cache (sequence 1)
                   --gamma2-->  target over the full cache (sequence 0, canonical)

The retrieval cache is KV sequence 1 of the target's own context. With one KV stream per
sequence (docs/facts.md §4) a whole-sequence copy of sequence 0 into sequence 1 followed by
``seq_rm`` of the chunks not chosen builds it without recomputing a token, and work in
sequence 1 never changes a number of sequence 0. Chunks of 8 positions are scored by the
current query against their mean key (:mod:`..kernels.retrieval`, over the RoPE'd keys and
queries the target's context observes in a few layers, ``ContextParams.observe``); the top
chunks within the budget, the first positions (attention sinks) and the recent window are
kept. The cache is rebuilt every ``stride`` tokens, or sooner when the rolling acceptance
of its drafts drops.

Each round:
1. level 1: the N-gram tables propose up to gamma1 tokens; sequence 1 runs them after the
   tokens it lacks in one batch and keeps the prefix its own argmax agrees with, plus one
   token of its own; repeat until gamma2 tokens are drafted or their estimated chance of
   surviving verification falls below what a verified row costs;
2. level 2: sequence 0 verifies the pending token and the gamma2 drafts in one batch of at
   most ``MAX_EXACT_BATCH`` rows, exactly as :mod:`.speculative` does (same verifier, rejected
   tail trimmed), so greedy output is token for token plain decoding's and sampled output
   keeps the target's distribution (retrieval drafts are deterministic: q = delta);
3. sequence 1 drops what sequence 0 rejected.

Below ``min_context`` tokens (or when the retrieval cache would not be much smaller than the
full one) a reply runs as ``anpd``: reading the cache is then cheap and the retrieval level
only costs. In a long reply, rounds where one retrieval draft cannot pay for its verify row
(measured: :class:`..adaptive.DraftBreakEven`) draft with the N-grams alone, and a
:class:`..adaptive.DraftGate` keeps the reply from falling below plain decoding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...core.errors import PotluckError
from ...core.jobs import DecodeJob
from ...core.kv import KvOp
from ...core.strategy import Generation, Round, Strategy
from ...core.target import MAX_EXACT_BATCH
from ..adaptive import DraftBreakEven, DraftGate, LengthConfig, SpeculationLength
from ..drafters import Draft, DraftRequest
from ..drafters.ngram import NgramDrafter
from ..kernels.retrieval import chunk_scores, retrieval_ranges, warm_up
from .kit import LENGTH_OPTIONS, bool_option, int_option, saved_costs
from .speculative import NgramSpeculative, rows_after_drafts, verify_rows

if TYPE_CHECKING:
    from ...core.runtime import Model
    from ...core.spec import EngineSpec

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


class TriForce(Strategy):
    name = "triforce"
    description = "long contexts: the target drafts over a retrieval KV cache, N-grams draft for it"
    n_sequences = 2
    options = {
        **LENGTH_OPTIONS,
        "ngram_max": "the longest N-gram the tables hold",
        "budget": "tokens of context chunks the retrieval cache keeps",
        "chunk": "positions per scored chunk",
        "sinks": "first positions the retrieval cache always keeps",
        "recent": "last positions the retrieval cache always keeps",
        "stride": "rebuild the retrieval cache after this many new tokens",
        "min_context": "shorter conversations decode as anpd",
        "gamma1": "most N-gram tokens per retrieval-cache step",
    }

    def __init__(
        self,
        model: Model,
        config: RetrievalConfig,
        length: LengthConfig,
        short: NgramSpeculative,
        *,
        n_max: int = 5,
        adaptive: bool = True,
    ) -> None:
        warm_up()
        self.config = config
        self.length_config = length
        self.adaptive = adaptive
        self.short = short  # the whole reply when the context is short
        self.n_max = n_max
        self.ngram = NgramDrafter(n_max)
        self.length = SpeculationLength(length)
        self.break_even = DraftBreakEven()  # full-cache verify batches
        self.l1_break_even = DraftBreakEven()  # retrieval-cache batches
        self.gate = DraftGate()
        self.counters = LevelCounters()
        self.layers = score_layers(model.n_layer)
        n_head = _meta_int(model, "attention.head_count", 1)
        self.n_head = n_head
        self.n_head_kv = _meta_int(model, "attention.head_count_kv", n_head)
        self._long = False
        self._n1 = 0  # positions 0.._n1-1 of sequence 1 hold the conversation (sparse)
        self._built_at = 0  # n_past of sequence 0 at the last rebuild
        self._acceptance = 1.0  # rolling acceptance of retrieval drafts
        self._step_ms = 0.0  # retrieval-cache ms per drafted token, measured

    # -- construction
    @classmethod
    def observed_tensors(cls, model: Model) -> tuple[str, ...]:
        return tuple(f"{kind}-{layer}" for layer in score_layers(model.n_layer) for kind in ("Qcur", "Kcur"))

    @classmethod
    def build(cls, target_model: Model, spec: EngineSpec) -> Strategy:
        cls.check_options(spec.strategy_options)
        if spec.cluster is not None:
            raise PotluckError(
                "strategy 'triforce' runs on one machine (it reads the target's attention keys); "
                "use anpd or sd with --nodes"
            )
        d = RetrievalConfig()
        n_max = int_option(spec, "ngram_max", 5, 2, 16)
        chunk = int_option(spec, "chunk", d.chunk, 1, 256)
        config = RetrievalConfig(
            budget=int_option(spec, "budget", d.budget, chunk, 1 << 20),
            chunk=chunk,
            sinks=int_option(spec, "sinks", d.sinks, 0, 1 << 20),
            recent=int_option(spec, "recent", d.recent, 1, 1 << 20),
            stride=int_option(spec, "stride", d.stride, 1, 1 << 20),
            min_context=int_option(spec, "min_context", d.min_context, 0, 1 << 24),
            gamma1=int_option(spec, "gamma1", d.gamma1, 0, MAX_EXACT_BATCH - 1),
        )
        s_max = int_option(spec, "max_draft", 8, 1, MAX_EXACT_BATCH - 1)
        s_init = int_option(spec, "initial_draft", min(4, s_max), 0, s_max)
        adaptive = bool_option(spec, "adaptive", True)
        length = LengthConfig(s_init=s_init, s_max=s_max)
        costs = saved_costs(target_model, spec)
        short_length = LengthConfig(s_init=min(7, s_max), s_max=min(7, s_max))
        short = NgramSpeculative(NgramDrafter(n_max), short_length, adaptive=adaptive, costs=costs)
        return cls(target_model, config, length, short, n_max=n_max, adaptive=adaptive)

    # -- a reply
    def prepare(self, g: Generation) -> None:
        n_past = g.target.n_past
        self._long = n_past >= self.config.min_context and n_past >= 2 * self.config.kept
        if not self._long:
            self.counters.short_replies += 1
            self.short.prepare(g)
            return
        self.counters.long_replies += 1
        self.ngram.begin(g.history, g.drafter_rng())
        self._rebuild(g)  # scored against the prompt's last query; counts as prompt time

    def run(self, g: Generation) -> Iterator[Round]:
        if not self._long:
            yield from self.short.run(g)
            return
        yield from self._rounds(g)

    def _rounds(self, g: Generation) -> Iterator[Round]:
        target, sampler = g.target, g.sampler
        pending: list[int] = []  # last emitted token: in g.history, in neither sequence yet
        head_logits = g.first_logits
        self.gate.new_reply()
        while True:
            # How many drafts this round may verify, how likely each must be, and from which
            # level: a retrieval-cache draft costs a target step (``_step_ms``), an N-gram draft
            # nothing. Where verifying a row costs nearly a whole step (compute-bound batches,
            # docs/facts.md §6) no retrieval draft can pay: the N-grams then draft alone (anpd).
            direct = False
            if self.adaptive and pending:
                min_accept_p = self.break_even.threshold(self._step_ms)
                if min_accept_p >= 1.0:
                    direct, min_accept_p = True, self.break_even.threshold(0.0)
                fit = self.break_even.line()
                row_ms = fit[1] + (0.0 if direct else self._step_ms) if fit else None
                s = min(self.length.length(), self.gate.draft_cap(self.length_config.s_max, row_ms))
            else:
                s, min_accept_p = (self.length_config.s_max if pending else 0), 0.0
            k = max(0, min(s, g.remaining - 1, MAX_EXACT_BATCH - len(pending)))
            if min_accept_p >= 1.0:
                k = 0

            # 1. level 1: the retrieval-cache target drafts (N-grams drafting for it)
            t0 = time.perf_counter()
            if k > 0 and direct:
                request = DraftRequest(g.history, k, min_accept_p, sampler.params)
                drafts = self.ngram.draft(request).tokens[:k]
            elif k > 0:
                lagging = len(g.history) - self._n1 > MAX_EXACT_BATCH // 2  # many plain steps since
                if lagging or self._needs_rebuild(target.n_past):
                    self._rebuild(g)
                drafts = self._retrieval_drafts(g, k, min_accept_p)
            else:
                drafts = []
            t1 = time.perf_counter()

            # 2. level 2: the full cache verifies the pending token and the drafts at once
            batch = pending + drafts
            rows = target.decode(batch, all_logits=True) if batch else None
            after = rows_after_drafts(rows, bool(pending), head_logits, len(drafts))
            verdict = verify_rows(drafts, None, after, g.history, sampler)
            target.truncate(len(g.history) + verdict.n_accepted)
            # 3. the retrieval sequence forgets what the full cache rejected
            self._trim_retrieval(g, len(g.history) + verdict.n_accepted)
            t2 = time.perf_counter()

            tokens = verdict.tokens(drafts)
            draft_ms, verify_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
            self.length.record(len(tokens), draft_ms, verify_ms)
            self.break_even.record(len(batch), verify_ms)
            if batch:
                self.gate.record(len(drafts), len(tokens), draft_ms + verify_ms)
            if drafts and direct:
                self.ngram.accept(verdict.n_accepted)
                self.counters.direct_drafted += len(drafts)
                self.counters.direct_accepted += verdict.n_accepted
            elif drafts:
                self.counters.retrieval_drafted += len(drafts)
                self.counters.retrieval_accepted += verdict.n_accepted
                self._acceptance = 0.8 * self._acceptance + 0.2 * verdict.n_accepted / len(drafts)
            yield Round(
                tokens=tokens,
                drafted=len(drafts),
                accepted=verdict.n_accepted,
                draft_len=k,
                draft_ms=draft_ms,
                verify_ms=verify_ms,
            )
            if g.done or g.remaining <= 0:
                return
            pending = [tokens[-1]]

    # -- level 1
    def _retrieval_drafts(self, g: Generation, k: int, min_accept_p: float) -> list[int]:
        """Up to ``k`` tokens the target over the retrieval cache would write after the
        conversation (greedy), N-gram guesses verified in its own batches on the way."""
        target = g.target
        drafts: list[int] = []
        survive = 1.0  # estimated chance that the full cache accepts every draft so far
        ngram_cfg = self.config.gamma1
        while len(drafts) < k:
            context = g.history + drafts
            unfed = context[self._n1 :]  # tokens sequence 1 lacks (at least the last one)
            room = min(k - len(drafts) - 1, ngram_cfg, MAX_EXACT_BATCH - len(unfed))
            guess = Draft([])
            if room > 0:
                p1 = self.l1_break_even.threshold()
                guess = self.ngram.draft(DraftRequest(context, room, p1, g.sampler.params))
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
            self._step_ms = per_token if self._step_ms == 0.0 else 0.8 * self._step_ms + 0.2 * per_token
            for i, tok in enumerate(new):
                if len(drafts) >= k:
                    break
                survive *= _top_prob(rows[i]) if self.adaptive else 1.0
                drafts.append(tok)
            if survive < min_accept_p or g.remaining - 1 - len(drafts) <= 0:
                break
        return drafts[:k]

    def _trim_retrieval(self, g: Generation, n_kept: int) -> None:
        """Sequence 1 keeps only positions below ``n_kept`` (the verified conversation)."""
        if self._n1 > n_kept:
            g.target.kv(KvOp.rm(RETRIEVAL_SEQ, n_kept))
            self._n1 = n_kept

    # -- the retrieval cache
    def _needs_rebuild(self, n_past: int) -> bool:
        since = n_past - self._built_at
        if since >= self.config.stride:
            return True
        return self._acceptance < self.config.accept_floor and since >= max(1, self.config.stride // 4)

    def _rebuild(self, g: Generation) -> None:
        """Copy sequence 0 whole into sequence 1, then drop every chunk not chosen."""
        target, cfg = g.target, self.config
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

    def chunk_scores(self, target: object, n0: int) -> np.ndarray:
        """Chunk scores of positions [sinks, n0 - recent) summed over the scoring layers,
        each layer's scores standardised first so that no layer's scale dominates."""
        cfg = self.config
        lo, hi = cfg.sinks, max(cfg.sinks, n0 - cfg.recent)
        total = np.zeros((hi - lo + cfg.chunk - 1) // cfg.chunk, dtype=np.float64)
        if hi <= lo:
            return total
        observed = target.observed  # type: ignore[attr-defined]
        for layer in self.layers:
            keys = observed(f"Kcur-{layer}")[lo:hi]
            head_dim = keys.shape[1] // self.n_head_kv
            query = observed(f"Qcur-{layer}")[n0 - 1].reshape(self.n_head, head_dim)
            s = chunk_scores(keys.reshape(hi - lo, self.n_head_kv, head_dim), query, hi - lo, cfg.chunk)
            total += (s - s.mean()) / (s.std() + 1e-6)
        return total

    # -- lifetime
    def reset(self) -> None:
        self.short.reset()
        self.ngram.reset()
        self.length = SpeculationLength(self.length_config)
        self.gate = DraftGate()
        self.counters = LevelCounters()
        self._n1 = self._built_at = 0
        self._acceptance = 1.0

    def close(self) -> None:
        self.short.close()
        self.ngram.close()


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
