"""The engine's prompt cache under the server: kept conversations stay within their byte budget,
come back exactly, and a prompt cancelled mid-batch leaves a session that answers correctly."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from potluck.engine import Finished, Message, Model, PromptCache, ReplyStarted, SamplingParams, Session
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams
from potluck.engine.core.target import LocalTarget


def session(model: Model) -> Session:
    return Session(model, LocalTarget(model, ContextParams(n_ctx=1024)), Plain())


def reply(s: Session, text: str | None, n: int = 12) -> Finished:
    return [e for e in s.generate(text, SamplingParams(), n) if isinstance(e, Finished)][-1]


def test_kept_conversations_stay_within_the_budget_and_come_back_exactly(model: Model) -> None:
    s = session(model)
    ref = session(model)
    try:
        want = reply(ref, "Name a colour.").text
        first = reply(s, "Name a colour.")
        per_conversation = first.n_past * 30_000  # ~23 kB a token for the bundled model, with room
        cache = PromptCache(max_bytes=2 * per_conversation, max_conversations=8)
        s.use_prompt_cache(cache)
        history = [Message("user", "Name a colour."), Message("assistant", first.text)]
        for i in range(4):  # four other conversations push the first one out
            s.load_messages([Message("user", f"Count to {i + 3}.")])
            reply(s, None)
        stats = cache.stats()
        assert stats.evicted > 0 and stats.bytes_used <= cache.max_bytes and stats.conversations <= 2
        # the stage keeps exactly the slots the cache holds: evicted ones were dropped there
        assert sorted(s.target.stage.kept) == sorted(cache.slots())
        s.load_messages(history[:1])
        assert reply(s, None).text == want  # evicted: a fresh prompt, the same answer
        s.load_messages([Message("user", "Count to 6.")])  # the newest kept conversation: restored
        restored = cache.stats().restored
        again = reply(s, None)
        assert cache.stats().restored == restored + 1 and again.prefill_tokens == 1
    finally:
        s.close()
        ref.close()


def test_a_kept_slot_gone_before_its_load_is_a_miss_not_another_conversations_cells(
    model: Model, caplog: pytest.LogCaptureFixture
) -> None:
    """A server's lanes share the cache: another lane's keep may replace the slot a session
    chose. The load then fails on the stage, and the session must see a miss and read its
    prompt afresh, not decode on whatever cells its sequence held. A miss is no error: the
    log says none."""
    s = session(model)
    ref = session(model)
    try:
        want = reply(ref, "Name a colour.").text
        cache = PromptCache(max_bytes=10**9, max_conversations=8)
        s.use_prompt_cache(cache)
        reply(s, "Name a colour.")
        s.load_messages([Message("user", "Count to 3.")])
        reply(s, None)
        (slot,) = cache.slots()
        s.target.drop_kv(slot)  # gone on the stage, still listed in the cache
        # what made it possible on a server is shut out: the keep and the load run under the
        # cache's lock, so no other lane's keep comes between a choice and its load
        held: list[str] = []
        for name in ("keep_kv", "restore_kv"):
            real = getattr(s.target, name)

            def watched(*args: object, _real: Any = real, _name: str = name) -> Any:
                held.append(_name if cache.choosing.locked() else f"{_name} unlocked")
                return _real(*args)

            setattr(s.target, name, watched)
        s.load_messages([Message("user", "Name a colour.")])
        again = reply(s, None)
        stats = cache.stats()
        assert stats.lost == 1 and stats.restored == 0 and again.prefill_tokens > 1
        assert held == ["keep_kv", "restore_kv"]
        assert again.text == want
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        s.close()
        ref.close()


def test_a_prompt_cancelled_mid_batch_then_answers_like_a_fresh_session(model: Model) -> None:
    s = session(model)
    ref = session(model)
    try:
        reply(s, "Hi!")
        events = s.generate("Tell me a story about " + "a very long road, " * 40, SamplingParams(), 8)
        for e in events:
            if isinstance(e, ReplyStarted):
                s.cancel()
        assert s.messages[-1] == Message("assistant", "")  # the cancelled turn: nothing decoded
        s.messages.pop()
        ref.load_messages(list(s.messages[:-1]))
        want = reply(ref, s.messages[-1].content).text
        s.messages.pop()
        got = reply(s, ref.messages[-2].content).text
        assert got == want
    finally:
        s.close()
        ref.close()


def test_a_stage_keeps_slots_puts_them_back_exactly_and_refuses_what_it_cannot(model: Model) -> None:
    """The stage's side of kept conversations (KvOp save/load/drop), which a cluster's workers
    run as well: a restored slot continues bit-identically to never having left; a slot never
    saved is refused by the load itself; past MAX_KEPT slots a save is refused, not grown."""
    from potluck.engine.core.errors import PotluckError
    from potluck.engine.core.kv import KvOp
    from potluck.engine.core.stage import MAX_KEPT

    params = ContextParams(n_ctx=256, n_threads=1)
    a, b = model.tokenize("The capital of France is"), model.tokenize("Count to five: one, two,")
    t, ref = LocalTarget(model, params), LocalTarget(model, params)
    try:
        ref.decode(a)
        want = ref.decode([11])
        t.decode(a)
        assert t.keep_kv(1)
        t.truncate(0)
        t.decode(b)  # another conversation takes the cells
        t.truncate(0)
        assert t.restore_kv(1, len(a)) and t.n_past == len(a)
        assert np.array_equal(t.decode([11]), want)
        with pytest.raises(PotluckError, match="no kept conversation in slot 7"):
            t.runner.submit(KvOp.load(7)).result()
        for slot in range(2, MAX_KEPT + 1):
            assert t.keep_kv(slot)
        assert len(t.stage.kept) == MAX_KEPT and not t.keep_kv(MAX_KEPT + 1)  # refused: one more slot
        t.drop_kv(1)
        t.runner.submit(lambda stage: None).result()  # the drop ran
        assert 1 not in t.stage.kept and len(t.stage.kept) == MAX_KEPT - 1
    finally:
        t.close()
        ref.close()
