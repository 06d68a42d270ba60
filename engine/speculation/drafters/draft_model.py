"""A small model with the target's vocabulary drafts by running ahead autoregressively.

The draft keeps its own llama.cpp context (never the target's: docs/facts.md §4, other
sequences' cells in the target context would change its logits). Each draft first brings
the draft's KV cache up to the conversation: the common prefix stays, the rest is
re-decoded (usually the target's own token from the last round and, when every draft was
accepted, the last draft). The draft's exactness does not matter, only its speed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...core.errors import PotluckError
from ...core.gguf_tools import file_version
from ...core.jobs import DecodeJob
from ...core.load_watch import ThreadFollower
from ...core.rollback import SNAPSHOT_TOKENS, RecurrentRollback
from ...core.runtime import Context, ContextParams, Model
from ...core.sampling import Candidates, distribution
from . import Draft, DraftRequest


def _here(fn: Callable[[], Any]) -> Any:
    return fn()


_DIGESTS: dict[tuple[Path, int, int], str] = {}  # gguf_tools.file_version -> vocabulary_digest


def vocabulary_digest(model: Model) -> str:
    """SHA-256 over every token's bytes: two models can share ids only if this matches.
    Computed once per file version (0.16 s for a 49k-token vocabulary, ~1 s for 262k): a
    process that opens sessions again (the chat app's settings, serve's models) asks again."""
    key = file_version(model.path)
    digest = _DIGESTS.get(key)
    if digest is None:
        h = hashlib.sha256()
        for tok in range(model.n_vocab):
            h.update(model.token_bytes(tok, special=True))
            h.update(b"\x00")
        digest = _DIGESTS[key] = h.hexdigest()
    return digest


def check_same_vocabulary(target: Model, draft: Model) -> None:
    """Refuse a draft whose token ids do not mean what the target's mean."""
    same = target.vocab_signature() == draft.vocab_signature() and vocabulary_digest(
        target
    ) == vocabulary_digest(draft)
    if not same:
        raise PotluckError(
            f"draft model {draft.path.name} ({draft.n_vocab} tokens) does not share the "
            f"vocabulary of target model {target.path.name} ({target.n_vocab} tokens); "
            "pick a draft from the same model family"
        )


class DraftModelDrafter:
    name = "draft-model"

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 4096,
        n_threads: int = 0,
        p_min: float = 0.0,
        owns_model: bool = True,
        follow_load: bool = False,
    ) -> None:
        self.model = model
        self.owns_model = owns_model
        self.p_min = p_min  # stop drafting once the draft's own top probability falls below
        self.step_ms = 0.0  # measured cost of one draft step (decayed average)
        snapshots = SNAPSHOT_TOKENS if model.recurrent else 0
        self.ctx = Context(model, ContextParams(n_ctx=n_ctx, n_batch=512, n_threads=n_threads, follow_load=follow_load,
                                                n_rs_seq=snapshots))
        # a draft with recurrent layers (a Qwen3.5 draft) drops its rejected tail from kept
        # states (core/rollback.py), as the target's stages do
        self.rollback = RecurrentRollback(self.ctx, self._replay) if model.recurrent else None
        # Threads the user left unchosen follow the load, as the target's do (core/load_watch.py):
        # one descheduled thread stalls every draft step at llama.cpp's barriers.
        self.follow = ThreadFollower(self.ctx, follow_load, name="potluck-draft")
        self.tokens: list[int] = []  # what the draft's KV cache holds, in order
        # Where its llama.cpp work runs (compute_on): the target's compute thread on one machine
        self._run: Callable[[Callable[[], Any]], Any] = _here
        self._logits: np.ndarray | None = None  # draft logits after self.tokens, if fresh
        self._rng = np.random.default_rng()  # replaced by begin() with the session's child

    # -- keeping the draft's cache in step with the conversation
    def _synced_prefix(self, context: Sequence[int]) -> int:
        """Length of the common prefix of the draft's cache and ``context``.

        The conversation normally only grows, with at most the last round's drafts to undo,
        so the usual case compares a short tail (O(1) per round, not O(context)); a changed
        tail falls back to a full scan. An edit deeper than the tail goes unnoticed: drafts
        get worse, the output never changes (every draft is verified).
        """
        n = min(len(self.tokens), len(context))
        tail = max(0, n - 64)
        if self.tokens[tail:n] == list(context[tail:n]):
            return n
        i = 0
        while self.tokens[i] == context[i]:
            i += 1
        return i

    def compute_on(self, run: Callable[[Callable[[], Any]], Any]) -> None:
        """Run this draft's llama.cpp work through ``run`` (``Target.on_compute_thread``): a
        second thread computing in the process gave libgomp two teams, and on a 2-core machine
        every decode of both models ran ~40 % slower, the target's too (docs/facts.md §27)."""
        self._run = run

    # -- the drafter contract
    def begin(self, context: Sequence[int], rng: np.random.Generator) -> None:
        """Prefill the prompt now, so that the first round's draft time is drafting only."""
        self._rng = rng
        self._run(lambda: self._sync(context))

    def accept(self, n_accepted: int) -> None:
        pass  # the next draft() re-syncs to the conversation, accepted tokens included

    def _sync(self, context: Sequence[int]) -> None:
        """Decode what the draft has not seen of ``context``; leaves fresh logits after it."""
        self.follow.refresh()
        keep = self._synced_prefix(context)
        if keep == len(context) and keep == len(self.tokens) and self._logits is not None:
            return
        keep = self._cut(min(keep, len(context) - 1))  # at least one token to get fresh logits
        del self.tokens[keep:]
        todo = list(context[keep:])
        n_batch = self.ctx.n_batch  # what llama.cpp really allows (it clamps to the context)
        for start in range(0, len(todo), n_batch):
            chunk = todo[start : start + n_batch]
            t = time.perf_counter()
            self._decode(chunk)
            if len(chunk) == 1:
                self._note_step((time.perf_counter() - t) * 1e3)
            self.tokens.extend(chunk)
        self._logits = self.ctx.logits_row(-1)

    def draft(self, req: DraftRequest) -> Draft:
        return self._run(lambda: self._draft(req))

    def _draft(self, req: DraftRequest) -> Draft:
        k, context, params = req.max_tokens, req.context, req.sampling
        if k <= 0:
            return Draft([])
        self._sync(context)
        stochastic = not params.greedy
        penalty = params.penalized
        recent = list(context[-params.repeat_last_n :]) if penalty and params.repeat_last_n > 0 else []
        threshold = max(self.p_min, req.min_accept_p)
        drafts: list[int] = []
        qs: list[Candidates] = []
        chance = 1.0  # that every draft so far is accepted, by the draft's own confidence
        for i in range(k):
            logits = self._logits
            assert logits is not None
            # greedy: the argmax alone (with the penalties); within the reply's grammar if any
            q = distribution(logits, params, recent, req.grammar)
            # the draft's confidence stands in for its chance of acceptance: stop drafting
            # when the next token cannot pay for its share of the verify batch (decided
            # before drawing, so a drafted token is still an unbiased draw from q)
            top, top_prob = q.most_likely()
            chance *= top_prob if stochastic else self._top_prob(logits)
            if chance < threshold:
                break
            x = q.token_at(self._rng.random()) if stochastic else top
            drafts.append(x)
            if req.grammar is not None:
                req.grammar.accept(x)  # drawn from q, which only holds tokens it allows
            if stochastic:
                qs.append(q)
            if penalty:
                recent.append(x)
            if i == k - 1:
                break
            t = time.perf_counter()
            self._decode([x])
            self._note_step((time.perf_counter() - t) * 1e3)
            self.tokens.append(x)
            self._logits = self.ctx.logits_row(-1)
        # the last draft is not in the draft's cache yet: logits are stale until _sync()
        self._logits = None
        return Draft(drafts, qs if stochastic else None)

    def _decode(self, tokens: list[int]) -> None:
        """Decode ``tokens`` after the draft's cache (one batch)."""
        pos0 = len(self.tokens)
        self.ctx.run_tokens(tokens, pos0)
        if self.rollback is not None:
            self.rollback.computed(DecodeJob.tokens(0, tokens, pos0))

    def _replay(self, job: DecodeJob) -> None:
        self.ctx.run_tokens(job.inputs.tolist(), int(job.positions[0]))

    def _cut(self, keep: int) -> int:
        """Drop the draft's cache from ``keep``; a recurrent state not kept that far back is
        dropped whole (the next sync reads the conversation again). Returns where it ends."""
        if self.rollback is None:
            self.ctx.seq_rm(0, keep, -1)
            return keep
        if keep < self.rollback.floor:
            self.ctx.seq_rm(0)
            self.rollback.forget()
            return 0
        self.rollback.trim(keep)
        return keep

    def _note_step(self, ms: float) -> None:
        """Decayed average of one single-token draft decode (the marginal drafting cost)."""
        self.step_ms = ms if self.step_ms == 0.0 else 0.8 * self.step_ms + 0.2 * ms

    @staticmethod
    def _top_prob(logits: np.ndarray) -> float:
        z = logits - logits.max()
        return float(1.0 / np.exp(z, dtype=np.float64).sum())

    def reset(self) -> None:
        self.ctx.clear()
        if self.rollback is not None:
            self.rollback.forget()
        self.tokens = []
        self._logits = None

    def close(self) -> None:
        self.ctx.close()
        if self.owns_model:
            self.model.close()
