"""``auto``: the chat's default, a lossless strategy picked per reply by what it can use.

The pick, made before each reply's prompt is processed (:meth:`Auto.pick_for_reply`):

- a draft model is loaded, the conversation is shorter than :data:`LONG_DOCUMENT_TOKENS`, and
  the measured batch-cost curve says a draft model can pay here at all (its drafting time and
  the rows it adds cost less than the plain steps a sure draft saves: a mixture of experts'
  verify batches read up to k x top-k experts, docs/facts.md §32): ``sd`` (the draft model
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
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ...core.plain import Plain
from ...core.strategy import Generation, Round, Strategy
from .kit import LENGTH_OPTIONS
from .speculative import DraftModelSpeculative, NgramSpeculative, Speculative

if TYPE_CHECKING:
    from ...core.runtime import Model
    from ...core.spec import EngineSpec

log = logging.getLogger(__name__)

# A conversation this long (tokens) is a long document: N-gram drafts, whatever is loaded.
LONG_DOCUMENT_TOKENS = 2048


class Auto(Strategy):
    name = "auto"
    accepts_draft = True  # with --draft: sd on short conversations
    needs_exact_batches = False  # decodes plainly, and says why, where no batch is exact
    shares_batches = True  # both picks do
    description = "picks per reply: sd with a draft model on a chat, anpd otherwise (N-grams)"
    options = LENGTH_OPTIONS

    def __init__(self, ngram: Speculative | None, draft: Speculative | None, plain_reason: str = "") -> None:
        self.ngram = ngram
        self.draft = draft
        self.plain_reason = plain_reason  # why every reply is plain decoding ("" : it is not)
        self.current: Strategy = draft or ngram or Plain()

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
        return cls(ngram, draft)

    def choose(self, n_tokens: int) -> Strategy:
        """The strategy for a reply to a conversation of ``n_tokens`` tokens."""
        if self.ngram is None:
            return self.current
        if self.draft is not None and n_tokens < LONG_DOCUMENT_TOKENS and self.draft.sure_draft_pays():
            return self.draft
        return self.ngram

    def pick_for_reply(self, n_tokens: int) -> str:
        self.current = self.choose(n_tokens)
        if self.plain_reason:
            return f"{self.name}: plain, {self.plain_reason}"
        return f"{self.name}: {self.current.name}"

    def prepare(self, g: Generation) -> None:
        self.current.prepare(g)

    def run(self, g: Generation) -> Iterator[Round]:
        return self.current.run(g)

    def reset(self) -> None:
        for s in (self.ngram, self.draft):
            if s is not None:
                s.reset()

    def close(self) -> None:
        for s in (self.ngram, self.draft):
            if s is not None:
                s.close()
