"""Minions (Wang et al. 2024): several drafters vote, drafting runs ahead of verification.

The round loop is :class:`~.speculative.Speculative`'s (one chain, one target batch of at
most ``target.exact.max_rows`` tokens, trim the rejected tail; the adaptive length, the break-even
threshold and the whole-reply floor come with it). What Minions changes is where the chain
comes from, :class:`MajorityVote`, a drafter made of drafters:

- voters: the draft model (``--draft``, optional), a prompt lookup (longest earlier match,
  :mod:`..drafters.lookup`), ANPD's N-gram tables (N = 5) and a second table with a short N
  (N = 3: the most frequent continuation of the last two tokens, where N = 5 mostly copies
  the latest occurrence of a 4-token context);
- their chains merge into a weighted token tree and the heaviest path is verified
  (:mod:`..voting`); after each round every voter is scored against the target's tokens and
  its weight follows its acceptance;
- decoupled drafting: drafters that cost real time (the draft model) draft the NEXT round on
  a worker thread while the target verifies this one, assuming the whole path is accepted
  (their first token guesses the target's bonus token): the pool holds one verifier batch,
  as Minions pauses its drafters once the pool holds a batch. The verifier takes that entry
  only if the conversation grew exactly as assumed; otherwise the entry is dropped from the
  divergence on and the drafter drafts afresh. While few entries are used the worker pauses
  (:class:`AheadGate`). N-gram and lookup drafts cost microseconds and are always drafted
  in place.

Exactness. Greedy: the verified chain is checked against the target's argmax, whatever drafted
it. Sampling: a chain whose tokens do not depend on the verifier's random draws may always be
verified as deterministic drafts (``q = None``). A draft model's ``q`` rows are used only when
the verified chain is its own and that choice was made before its tokens were drawn: the
draft model is the heaviest voter at the start of the round (choosing its chain because
others agreed with its sampled tokens would bias them). Seeded runs repeat exactly: every
voter draws from its own generator, and what the worker drafts ahead is fixed before it
starts (never "as much as fits while the target runs").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.errors import PotluckError
from ...core.events import DrafterStanding
from ...core.sampling import Candidates
from ...core.strategy import Generation, Round, Strategy
from ...core.target import MAX_EXACT_BATCH
from ..adaptive import LengthConfig
from ..drafters import Draft, Drafter, DraftRequest
from ..voting import DrafterWeights, WeightConfig, heaviest_path, score_chain
from .kit import LENGTH_OPTIONS, bool_option, int_option, load_draft_model, saved_costs
from .speculative import Speculative

if TYPE_CHECKING:
    from ...core.runtime import Model
    from ...core.spec import EngineSpec


@dataclass(frozen=True)
class MinionsRound(Round):
    """A round plus the pool's own counters (``drafters`` holds each voter's standing)."""

    ahead_ms: float = 0.0  # the part of draft_ms the worker thread drafted
    pool_hits: int = 0  # voters whose chain this round came from the pool


class AheadGate:
    """Draft ahead only while the pool serves: wasted drafts still cost a core.

    A worker's draft is used only if the whole path is accepted AND its first token guessed
    the target's own. Over each ``window`` drafts ahead the hit rate is measured; below
    ``min_hit`` the worker pauses for ``backoff`` rounds (doubling while it keeps missing,
    up to ``max_backoff``), then probes again. Decided from hits, never from timings, so a
    seeded reply draws the same tokens however fast the threads run.
    """

    def __init__(
        self, min_hit: float = 0.25, window: int = 8, backoff: int = 8, max_backoff: int = 256
    ) -> None:
        self.min_hit = min_hit
        self.window = window
        self.initial_backoff = backoff
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._paused = 0  # rounds left before the next probe
        self._hits = 0
        self._seen = 0
        self.pauses = 0  # times it paused (reports and tests)

    def allow(self) -> bool:
        """Whether to draft ahead this round (a paused round counts down the back-off)."""
        if self._paused > 0:
            self._paused -= 1
            return False
        return True

    def record(self, hit: bool) -> None:
        """One draft ahead was used (hit) or dropped."""
        self._hits += hit
        self._seen += 1
        if self._seen < self.window:
            return
        if self._hits < self.min_hit * self._seen:
            self._paused = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.pauses += 1
        else:
            self.backoff = self.initial_backoff
        self._hits = self._seen = 0


@dataclass
class _Ahead:
    """A pool entry: what a voter drafted assuming ``path`` is accepted after ``base`` tokens."""

    base: int  # conversation length when the round drafted
    last: int  # the conversation's token at base - 1 (cheap check that it was not edited)
    seq: list[int]  # path + the voter's tokens after it (the first guesses the bonus token)
    n_path: int
    q: list[Candidates] | None  # the q of each of seq[n_path:], sampled drafts only


@dataclass
class _Pending:
    """Chains of the last draft, scored once the target's tokens after ``base`` are known."""

    base: int
    chains: list[list[int]]


class MajorityVote:
    """A drafter made of voters: merge their chains, verify the heaviest (see module doc)."""

    name = "minions"

    def __init__(
        self,
        voters: Sequence[tuple[str, Drafter]] | Sequence[tuple[str, Drafter, float]],
        *,
        ahead: Sequence[int] = (),
        weights: WeightConfig | None = None,
        n_ctx: int | None = None,
    ) -> None:
        """``voters``: (label, drafter) or (label, drafter, initial weight); ``ahead``: indices
        of the voters drafted on the worker thread; ``n_ctx``: the voters' context size (a
        worker never drafts past it)."""
        if not voters:
            raise ValueError("MajorityVote needs at least one voter")
        self.labels = [v[0] for v in voters]
        self.voters: list[Drafter] = [v[1] for v in voters]
        self.initial = [float(v[2]) if len(v) > 2 else 1.0 for v in voters]  # type: ignore[misc]
        self.ahead = sorted(set(ahead))
        self.n_ctx = n_ctx
        self.weight_config = weights or WeightConfig()
        self.weights = DrafterWeights(len(self.voters), self.weight_config, self.initial)
        self._pool: dict[int, _Ahead] = {}
        self._pending: _Pending | None = None
        self._job: Future[tuple[float, float]] | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._verify_from = 0.0  # when the target started verifying the last path
        self._verify_to = 0.0
        self._voted = -1
        self._hits = 0  # pool hits in the last draft
        self._misses = [1.0] * len(self.voters)  # decayed pool miss rate (misses until measured)
        self.gate = AheadGate()
        # measured: worker drafting, and the part of it that overlapped a verification
        self.ahead_ms = 0.0
        self.overlap_ms = 0.0
        self._unreported = (0.0, 0.0, 0.0)  # (worker busy, overlapped, verifier waited) ms

    # -- the drafter contract
    @property
    def step_ms(self) -> float:
        """Cost of one more drafted token on the verifier's path: in-place voters in full,
        voters drafted ahead only as often as the pool missed."""
        return sum(
            d.step_ms * (self._misses[i] if i in self.ahead else 1.0) for i, d in enumerate(self.voters)
        )

    def compute_on(self, run: Callable[[Callable[[], Any]], Any]) -> None:
        """Voters that draft in turn with the target compute on its thread (draft_model.py);
        one that drafts ahead runs beside it, on the worker."""
        for i, voter in enumerate(self.voters):
            bind = getattr(voter, "compute_on", None)
            if bind is not None and i not in self.ahead:
                bind(run)

    def begin(self, context: Sequence[int], rng: np.random.Generator) -> None:
        self._join()
        self._pool.clear()
        self._pending = None
        self.gate = AheadGate()  # each reply starts drafting ahead (the hit rate is the reply's)
        for voter, child in zip(self.voters, rng.spawn(len(self.voters))):
            voter.begin(context, child)

    def draft(self, req: DraftRequest) -> Draft:
        self._join()
        if self._pending is not None:  # not settled by Minions.run: read the tokens from context
            p = self._pending
            self.settle(p.base, req.context[p.base : p.base + max(map(len, p.chains), default=0) + 1])
        k = req.max_tokens
        chains: list[list[int]] = []
        qs: list[list[Candidates] | None] = []
        self._hits = 0
        for i, voter in enumerate(self.voters):
            drafted_ahead = i in self._pool
            got = self._from_pool(i, req.context, k)
            if i in self.ahead:  # the verifier pays a voter's drafting whenever the pool misses
                self._misses[i] = 0.8 * self._misses[i] + 0.2 * (got is None)
            if drafted_ahead:
                self.gate.record(got is not None)
            if got is None:
                d = voter.draft(req)
                got = (d.tokens[:k], d.q[:k] if d.q is not None else None)
            else:
                self._hits += 1
            chains.append(got[0])
            qs.append(got[1])
        path, voted, q = self._choose(chains, qs, req.sampling.greedy)
        self._pending = _Pending(len(req.context), chains)
        self._voted = voted
        if path and self.ahead and self.gate.allow():
            self._start_ahead(req, path)
        self._verify_from = time.perf_counter()
        return Draft(path, q)

    def _choose(
        self, chains: list[list[int]], qs: list[list[Candidates] | None], greedy: bool
    ) -> tuple[list[int], int, list[Candidates] | None]:
        """The chain to verify, its voter, and the q rows the verifier may use with it."""
        leader = self.weights.leader()  # decided by past rounds, before this round's draws
        if not greedy and qs[leader] is not None and chains[leader]:
            return chains[leader], leader, qs[leader]  # sd's acceptance: its own chain, chosen blind
        path, voted = heaviest_path(chains, self.weights.weights)
        return path, voted, None  # tokens the verifier's draws did not choose: valid as q = delta

    def accept(self, n_accepted: int) -> None:
        """The verification ended; voters are scored in :meth:`settle` (it needs the target's
        own token too, which a rejected chain's rivals may have guessed)."""
        self._verify_to = time.perf_counter()

    def reset(self) -> None:
        self._join()
        self._pool.clear()
        self._pending = None
        self.weights = DrafterWeights(len(self.voters), self.weight_config, self.initial)
        for voter in self.voters:
            voter.reset()

    def close(self) -> None:
        try:
            self._join()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            for voter in self.voters:
                voter.close()

    # -- voting and scoring
    def settle(self, base: int, truth: Sequence[int]) -> None:
        """Score the last draft's chains: ``truth`` is what the target produced after the
        first ``base`` tokens (the kept drafts and its own token)."""
        p, self._pending = self._pending, None
        if p is None or p.base != base:
            return
        for i, chain in enumerate(p.chains):
            if not chain:
                continue
            kept, judged = score_chain(chain, truth)
            self.weights.record(i, kept, judged)
            self.voters[i].accept(kept)

    def report(self) -> tuple[DrafterStanding, ...]:
        """Each voter's weight, acceptance this conversation, and whether it was voted."""
        w = self.weights
        return tuple(
            DrafterStanding(label, w.weights[i], w.acceptance(i), i == self._voted)
            for i, label in enumerate(self.labels)
        )

    def take_times(self) -> tuple[float, float, float]:
        """Worker drafts collected since the last call: (busy, overlapped with a
        verification, waited for by the verifier) ms. They are booked in the round that
        collects them, so per-round figures lag a round; their sums are exact."""
        out, self._unreported = self._unreported, (0.0, 0.0, 0.0)
        return out

    @property
    def pool_hits(self) -> int:
        return self._hits

    # -- the pool
    def _start_ahead(self, req: DraftRequest, path: list[int]) -> None:
        """Draft the next round for the ahead voters on the worker, assuming ``path`` is kept.

        The length is fixed here (this round's + the guessed bonus token), so what the worker
        draws from a voter's generator never depends on how long the target takes.
        """
        base = len(req.context)
        assumed = [*req.context, *path]  # a copy: the session appends to the live history
        n = req.max_tokens + 1
        if self.n_ctx is not None:
            n = min(n, self.n_ctx - 1 - len(assumed))
            if n <= 0:
                return  # the conversation is about to fill the context: draft in place
        ahead_req = DraftRequest(assumed, n, req.min_accept_p, req.sampling)
        last = int(req.context[-1]) if base else -1

        def run() -> tuple[float, float]:
            t0 = time.perf_counter()
            for i in self.ahead:
                d = self.voters[i].draft(ahead_req)
                self._pool[i] = _Ahead(base, last, [*path, *d.tokens], len(path), d.q)
            return t0, time.perf_counter()

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="minions-ahead")
        self._job = self._worker.submit(run)

    def _join(self) -> None:
        """Wait for the worker's draft (the verifier never reads a voter the worker uses)."""
        job, self._job = self._job, None
        if job is None:
            return
        t_wait = time.perf_counter()
        t0, t1 = job.result()
        wait = max(0.0, t1 - t_wait) * 1e3
        busy = (t1 - t0) * 1e3
        end = self._verify_to if self._verify_to >= self._verify_from else t1
        overlap = max(0.0, min(t1, end) - max(t0, self._verify_from)) * 1e3
        self.ahead_ms += busy
        self.overlap_ms += overlap
        a, o, w = self._unreported
        self._unreported = (a + busy, o + overlap, w + wait)

    def _from_pool(
        self, i: int, context: Sequence[int], k: int
    ) -> tuple[list[int], list[Candidates] | None] | None:
        """Voter ``i``'s drafted-ahead chain if the conversation grew as it assumed."""
        e = self._pool.pop(i, None)
        if e is None or len(context) <= e.base or (e.base and context[e.base - 1] != e.last):
            return None
        grown = len(context) - e.base  # accepted drafts + the target's own token
        if grown <= e.n_path or grown >= len(e.seq) or list(context[e.base :]) != e.seq[:grown]:
            return None  # rejected inside the path, a different bonus token, or nothing left
        start = grown - e.n_path  # into the voter's own tokens (its q rows)
        q = e.q[start : start + k] if e.q is not None else None
        return e.seq[grown : grown + k], q


class Minions(Speculative):
    name = "minions"
    accepts_draft = True
    description = "several drafters vote on a token tree; a draft model (--draft) drafts ahead"
    options = {
        **LENGTH_OPTIONS,
        "ngram_max": "the longest N-gram of ANPD's tables (the first N-gram voter)",
        "ngram_short": "the N of the second N-gram voter",
        "ahead": "a draft model drafts the next round while the target verifies "
        "(default: when there are cores for both)",
    }

    def __init__(
        self, vote: MajorityVote, length: LengthConfig, *, adaptive: bool = True, **kw: object
    ) -> None:
        super().__init__(vote, length, adaptive=adaptive, **kw)  # type: ignore[arg-type]
        self.vote = vote

    def run(self, g: Generation) -> Iterator[Round]:
        rounds = super().run(g)
        try:
            for rnd in rounds:
                if rnd.drafted:
                    self.vote.settle(len(g.history), rnd.tokens)  # history: not yet extended
                # busy drafting: in place (less the wait for the worker) plus the worker's
                # draft collected this round; overlap: the worker's time under a verification
                ahead_ms, overlap_ms, wait_ms = self.vote.take_times()
                base = {f.name: getattr(rnd, f.name) for f in fields(rnd)}
                base["draft_ms"] = max(0.0, rnd.draft_ms - wait_ms) + ahead_ms
                base["overlap_ms"] = rnd.overlap_ms + overlap_ms
                base["drafters"] = self.vote.report() if rnd.drafted else ()
                yield MinionsRound(
                    **base,
                    ahead_ms=ahead_ms,
                    pool_hits=self.vote.pool_hits if rnd.drafted else 0,
                )
        finally:
            rounds.close()

    @classmethod
    def build(cls, target_model: Model, spec: EngineSpec) -> Strategy:
        from ...core.load_watch import default_threads
        from ..drafters.draft_model import DraftModelDrafter
        from ..drafters.lookup import LookupDrafter
        from ..drafters.ngram import NgramDrafter

        cls.check_options(spec.strategy_options)
        n_max = int_option(spec, "ngram_max", 5, 2, 16)  # ANPD's N
        n_short = int_option(spec, "ngram_short", 3, 2, 16)
        if n_short == n_max:
            raise PotluckError(
                f"strategy options ngram_short and ngram_max are both {n_max}: the second "
                "N-gram voter would only repeat the first; pick two different values"
            )
        # a draft model: sd's defaults (short first drafts); without: anpd's
        s_max = int_option(spec, "max_draft", 12 if spec.draft else 7, 1, MAX_EXACT_BATCH - 1)
        s_init = int_option(spec, "initial_draft", min(4, s_max) if spec.draft else s_max, 0, s_max)
        adaptive = bool_option(spec, "adaptive", True)
        # drafting ahead runs the draft model beside the target: by default only where the
        # cores allow both at once (on a shared core llama.cpp's spinning threads stall)
        n_threads = spec.n_threads or default_threads()
        ahead = bool_option(spec, "ahead", default_threads() >= 2 * n_threads)
        voters: list[tuple[str, Drafter, float]] = []
        if spec.draft is not None:
            draft_model = load_draft_model(target_model, spec)
            try:
                drafter = DraftModelDrafter(draft_model, n_ctx=spec.n_ctx, n_threads=n_threads,
                                             follow_load=spec.n_threads == 0)
            except BaseException:
                draft_model.close()
                raise
            # a model reads the whole conversation, a table only its last few tokens: until
            # acceptance says otherwise the model outweighs the two tables agreeing
            voters.append(("draft-model", drafter, 2.0))
        voters += [
            ("lookup", LookupDrafter(), 1.0),
            (f"ngram{n_max}", NgramDrafter(n_max), 1.0),
            (f"ngram{n_short}", NgramDrafter(n_short), 1.0),
        ]
        vote = MajorityVote(voters, ahead=[0] if spec.draft is not None and ahead else [], n_ctx=spec.n_ctx)
        length = LengthConfig(s_init=s_init, s_max=s_max)
        return cls(vote, length, adaptive=adaptive, costs=saved_costs(target_model, spec))

