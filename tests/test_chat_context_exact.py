"""A full context on the real model: the app leaves the oldest turns out, and the reply is
exactly what a fresh session gives for the messages actually sent (greedy)."""

from __future__ import annotations

from pathlib import Path

from potluck.app.config import ModelSettings, SamplingSettings, Settings, UISettings
from potluck.app.tui import build_app
from potluck.engine.core.chat import Message
from potluck.engine.core.sampling import GREEDY
from potluck.engine.core.spec import EngineSpec
from potluck.engine.loader import open_session

from .app_fakes import run_async, until

SYSTEM = "You are a helpful assistant. Answer in one short paragraph."
TOPICS = ["the moon", "volcanoes", "honey bees", "the river Nile", "owls"]


def question(topic: str) -> str:
    return (
        f"Tell me about {topic}. I am writing a school report and I would like to know where the name "
        f"comes from, what people believed about {topic} long ago, what scientists know today, and one "
        "surprising fact that my classmates will not have heard before. Please keep it simple."
    )


@run_async
async def test_a_cut_conversation_gets_a_fresh_sessions_reply(model_path: Path, tmp_path: Path) -> None:
    settings = Settings(
        model=ModelSettings(n_ctx=256, n_threads=1, strategy="auto", system=SYSTEM),
        sampling=SamplingSettings(temperature=0.0, max_tokens=24),
        ui=UISettings(cursor_blink=False, stats_interval_s=0),
    )
    app = build_app(
        settings=settings, session_factory=open_session, history_path=tmp_path / "history.sqlite3",
        export_dir=tmp_path / "exports", copy_fallback=lambda text: "test",
    )
    cut_replies: list[tuple[list[Message], str]] = []
    async with app.run_test(size=(120, 36)) as pilot:
        await until(lambda: app.session is not None or app.load_error, 120, "the model to load")
        assert app.load_error is None
        for topic in TOPICS:
            app.input.text = question(topic)
            await pilot.press("enter")
            await until(lambda: app.reply is None and app.input.text == "", 180, "the reply")
            path = app.store.messages(app.active)  # type: ignore[union-attr, arg-type]
            reply = path[-1]
            assert reply.role == "assistant" and reply.finish_reason in ("stop", "length"), reply
            if reply.context_from is not None:
                first = next(i for i, m in enumerate(path) if m.id == reply.context_from)
                sent = [Message("system", SYSTEM)] + [Message(m.role, m.content) for m in path[first:-1]]
                cut_replies.append((sent, reply.content))
        assert app.chat_log().query(".context-note")  # type: ignore[union-attr]
    assert len(cut_replies) >= 2, "the conversation never outgrew the context"

    # The turns that moved the start were computed whole: a fresh session, given the same
    # messages, writes the same reply token for token (plain decoding, another strategy).
    fresh = open_session(EngineSpec(n_ctx=256, n_threads=1, strategy="plain"))
    try:
        moved = [(sent, text) for i, (sent, text) in enumerate(cut_replies)
                 if i == 0 or sent[1] != cut_replies[i - 1][0][1]]
        assert moved
        for sent, text in moved:
            fresh.load_messages(sent[:-1])
            events = list(fresh.generate(sent[-1].content, GREEDY, 24))
            assert events[-1].text == text  # type: ignore[attr-defined]
            fresh.load_messages([], fresh=True)
    finally:
        fresh.close()


def test_a_sessions_prompt_progress_counts_its_batches(model_path: Path) -> None:
    import threading
    import time

    session = open_session(EngineSpec(n_ctx=2048, n_threads=1, strategy="plain"))
    try:
        seen: list[tuple[int, int]] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.append(session.prompt_progress())
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            list(session.generate(" ".join(question(t) for t in TOPICS * 3), GREEDY, 1))  # ~860 tokens
        finally:
            done.set()
            watcher.join()
        total = next(t for _, t in seen if t)
        assert total > 512  # two batches of 512
        reads = sorted({d for d, t in seen if t})
        assert reads[0] == 0 and any(0 < d < total for d in reads), reads  # part of it, before the end
        assert session.prompt_progress() == (0, 0)  # nothing is being read now
    finally:
        session.close()
