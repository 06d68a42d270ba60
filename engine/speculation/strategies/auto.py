"""``auto``: the chat's default, a lossless strategy picked per reply by what it can use.

The pick, made before each reply's prompt is processed (:meth:`Auto.pick_for_reply`):

- a draft model is loaded, the conversation is shorter than :data:`LONG_DOCUMENT_TOKENS`, and
  the measured batch-cost curve says a draft model can pay here at all (its drafting time and
  the rows it adds cost less than the plain steps a sure draft saves: a mixture of experts'
  verify batches read up to k x top-k experts, docs/facts.md §33): ``sd`` (the draft model
  drafts; each model gets every core in turn, which on a compute-bound CPU beats PEARL's split
  of the cores);
- otherwise ``anpd``: N-gram drafts from the conversation itself. On a long document they
  are what pays: the reply copies names and phrases from it, and on a CPU each verified row
  costs nearly a full step's attention deep in a context (docs/facts.md §13), so only
  near-certain drafts win. A draft model would also have to prefill the whole document
  first, delaying the first token.

TriForce is left out on a CPU: on an unseen 4,450-token document it decoded at 0.80-0.97x
plain and its retrieval cache delayed the first token (issue 22). Both picks run under the
same floor (:class:`~..adaptive.DraftGate`): a reply stays within a few percent of plain
decoding when drafts are bad, and output is plain decoding's (greedy) or its distribution
(sampled), as for every strategy.

Sampled replies have a floor across replies too (:class:`~..adaptive.SampledReplies`): at
temperature 0.8 drafts pass far less often than in greedy replies (docs/facts.md §34), so a
sampled reply whose drafts saved nothing is followed by plain ones (``auto: plain``, none of
speculation's overhead) before the pick is tried again; one whose drafts paid keeps it.
With ``adaptive=false`` every reply speculates, as the option promises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ...core.plain import Plain
from ...core.strategy import Generation, Round, Strategy
from ..adaptive import SampledReplies
from .kit import LENGTH_OPTIONS, bool_option
from .speculative import DraftModelSpeculative, NgramSpeculative, Speculative

if TYPE_CHECKING:
    from ...core.runtime import Model
    from ...core.sampling import SamplingParams
    from ...core.spec import EngineSpec

log = logging.getLogger(__name__)

# A conversation this long (tokens) is a long document: N-gram drafts, whatever is loaded.
LONG_DOCUMENT_TOKENS = 2048


class Auto(Strategy):
    name = "auto"
    accepts_draft = True  # with --draft: sd on short conversations
    needs_exact_batches = False  # decodes plainly, and says why, where no batch is exact
    shares_batches = True  # both picks do
    description = "picks per reply: sd with a draft on a chat, anpd otherwise; plain where sampled drafts don't pay"
    options = LENGTH_OPTIONS

    def __init__(
        self, ngram: Speculative | None, draft: Speculative | None, plain_reason: str = "", *, adaptive: bool = True
    ) -> None:
        self.ngram = ngram
        self.draft = draft
        self.plain_reason = plain_reason  # why every reply is plain decoding ("" : it is not)
        self.plain = Plain()
        self.adaptive = adaptive
        self.sampled = SampledReplies()
        self.current: Strategy = draft or ngram or self.plain
        self._sampled_reply = False  # the reply being run is sampled and speculates

    @classmethod
    def build(cls, target_model: Model, spec: EngineSpec) -> Strategy:
        cls.check_options(spec.strategy_options)  # the length options, passed to both picks
        exact = target_model.batch_exact
        if not exact.speculates:  # no verify batch is exact on these weights: plain decoding
            log.warning("auto decodes plainly: %s", exact.reason)
            return cls(None, None, f"no exact verify batch ({exact.reason})")
        ngram = NgramSpeculative.build(target_model, spec)
        draft = DraftModelSpeculative.build(target_model, spec) if spec.draft is not None else None
        assert isinstance(ngram, Speculative) and (draft is None or isinstance(draft, Speculative))
        return cls(ngram, draft, adaptive=bool_option(spec, "adaptive", True))

    def choose(self, n_tokens: int) -> Strategy:
        """The strategy for a reply to a conversation of ``n_tokens`` tokens."""
        if self.ngram is None:
            return self.plain
        if self.draft is not None and n_tokens < LONG_DOCUMENT_TOKENS and self.draft.sure_draft_pays():
            return self.draft
        return self.ngram

    def pick_for_reply(self, n_tokens: int, sampling: SamplingParams) -> str:
        sampled = not sampling.greedy and self.adaptive
        self.current = self.choose(n_tokens)
        if self.plain_reason:
            self._sampled_reply = False
            return f"{self.name}: plain, {self.plain_reason}"
        if sampled and not self.sampled.speculate():
            self.current = self.plain
        self._sampled_reply = sampled and self.current is not self.plain
        return f"{self.name}: {self.current.name}"

    def prepare(self, g: Generation) -> None:
        self.current.prepare(g)

    def run(self, g: Generation) -> Iterator[Round]:
        current = self.current
        if not self._sampled_reply:
            yield from current.run(g)
            return
        assert isinstance(current, Speculative)
        accepted = 0
        try:
            for rnd in current.run(g):
                accepted += rnd.accepted
                yield rnd
        finally:  # the reply ended, or was cut (length, cancel): what its drafts saved
            self.sampled.record(current.gate.reply_saved_ms, accepted)

    def reset(self) -> None:
        for s in (self.ngram, self.draft):
            if s is not None:
                s.reset()

    def close(self) -> None:
        for s in (self.ngram, self.draft):
            if s is not None:
                s.close()
