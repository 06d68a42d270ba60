"""Plain decoding's greedy replies, computed once per test run for every module that proves
a strategy lossless against them.

A reply is keyed by everything that can change its tokens: the model file, the prompt (or
the conversation so far), the system prompt and the context size. Not the thread count: with
the BF16 cache every thread count computes the same logits (docs/facts.md §3, checked by
tests/test_engine_exact.py), so references are computed on one thread, the cheapest on a
busy machine, and serve modules that test strategies on two. Greedy
decoding is step by step, so the first N tokens of a longer reply are the reply to the same
prompt with a limit of N: a module asking for fewer tokens than another gets a prefix, and
one asking for more extends nothing (it decodes anew and keeps the longer reply).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from potluck.engine.core.events import Finished
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.target import LocalTarget


@dataclass(frozen=True)
class _Key:
    model: str
    turns: tuple[str, ...]  # the conversation up to and including this prompt
    limits: tuple[int, ...]  # the token limits of the turns before it
    system: str | None
    n_ctx: int


@dataclass(frozen=True)
class _Reply:
    tokens: tuple[int, ...]
    ended: bool  # it stopped on its own before the limit: longer limits give the same


_REPLIES: dict[_Key, _Reply] = {}


def _known(key: _Key, max_tokens: int) -> list[int] | None:
    got = _REPLIES.get(key)
    if got is None or (len(got.tokens) < max_tokens and not got.ended):
        return None
    return list(got.tokens[:max_tokens])


def plain_conversation(
    model: Model,
    turns: Sequence[str],
    max_tokens: int | Sequence[int],
    *,
    n_ctx: int = 2048,
    system: str | None = None,
) -> list[list[int]]:
    """Plain decoding's greedy reply to each turn of one conversation (``max_tokens`` per turn,
    or one limit per turn). A single turn is a single prompt."""
    limits = [max_tokens] * len(turns) if isinstance(max_tokens, int) else list(max_tokens)
    keys = [
        _Key(str(model.path), tuple(turns[: i + 1]), tuple(limits[:i]), system, n_ctx)
        for i in range(len(turns))
    ]
    known = [_known(k, n) for k, n in zip(keys, limits)]
    if all(r is not None for r in known):
        return known  # type: ignore[return-value]
    target = LocalTarget(model, ContextParams(n_ctx=n_ctx, n_threads=1))
    session = Session(model, target, Plain(), system=system)
    try:
        out = []
        for key, turn, limit in zip(keys, turns, limits):
            *_, fin = session.generate(turn, SamplingParams(), limit)
            assert isinstance(fin, Finished)
            out.append(list(fin.tokens))
            old = _REPLIES.get(key)
            if old is None or len(fin.tokens) > len(old.tokens):
                _REPLIES[key] = _Reply(tuple(fin.tokens), fin.reason == "stop")
        return out
    finally:
        session.close()


def plain_reply(
    model: Model, prompt: str, max_tokens: int, *, n_ctx: int = 2048, system: str | None = None
) -> list[int]:
    """Plain decoding's greedy reply to ``prompt`` alone."""
    return plain_conversation(model, [prompt], max_tokens, n_ctx=n_ctx, system=system)[0]
