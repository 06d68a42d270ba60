"""PEARL (Liu et al. 2025, "Parallel Speculative Decoding with Adaptive Draft Length").

The draft and the target decode at the same time, each on its own cores:
- the draft runs ahead on a thread of its own (:class:`DraftAhead`), always guessing past
  the last verified token as if every draft so far will be accepted (*post-verify*: while
  the target verifies a window, the next one is being drafted);
- the target verifies in small batches kept in flight on its runner thread; after a
  rejection the first batch holds the corrected token alone and the draft's first new guess
  is checked against it as soon as both exist (*pre-verify*);
- the window (how many unverified drafts the target may compute) follows the measured
  speed ratio of target to draft, ``round(c) + 1``, as PEARL's adaptive draft length does.

Each round of the loop below reads top to bottom:
1. choose the mode: parallel (target and draft split the cores) or plain decoding on all
   cores when drafting does not pay (:class:`~..adaptive.DraftGate`, the same floor the
   other strategies use);
2. queue verify batches until two are in flight or the window is full;
3. verify position by position, waiting for a target row or a draft token as needed;
4. emit the accepted drafts plus the target's own token at the first rejection; cancel the
   batches computed on the rejected guess and trim their KV cells from the tail.

Exactness: every batch holds at most ``target.exact.max_rows`` tokens and rejected tokens leave
the KV cache from the tail, so each kept token sits where plain decoding would put it; the
target's thread count changes between modes, which does not change its numbers with the
BF16 KV cache (docs/facts.md §3, checked by the tests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from ...core.errors import PotluckError
from ...core.sampling import Candidates, SamplingParams
from ...core.strategy import Generation, Round, Strategy
from ...core.target import MAX_EXACT_BATCH
from ..adaptive import UNTIL_REPLY_END, DraftGate
from ..drafters import ContextView, Drafter, DraftRequest
from ..inflight import InFlightBook, RowJudge

if TYPE_CHECKING:
    from ...core.runtime import Model
    from ...core.spec import EngineSpec

log = logging.getLogger(__name__)


class DraftAhead:
    """The drafter running ahead of verification on its own thread.

    ``chain`` holds the drafter's guesses for positions ``base..``; the verifier reads them
    with :meth:`token_at` and moves the base with :meth:`accept` / :meth:`redirect`. The
    drafter never runs more than ``lookahead`` tokens past the base. Each stochastic draw is
    seeded by its position and the number of redirects so far, so a seeded reply drafts the
    same tokens whatever the threads' timing.
    """

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self._cond = threading.Condition()
        self._history: list[int] = []
        self._base = 0  # absolute position of chain[0]
        self._chain: list[int] = []
        self._q: list[Candidates | None] = []
        self._epoch = 0  # bumped whenever the chain is thrown away
        self._stuck = False  # the drafter had no guess after the current chain
        self._running = False
        self._in_step = False  # the drafter is computing (pause waits for it)
        self._closed = False
        self._lookahead = 4
        self._sampling = SamplingParams()
        self._rng: np.random.Generator | None = None
        self._seed: np.random.SeedSequence | None = None
        self.busy: list[tuple[float, float]] = []  # draft step intervals (perf_counter s)
        self._thread = threading.Thread(target=self._loop, name="potluck-pearl-draft", daemon=True)
        self._thread.start()

    # -- the verifier's side (one thread)
    def start(
        self,
        history: list[int],
        sampling: SamplingParams,
        rng: np.random.Generator,
        seed: np.random.SeedSequence,
    ) -> None:
        """Draft after ``history`` (the conversation so far) until :meth:`pause`."""
        with self._cond:
            self._history, self._base = history, len(history)
            self._chain, self._q = [], []
            self._sampling, self._rng, self._seed = sampling, rng, seed
            self._epoch += 1
            self._stuck = False
            self._running = True
            self._cond.notify_all()

    def pause(self) -> None:
        """Stop drafting (plain decoding, or the reply ended); returns once no step runs."""
        with self._cond:
            self._running = False
            self._epoch += 1
            self._cond.notify_all()
            while self._in_step:
                self._cond.wait()

    def token_at(self, pos: int) -> tuple[int, Candidates | None] | None:
        """The guess for position ``pos`` (waits for it), or None if none is coming."""
        with self._cond:
            while True:
                i = pos - self._base
                if 0 <= i < len(self._chain):
                    return self._chain[i], self._q[i]
                if self._stuck or not self._running or i < 0 or i >= self._lookahead:
                    return None  # no guess is coming for this position
                self._cond.wait()

    def set_lookahead(self, n: int) -> None:
        """How far past the base the drafter may guess (the window, plus one)."""
        with self._cond:
            self._lookahead = n
            self._cond.notify_all()  # a drafter waiting on a full chain may go on

    def drafted(self, start: int, limit: int) -> list[int]:
        """Guesses already made for positions ``start..start+limit-1`` (no waiting)."""
        with self._cond:
            i = start - self._base
            return self._chain[max(0, i) : max(0, i + limit)] if i >= 0 else []

    def accept(self, n: int) -> None:
        """The first ``n`` guesses were accepted: the base moves past them."""
        with self._cond:
            del self._chain[:n], self._q[:n]
            self._base += n
            self._cond.notify_all()

    def redirect(self, token: int) -> None:
        """The conversation continues with ``token`` at the base (the target's own choice):
        keep the chain if it guessed the same, else draft again after it."""
        with self._cond:
            if self._chain and self._chain[0] == token:
                del self._chain[:1], self._q[:1]
            else:
                self._chain, self._q = [], []
                self._epoch += 1
                self._stuck = False
            self._base += 1
            self._cond.notify_all()

    def take_busy(self) -> list[tuple[float, float]]:
        with self._cond:
            out, self.busy = self.busy, []
            return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._running = False
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # -- the drafting thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (
                    not self._running or self._stuck or len(self._chain) >= self._lookahead
                ):
                    self._cond.wait()
                if self._closed:
                    return
                epoch, pos = self._epoch, self._base + len(self._chain)
                context = ContextView(self._history, self._base, tuple(self._chain))
                sampling = self._sampling
                self._in_step = True
            try:
                t0 = time.perf_counter()
                self._seed_draw(epoch, pos, sampling)
                draft = self.drafter.draft(DraftRequest(context, 1, 0.0, sampling))
                t1 = time.perf_counter()
            except Exception:  # a broken drafter stops drafting; verification goes on
                log.exception("draft step failed")
                draft, t1 = None, time.perf_counter()
            with self._cond:
                self._in_step = False
                self.busy.append((t0, t1))
                if epoch == self._epoch:
                    if draft is None or not draft.tokens:
                        self._stuck = True
                    else:
                        self._chain.append(draft.tokens[0])
                        self._q.append(draft.q[0] if draft.q else None)
                self._cond.notify_all()

    def _seed_draw(self, epoch: int, pos: int, sampling: SamplingParams) -> None:
        """Key the drafter's next draw to (redirects so far, position): timing-free seeds."""
        if sampling.greedy or self._rng is None or self._seed is None:
            return
        key = np.random.SeedSequence(self._seed.entropy, spawn_key=(*self._seed.spawn_key, epoch, pos))
        self._rng.bit_generator.state = np.random.PCG64(key).state


def split_threads(n_threads: int, target_ms: float, draft_ms: float) -> tuple[int, int]:
    """(target, draft) threads: cores shared in proportion to the measured cost per token
    (PEARL runs both models at once, so the slower one should get more cores)."""
    if n_threads < 2:
        return n_threads, 0
    share = draft_ms / (target_ms + draft_ms) if target_ms + draft_ms > 0 else 0.5
    n_draft = min(n_threads - 1, max(1, round(n_threads * share)))
    return n_threads - n_draft, n_draft


class Pearl(Strategy):
    name = "pearl"
    accepts_draft = True  # a draft model with --draft, else the N-gram tables
    description = "draft and target decode at the same time on their own cores (PEARL)"
    options = {
        "max_draft": "the most unverified drafts the target may compute ahead",
        "adaptive": "fall back to plain decoding when drafting does not pay (false: always parallel)",
    }

    def __init__(
        self,
        drafter: Drafter,
        *,
        n_threads: int,
        target_threads: int,
        max_window: int = 8,
        adaptive: bool = True,
        gate_backoff: int = DraftGate().backoff,
    ) -> None:
        self.drafter = drafter
        self.n_threads = n_threads  # all of them: plain decoding's
        self.target_threads = target_threads  # the target's share while the draft runs
        self.max_window = max_window
        self.adaptive = adaptive
        self.gate_backoff = gate_backoff
        self.gate = DraftGate(backoff=gate_backoff)
        self.ahead = DraftAhead(drafter)
        self._rng: np.random.Generator | None = None
        self._target_ms = 0.0  # measured target cost per verified row in parallel mode
        self.parallel = target_threads > 0

    @classmethod
    def build(cls, target_model: Model, spec: EngineSpec) -> Strategy:
        from ...core.load_watch import default_threads
        from ..drafters.ngram import NgramDrafter
        from .kit import bool_option, int_option, load_draft_model

        cls.check_options(spec.strategy_options)
        window = int_option(spec, "max_draft", 8, 1, MAX_EXACT_BATCH - 1)
        adaptive = bool_option(spec, "adaptive", True)
        n_threads = spec.n_threads or default_threads()
        if spec.draft is None:  # table lookups cost no cores: the target keeps them all
            return cls(NgramDrafter(), n_threads=n_threads, target_threads=n_threads,
                       max_window=window, adaptive=adaptive)
        if n_threads < 2:
            raise PotluckError(
                "strategy 'pearl' runs the draft model and the target at the same time and "
                "needs at least 2 threads (-t 2); with one core use 'sd'"
            )
        from ...core.measure import decode_ms_per_token

        draft_model = load_draft_model(target_model, spec)
        try:
            # measured, not assumed: each model's cost per token on one thread
            t_ms = decode_ms_per_token(target_model, 1, steps=8) if n_threads > 2 else 1.0
            d_ms = decode_ms_per_token(draft_model, 1, steps=8) if n_threads > 2 else 1.0
            target_threads, draft_threads = split_threads(n_threads, t_ms, d_ms)
            from ..drafters.draft_model import DraftModelDrafter

            drafter = DraftModelDrafter(draft_model, n_ctx=spec.n_ctx, n_threads=draft_threads)
        except BaseException:
            draft_model.close()
            raise
        # the draft model pays a catch-up prefill to resume: once parallel mode loses, not
        # this reply (its next reply starts in sync, prefilled with the prompt)
        return cls(drafter, n_threads=n_threads, target_threads=target_threads,
                   max_window=window, adaptive=adaptive, gate_backoff=UNTIL_REPLY_END)

    def prepare(self, g: Generation) -> None:
        """The drafter reads the conversation only once the first token is out (it comes
        from the prompt's own logits), as in :class:`.speculative.Speculative`."""
        self._rng = g.drafter_rng()

    def run(self, g: Generation) -> Iterator[Round]:
        self.gate.new_reply()
        try:
            yield from self._rounds(g)
        finally:
            self.ahead.pause()

    def window(self) -> int:
        """PEARL's adaptive draft length: as many drafts as the draft writes while the
        target computes one row, plus one; capped by the gate's risk budget."""
        step = self.drafter.step_ms
        c = self._target_ms / step if step > 0 and self._target_ms > 0 else float(self.max_window)
        w = max(1, min(self.max_window, round(c) + 1))
        return min(w, self.gate.draft_cap(w)) if self.adaptive else w

    def _rounds(self, g: Generation) -> Iterator[Round]:
        target, sampler = g.target, g.sampler
        params = sampler.params
        history = g.history  # grows by what each round yields (the session appends)
        book = InFlightBook(target, len(history), g.first_logits)
        judge = RowJudge(sampler, history)
        parallel = False
        first = len(history)  # the first token's position: sampled from the prompt's logits
        begun = False  # whether the drafter has read the conversation (after the first token)
        prompt_ms = 0.0  # its reading, reported with the next round as prompt processing
        last = prev_done = time.perf_counter()

        def collect() -> tuple[float, float]:
            """Wait for the oldest batch and file its rows; returns when it computed (it starts
            once queued and the batch before it is done; it ends about when the wait returns)."""
            nonlocal prev_done
            b = book.redeem_oldest()
            t_done = time.perf_counter()
            start, prev_done = max(b.queued_at, prev_done), t_done
            per_row = (t_done - start) * 1e3 / b.n
            self._target_ms = per_row if self._target_ms == 0 else 0.8 * self._target_ms + 0.2 * per_row
            return start, t_done

        def settle(keep_below: int) -> None:
            """Finish the batches that hold tokens below ``keep_below``, cancel the rest (they
            hold rejected guesses) and trim the KV cache back to ``keep_below`` tokens."""
            book.cancel_from(keep_below)
            while book.runs:
                collect()
            book.trim(keep_below)
            book.redeem_stale(block=True)

        try:
            while True:
                p = len(history)  # the position decided next
                window = self.window() if self.parallel and p > first else 0
                # 1. mode: parallel while drafting may pay, plain decoding on all cores otherwise
                if (window > 0) != parallel:
                    settle(p)
                    parallel = window > 0
                    if parallel:
                        assert self._rng is not None
                        if not begun:
                            t = time.perf_counter()
                            self.drafter.begin(history, self._rng)
                            prompt_ms, begun = (time.perf_counter() - t) * 1e3, True
                        target.set_threads(self.target_threads)
                        self.ahead.start(history, params, self._rng, g.seeds.spawn(1)[0])
                    else:
                        self.ahead.pause()
                        target.set_threads(self.n_threads)
                if not parallel:
                    t0 = time.perf_counter()
                    decoded = p not in book.rows
                    if decoded:  # accepted tokens the cache lacks (at least the last one)
                        target.truncate(min(target.n_past, p - 1))
                        book.rows = {p: target.decode(history[target.n_past : p])[-1]}
                    token = judge.own_token(book.rows[p], ())
                    ms = (time.perf_counter() - t0) * 1e3
                    if decoded:  # the first token decodes nothing: it times no step
                        self.gate.record(0, 1, ms)
                    last = time.perf_counter()
                    yield Round(tokens=[token], verify_ms=ms, prompt_ms=prompt_ms, rows=[book.rows[p]])
                    prompt_ms = 0.0
                    if g.done or g.remaining <= 0:
                        return
                    book.rows = {}
                    continue

                # 2. keep the target busy: up to two verify batches in flight, with at most
                #    `window` unverified guesses computed past position p
                self.ahead.set_lookahead(window + 1)
                while len(book.runs) < 2:
                    start = target.n_past
                    toks = history[start:p]  # accepted but not in the cache (the target's own token)
                    first_guess = max(start, p)
                    room = min(p + window - first_guess, target.exact.max_rows - len(toks), g.remaining - 1)
                    toks += self.ahead.drafted(first_guess, max(0, room))
                    if not toks:
                        break
                    book.send(toks)

                # 3. verify position by position, waiting for target rows and draft tokens
                verify_busy: list[tuple[float, float]] = []

                def row_at(
                    i: int, p: int = p, window: int = window, busy: list[tuple[float, float]] = verify_busy
                ) -> np.ndarray | None:
                    """The row deciding position p + i: waits for a batch only while nothing is
                    decided (then reports what is, or queues more work first); none past the
                    window (the draft waits for this round to end before guessing further)."""
                    while p + i not in book.rows:
                        if i or not book.runs:
                            return None
                        busy.append(collect())
                    return book.rows[p + i] if i < window + 1 else None

                decision = judge.decide(lambda i, p=p: self.ahead.token_at(p + i), row_at)
                emitted = decision.tokens
                if not emitted:
                    continue

                # 4. report: the overlap of draft steps and target batches is the parallelism
                now = time.perf_counter()
                drafting = self.ahead.take_busy()
                draft_ms = _busy_ms(drafting, last, now)
                verify_ms = _busy_ms(verify_busy, last, now)
                overlap_ms = _overlap_ms(drafting, verify_busy, last, now)
                self.gate.record(max(decision.judged, 1), len(emitted), (now - last) * 1e3)
                last = now
                yield Round(
                    tokens=emitted,
                    drafted=decision.judged,
                    accepted=decision.n_accepted,
                    draft_len=window,
                    draft_ms=draft_ms,
                    verify_ms=verify_ms,
                    overlap_ms=overlap_ms,
                    prompt_ms=prompt_ms,
                    rows=decision.rows,
                )
                prompt_ms = 0.0
                if g.done or g.remaining <= 0:
                    return
                # the conversation now ends with `emitted`: move the draft and the caches after it
                if decision.own:
                    own = len(history) - 1  # position of the target's own token
                    self.ahead.accept(len(emitted) - 1)
                    self.ahead.redirect(emitted[-1])
                    settle(own)  # every batch in flight was built on the rejected guess
                else:
                    self.ahead.accept(len(emitted))
                book.forget_before(len(history))
        finally:
            # the reply ended (or the session stopped asking for rounds): no guess may stay
            # in flight or in the cache past the conversation
            settle(len(history))

    def reset(self) -> None:
        self.drafter.reset()
        self.gate = DraftGate(backoff=self.gate_backoff)

    def close(self) -> None:
        self.ahead.close()
        self.drafter.close()


def _busy_ms(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans) * 1e3


def _overlap_ms(xs: list[tuple[float, float]], ys: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Time both lists of busy intervals cover at once, within [t0, t1]."""
    total = 0.0
    for a0, a1 in xs:
        for b0, b1 in ys:
            lo, hi = max(a0, b0, t0), min(a1, b1, t1)
            if hi > lo:
                total += hi - lo
    return total * 1e3
