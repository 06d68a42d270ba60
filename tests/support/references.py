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

Test processes side by side (pytest -n) share them through files in ``POTLUCK_TEST_REFS``
(a folder the conftest makes for the run): a reply one process decoded, the other reads, and
while one decodes a conversation the other waits for it (a lock per conversation) instead of
decoding it too.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

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


def _shared(key: _Key, suffix: str = ".json") -> Path | None:
    """The file of ``key`` in the run's shared folder (None: no folder, one process). The model
    is named by its path, size and time, so a rebuilt fixture is never read as the old."""
    folder = os.environ.get("POTLUCK_TEST_REFS")
    if not folder:
        return None
    st = os.stat(key.model)
    text = json.dumps([asdict(key), st.st_size, st.st_mtime_ns])
    return Path(folder) / (hashlib.sha256(text.encode()).hexdigest()[:32] + suffix)


def _lookup(key: _Key) -> _Reply | None:
    got = _REPLIES.get(key)
    path = _shared(key)
    if path is not None and path.exists():
        tokens, ended = json.loads(path.read_text())
        if got is None or len(tokens) > len(got.tokens):
            got = _REPLIES[key] = _Reply(tuple(tokens), ended)
    return got


def _keep(key: _Key, reply: _Reply) -> None:
    old = _lookup(key)
    if old is not None and len(old.tokens) >= len(reply.tokens):
        return
    _REPLIES[key] = reply
    path = _shared(key)
    if path is not None:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps([list(reply.tokens), reply.ended]))
        tmp.replace(path)  # whole or not at all, for a reader in the other process


@contextmanager
def _decoding(key: _Key) -> Iterator[None]:
    """Held while this process decodes the conversation ending at ``key``: the other waits."""
    path = _shared(key, ".lock")
    if path is None:
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _enough(got: _Reply | None, max_tokens: int) -> bool:
    return got is not None and (len(got.tokens) >= max_tokens or got.ended)


def _known(key: _Key, max_tokens: int) -> list[int] | None:
    got = _REPLIES.get(key)
    if not _enough(got, max_tokens):  # this process has not decoded enough of it: the other may have
        got = _lookup(key)
    return list(got.tokens[:max_tokens]) if got is not None and _enough(got, max_tokens) else None


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
    with _decoding(keys[-1]):
        known = [_known(k, n) for k, n in zip(keys, limits)]  # the other process's, while we waited
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
                _keep(key, _Reply(tuple(fin.tokens), fin.reason == "stop"))
            return out
        finally:
            session.close()


def plain_reply(
    model: Model, prompt: str, max_tokens: int, *, n_ctx: int = 2048, system: str | None = None
) -> list[int]:
    """Plain decoding's greedy reply to ``prompt`` alone."""
    return plain_conversation(model, [prompt], max_tokens, n_ctx=n_ctx, system=system)[0]
