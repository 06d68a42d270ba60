"""A conversation with a model: keeps the KV cache between turns and streams events.

``Session.generate`` renders the conversation with the model's chat template, processes
only the tokens the KV cache does not hold yet, runs the chosen strategy and yields
:mod:`.events`, each tagged with the reply's run id. Consumers keep their own counters from
those events; the session exposes no mutable statistics. No algorithm and no ctypes here.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from . import validate as limits
from .chat import ChatFormat, Message, TextStream
from .errors import ContextFullError, PotluckError
from .events import ClusterView, Event, Finished, ReplyStarted, RoundStats, TokenLogprob, TokenText
from .grammar import GrammarSpec, ReplyGrammar
from .grammar import check as check_grammar
from .prompt import Prompt, PromptTokenizer
from .prompt_cache import KeptConversation, PromptCache
from .reasoning import opens_thinking
from .runtime import Model
from .sampling import GREEDY, Sampler, SamplingParams
from .sampling import logprobs as sampling_logprobs
from .sampling import warm_up as warm_up_sampler
from .strategy import Generation, Strategy
from .target import Target
from .tools import Tool, renders_tools
from .tools import conversation as tool_conversation

log = logging.getLogger(__name__)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Session:
    """One conversation over one target; not thread-safe except :meth:`cancel`."""

    def __init__(
        self,
        model: Model,
        target: Target,
        strategy: Strategy,
        *,
        system: str | None = None,
    ) -> None:
        self.model = model
        # Several conversations' KV kept beside the one in the context (use_prompt_cache);
        # None: only the conversation in the context is reused.
        self.prompt_cache: PromptCache | None = None
        self.target = target
        self.strategy = strategy
        bos = model.detokenize([model.bos], special=True) if model.bos >= 0 else ""
        eos = model.detokenize([model.eos], special=True) if model.eos >= 0 else ""
        self.format = ChatFormat(model.chat_template, bos_token=bos, eos_token=eos)
        self.prompts = PromptTokenizer(model, self.format)
        self.messages: list[Message] = []
        if system:
            self.messages.append(Message("system", system))
        self._cancel = threading.Event()
        self._end_choice = False  # the caller found the reply's end (a stop string): see end_choice
        self._reply_ids = itertools.count(1)
        self.run_id = 0  # the reply running now or last (events carry it)
        self._prefill_group: int | None = None  # the target job group of a prompt being processed
        self._tokens: list[int] = []  # conversation tokens: those in the KV cache + pending ones
        self._covered = ""  # rendered text that self._tokens stand for
        warm_up_sampler()  # the sampler's kernel loads with the model, not in a reply's first token
        self._owner = ""  # whose conversation the context holds (Session.answer's owner)

    # -- conversation editing
    @property
    def system(self) -> str | None:
        return self.messages[0].content if self.messages and self.messages[0].role == "system" else None

    def set_system(self, text: str | None) -> None:
        if self.system is not None:
            self.messages.pop(0)
        if text:
            self.messages.insert(0, Message("system", text))

    def load_messages(self, messages: Sequence[Message], *, fresh: bool = False) -> None:
        """Replace the conversation (e.g. reopened from history); the KV cache is reused where it
        matches. ``fresh``: the next prompt is computed whole, as a new session computes it (the
        app sends a conversation cut to fit the context so: its reply is a fresh session's)."""
        self.messages = list(messages)
        if fresh:
            self._tokens, self._covered = [], ""

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """The tokens ``messages`` take as a prompt, the chat template and the reply's opening
        included: what a caller fits into :attr:`n_ctx` before it sends."""
        try:
            return len(self.prompt_for(messages).tokens())
        except ContextFullError:  # its bytes alone prove it cannot fit: more than the context
            return self.target.n_ctx + 1

    def use_prompt_cache(self, cache: PromptCache) -> None:
        """Keep recent conversations' KV in ``cache`` (an HTTP server's clients take turns),
        within what the target's stages can hold (a cluster's workers)."""
        budget = self.target.kept_kv_budget()
        if budget is not None:
            cache.limit(budget)
        self.prompt_cache = cache

    def cluster_view(self) -> ClusterView | None:
        """The chain's stages, layers and traffic in cluster mode (None on one machine)."""
        return self.target.cluster_view()

    def cancel(self, run_id: int | None = None) -> None:
        """Stop reply ``run_id`` (None: the running one) after the current step, or mid-batch
        while its prompt is processed; safe from any thread. A finished reply is left alone."""
        if run_id is not None and run_id != self.run_id:
            return
        self._cancel.set()
        prefill = self._prefill_group
        if prefill is not None:
            self.target.cancel(prefill)

    def end_choice(self) -> None:
        """End the reply being streamed after its current round, as a stop would: for a caller
        that found its end in the text (a stop string). With ``n`` choices the next one begins;
        :meth:`cancel` would end them all. Call it from the thread that reads the events."""
        self._end_choice = True

    def held_text(self, owner: str = "") -> str:
        """The rendered conversation whose tokens the context holds, if ``owner``'s ("" after a
        cancelled prompt, or another owner's): a server gives a request to the lane whose held
        text it continues furthest, and never for another API key's conversation."""
        return self._covered if self._owner == owner else ""

    def prompt_progress(self) -> tuple[int, int]:
        """(tokens of the prompt read, tokens to read) while a reply's prompt is processed;
        safe from any thread (the app's status line polls it). (0, 0) otherwise."""
        progress = getattr(self.target, "decode_progress", (0, 0))  # a target of its own may not count
        return progress if self._prefill_group is not None else (0, 0)

    @property
    def conversation_tokens(self) -> int:
        return len(self._tokens)

    # -- prompts: thread-safe (the server tokenizes a request off the engine thread)
    def prompt_for(self, messages: Sequence[Message], *, variables: Mapping[str, object] | None = None,
                   tools: Sequence[Tool] = ()) -> Prompt:
        """``messages`` rendered and tokenized; special tokens come only from the chat template.
        ``tools``: functions the model may call, rendered by the template or, for one that knows
        none, described in the system message (:mod:`.tools`). Refuses (ContextFullError) a
        conversation whose bytes alone cannot fit the context."""
        if tools or any(m.tool_calls or m.role == "tool" for m in messages):
            messages = tool_conversation(messages, tools, self.format.source)
        definitions = [t.openai() for t in tools] if tools and renders_tools(self.format.source) else None
        return self.prompts.conversation(messages, self.target.n_ctx, variables=variables, tools=definitions)

    def raw_prompt(self, text: str) -> Prompt:
        """Raw text without the chat template (OpenAI's completions API)."""
        return self.prompts.raw(limits.text("the prompt", text), self.target.n_ctx)

    # -- generation
    def generate(
        self,
        user: str | None,
        sampling: SamplingParams = GREEDY,
        max_tokens: int = 512,
    ) -> Iterator[Event]:
        """Add ``user`` (None: answer the conversation as it stands) and stream the reply."""
        limits.max_tokens(max_tokens)
        sampling = limits.sampling(sampling)  # any integer seed, mapped onto numpy's range
        messages = self.messages
        if user is not None:
            messages = [*messages, Message("user", limits.text("the prompt", user))]
        yield from self.answer(self.prompt_for(messages), sampling, max_tokens)

    def complete(self, prompt: str, sampling: SamplingParams = GREEDY, max_tokens: int = 512) -> Iterator[Event]:
        """Continue ``prompt`` as raw text, without the chat template (OpenAI's completions API):
        the session then holds no messages, only the text and its KV cache."""
        limits.max_tokens(max_tokens)
        sampling = limits.sampling(sampling)
        yield from self.answer(self.raw_prompt(prompt), sampling, max_tokens)

    def answer(self, prompt: Prompt, sampling: SamplingParams = GREEDY, max_tokens: int = 512, *,
               owner: str = "", grammar: GrammarSpec | None = None, logprobs: int | None = None,
               n: int = 1) -> Iterator[Event]:
        """Stream the reply to ``prompt`` (from :meth:`prompt_for` or :meth:`raw_prompt`); the
        session then holds its messages. KV kept for one ``owner`` (an API key) is never reused
        for another's prompt.

        ``grammar``: every reply follows it (structured output, forced tool calls; see
        :mod:`.sampling` for the distribution). ``logprobs``: each token's log-probability
        under the target and that many likeliest tokens' (None: none). ``n``: that many replies
        (``choice`` 0..n-1 in the events), each from the prompt's cache: the prompt is processed
        once and every reply starts from its logits; the session keeps the last one."""
        limits.max_tokens(max_tokens)
        sampling = limits.sampling(sampling)
        limits.choices(n)
        if logprobs is not None:
            limits.top_logprobs(logprobs)
        if grammar is not None:
            check_grammar(self.model, grammar, "the grammar")
        self._continue_closest_kept(prompt, owner)
        tokens = self._tokens_for(prompt, owner)
        limits.prompt_fits(len(tokens), self.target.n_ctx)
        self.messages = list(prompt.messages) if prompt.messages is not None else []
        yield from self._run(tokens, prompt.text, sampling, max_tokens, owner,
                             _Shape(grammar, logprobs, n))

    def regenerate(
        self, sampling: SamplingParams = GREEDY, max_tokens: int = 512
    ) -> Iterator[Event]:
        """Drop the last assistant reply and answer again."""
        if self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        return self.generate(None, sampling, max_tokens)

    def _tokens_for(self, prompt: Prompt, owner: str) -> list[int]:
        """The tokens of ``prompt``: those of the conversation in the context where it goes on from it."""
        # (no covered text: the tokens end mid-prompt, after a cancelled prompt, so retokenize)
        if self._owner == owner and self._tokens and self._covered and prompt.text.startswith(self._covered):
            return self._tokens + prompt.tokens_after(len(self._covered))
        return prompt.tokens()

    def _continue_closest_kept(self, prompt: Prompt, owner: str) -> None:
        """With a prompt cache: keep the conversation in the context if ``prompt`` leaves part of
        it, and bring back one of ``owner``'s kept ones that shares more tokens with it (see
        :mod:`.prompt_cache`)."""
        cache = self.prompt_cache
        if cache is None:
            return
        fresh: list[int] = []

        def shared(tokens: Sequence[int], covered: str, n_kv: int) -> int:
            # the tokens _tokens_for would give, had this conversation been in the context
            if tokens and covered and prompt.text.startswith(covered):
                return min(n_kv, len(tokens))  # they go on from all of its tokens
            fresh[:] = fresh or prompt.tokens()
            return common_prefix_len(tokens[:n_kv], fresh)

        # one session at a time from here: another lane's keep could drop the slot chosen
        # below before its load (the lanes of a server share the cache)
        with cache.choosing:
            target = self.target
            n_kv = target.n_past
            in_context = shared(self._tokens, self._covered, n_kv) if self._owner == owner else 0
            kv_bytes = limits.kv_bytes(self.model, n_kv) if in_context < n_kv else None
            if kv_bytes is not None and cache.fits(kv_bytes):  # it leaves part of the one in the context
                slot = cache.new_slot()
                if target.keep_kv(slot):
                    kept_now = KeptConversation(tuple(self._tokens), self._covered, n_kv, slot, kv_bytes, self._owner)
                    for gone in cache.keep(kept_now):
                        target.drop_kv(gone.slot)
            kept, n = cache.closest(lambda c: shared(c.tokens, c.covered, c.n_kv), owner)
            # a recurrent state comes back at its end only: a shorter shared part would be read again
            usable = kept is not None and (not target.recurrent or n == kept.n_kv)
            if kept is not None and usable and n > in_context:
                if target.restore_kv(kept.slot, kept.n_kv):
                    cache.restored(kept)
                    self._tokens, self._covered, self._owner = list(kept.tokens), kept.covered, owner
                else:  # its cells are gone (a rebuilt chain, a slot the stage lost): a miss
                    cache.discard(kept)

    def _run(
        self, tokens: list[int], rendered: str, sampling: SamplingParams, max_tokens: int, owner: str,
        shape: _Shape | None = None,
    ) -> Iterator[Event]:
        shape = shape or _Shape()
        target = self.target
        self._cancel.clear()
        run_id = self.run_id = next(self._reply_ids)
        target.regroup()  # between replies: a cluster may take in workers that joined
        t_start = time.perf_counter()
        # another owner's conversation in the context: none of it is reused (nor shown as cached)
        reused = common_prefix_len(self._tokens[: target.n_past], tokens) if self._owner == owner else 0
        reused = min(reused, len(tokens) - 1)  # always process at least one token for fresh logits
        target.truncate(reused)
        reused = target.n_past  # a recurrent state may be cut back further (Target.truncate)
        # From here on the KV cache holds tokens[:n_past]; keep self._tokens in step with it.
        self._tokens = tokens[:reused]
        self._covered = ""
        self._owner = owner
        shown = self.strategy.pick_for_reply(len(tokens), sampling)  # the strategy name the events carry
        yield ReplyStarted(run_id, shown, len(tokens), len(tokens) - reused, target.n_ctx, opens_thinking(rendered))
        yield from target.node_status(run_id)
        # Esc during a long prompt reaches the running batch through the target's cancel.
        self._prefill_group = target.new_group()
        try:
            if self._cancel.is_set():
                raise InterruptedError("cancelled before the prompt was processed")
            first_logits = target.decode(tokens[reused:], group=self._prefill_group)[-1].copy()
        except InterruptedError:
            target.truncate(reused)
            self.messages.append(Message("assistant", ""))
            yield Finished(
                run_id=run_id, reason="cancelled", text="", tokens=(), prompt_tokens=len(tokens),
                prefill_tokens=0, ttft_s=0.0, prefill_s=time.perf_counter() - t_start, decode_s=0.0,
                tokens_per_s=0.0, prefill_tokens_per_s=0.0, strategy=shown, n_past=target.n_past,
            )
            return
        except BaseException:
            target.truncate(reused)
            raise
        finally:
            self._prefill_group = None
        yield from target.notices(run_id)  # a worker lost and replaced during the prompt
        root = np.random.SeedSequence(sampling.seed)
        for choice in range(shape.n):
            if choice:
                if self._cancel.is_set():
                    return
                target.truncate(len(tokens))  # the next reply starts from the prompt's cells
                self.messages.pop()  # the session keeps the last reply only
                t_start = time.perf_counter()
            # choice 0 draws as a lone request does; the others from seeds of their own
            seeds = root if choice == 0 else np.random.SeedSequence(root.entropy, spawn_key=(_CHOICE_KEY, choice))
            yield from self._reply(tokens, rendered, sampling, max_tokens, shape, seeds, first_logits,
                                   run_id, shown, reused if choice == 0 else len(tokens), t_start, choice)

    def _reply(
        self, tokens: list[int], rendered: str, sampling: SamplingParams, max_tokens: int, shape: _Shape,
        seeds: np.random.SeedSequence, first_logits: np.ndarray, run_id: int, shown: str, reused: int,
        t_start: float, choice: int,
    ) -> Iterator[Event]:
        """One reply after the prompt, whose cells the target holds and whose last logits are
        ``first_logits``."""
        target = self.target
        self._tokens = list(tokens)
        self._covered = rendered
        grammar = ReplyGrammar.open(self.model, shape.grammar, self._tokens) if shape.grammar else None
        g = Generation(
            run_id=run_id,
            target=target,
            sampler=Sampler(sampling, np.random.default_rng(seeds), grammar),
            seeds=seeds,
            history=self._tokens,  # shared list: rounds append to it
            first_logits=first_logits,
            max_new=max_tokens,
            is_eog=self.model.is_eog,
            cancel=self._cancel,
        )
        self._end_choice = False
        self.strategy.prepare(g)  # counts as prompt processing (Strategy.prepare)
        t_prefill = time.perf_counter()

        out: list[int] = []
        stream = TextStream()
        text_parts: list[str] = []
        reason = "length"
        drafted = accepted = rounds = 0
        first_token_at = 0.0
        drafter_prompt_s = 0.0  # a drafter's prompt processing after the first token (Round.prompt_ms)
        rounds_of = self.strategy.run(g)
        try:
            for rnd in rounds_of:
                kept: list[int] = []
                for tok in rnd.tokens:
                    if g.n_new >= g.max_new:
                        break
                    kept.append(tok)
                    g.n_new += 1
                    if self.model.is_eog(tok):
                        reason = "stop"
                        break
                g.history.extend(kept)
                out.extend(kept)
                rounds += 1
                drafted += rnd.drafted
                accepted += rnd.accepted
                drafter_prompt_s += rnd.prompt_ms / 1e3
                first_token_at = first_token_at or time.perf_counter()
                yield from target.notices(run_id)
                yield RoundStats(
                    run_id=run_id,
                    drafted=rnd.drafted,
                    accepted=rnd.accepted,
                    emitted=len(kept),
                    draft_len=rnd.draft_len,
                    draft_ms=rnd.draft_ms,
                    verify_ms=rnd.verify_ms,
                    n_past=target.n_past,
                    overlap_ms=rnd.overlap_ms,
                    drafters=rnd.drafters,
                )
                visible = [t for t in kept if not self.model.is_eog(t)]
                delta = stream.feed(self.model.token_bytes(t) for t in visible)
                if delta or kept:
                    text_parts.append(delta)
                    probs = _logprobs(rnd.rows, kept, shape.logprobs)
                    yield TokenText(run_id, delta, tuple(kept), probs, choice)
                if reason == "stop" or g.n_new >= g.max_new:
                    g.done = True
                elif self._cancel.is_set():
                    reason, g.done = "cancelled", True
                elif self._end_choice:
                    reason, g.done = "stop", True
                elif g.remaining <= 0:
                    reason, g.done = "context_full", True
                if g.done:
                    break
        finally:
            g.done = True
            rounds_of.close()  # the strategy drops what it sent ahead (Plain) before the trim below
            if grammar is not None:
                grammar.close()
            # Whatever happened, the KV cache must hold a prefix of the conversation's tokens.
            if target.n_past > len(self._tokens):
                target.truncate(len(self._tokens))
            tail = stream.flush()
            if tail:
                text_parts.append(tail)
            reply = "".join(text_parts)
            self.messages.append(Message("assistant", reply))
            self._covered = rendered + self.model.detokenize(out, special=True)
        t_end = time.perf_counter()
        ttft = (first_token_at or t_end) - t_start
        # prompt processing is both models' (the target's before the first token, a drafter's
        # after it), decoding the rest; the first token's time is what it was
        decode_s = t_end - t_prefill - drafter_prompt_s
        prefill_s = t_prefill - t_start + drafter_prompt_s
        yield from target.notices(run_id)
        yield from target.node_status(run_id)
        yield Finished(
            run_id=run_id,
            reason=reason,
            text=reply,
            tokens=tuple(out),
            prompt_tokens=len(tokens),
            prefill_tokens=len(tokens) - reused,
            ttft_s=ttft,
            prefill_s=prefill_s,
            decode_s=decode_s,
            tokens_per_s=len(out) / decode_s if decode_s > 0 else 0.0,
            prefill_tokens_per_s=(len(tokens) - reused) / prefill_s if prefill_s > 0 else 0.0,
            drafted=drafted,
            accepted=accepted,
            rounds=rounds,
            strategy=shown,
            n_past=target.n_past,
            choice=choice,
        )

    def close(self) -> None:
        self.strategy.close()
        self.target.close()


# a choice's seed: the request's seed with this key and the choice's index (spawn keys of the
# request's own seed, its drafters', are single numbers)
_CHOICE_KEY = 0x6E


@dataclass(frozen=True)
class _Shape:
    """What a request asks of its replies besides sampling (Session.answer)."""

    grammar: GrammarSpec | None = None
    logprobs: int | None = None
    n: int = 1


def _logprobs(rows: Sequence[np.ndarray], kept: Sequence[int], n_top: int | None) -> tuple[TokenLogprob, ...]:
    """Each kept token's log-probability at the target row it was decided at (none unless asked)."""
    if n_top is None:
        return ()
    if len(rows) < len(kept):
        raise PotluckError("this strategy does not report the target's rows, so it cannot give logprobs")
    out = []
    for row, token in zip(rows, kept):
        lp, top = sampling_logprobs(row, token, n_top)
        out.append(TokenLogprob(token, lp, tuple(top)))
    return tuple(out)
