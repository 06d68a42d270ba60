"""Chat durability: the reply being written reaches the history while it streams, and one
the app never finished (killed) reopens marked interrupted, in the store and on screen."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from potluck.app.config import Settings, UISettings
from potluck.app.store import Store
from potluck.app.tui import build_app

from .app_fakes import FakeFactory, ScriptedSession, Step, run_async, until, words

SIZE = (120, 36)
QUIET = Settings(ui=UISettings(cursor_blink=False, stats_interval_s=0.05))


def partial_on_disk(history: Path) -> str:
    """What another connection (the next start, after a kill) would read of the reply."""
    with sqlite3.connect(history) as conn:
        row = conn.execute(
            "SELECT content FROM messages WHERE finish_reason = 'partial' ORDER BY id DESC"
        ).fetchone()
    return row[0] if row else ""


@run_async
async def test_streaming_reply_is_on_disk_before_it_ends(tmp_path: Path) -> None:
    history = tmp_path / "history.sqlite3"
    hold = threading.Event()  # the last step waits: the reply is still streaming
    steps = words("the first part of a reply", delay_s=0.01) + [Step(" rest", gate=hold)]
    app = build_app(settings=QUIET, session_factory=FakeFactory(lambda spec: ScriptedSession(steps)),
                    history_path=history, export_dir=tmp_path / "exports", copy_fallback=lambda text: "t")
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: app.session is not None and not app.loading, what="the session")
        app.input.text = "tell me"
        await pilot.press("enter")
        await until(lambda: partial_on_disk(history) == "the first part of a reply", what="the partial on disk")
        assert app.reply is not None and app.reply.draft_id is not None  # still streaming
        hold.set()
        await until(lambda: app.reply is None, what="the reply to finish")
        stored = app.store.messages(app.active)  # type: ignore[union-attr, arg-type]
        # The finished reply took the partial one's place: one reply, complete.
        assert [(m.content, m.finish_reason) for m in stored] == [
            ("tell me", None), ("the first part of a reply rest", "stop")
        ]
    assert partial_on_disk(history) == ""


@run_async
async def test_a_killed_reply_reopens_marked_interrupted(tmp_path: Path) -> None:
    history = tmp_path / "history.sqlite3"
    store = Store.open(history)
    conv = store.new_conversation("story")
    store.add_message(conv.id, "user", "tell me a story")
    draft = store.begin_reply(conv.id, "Once upon a ti")
    store.close()  # what a kill -9 leaves: the partial row, nothing finished

    app = build_app(settings=QUIET, session_factory=FakeFactory(lambda spec: ScriptedSession(words("ok"))),
                    history_path=history, export_dir=tmp_path / "exports", copy_fallback=lambda text: "t")
    async with app.run_test(size=SIZE):
        await until(lambda: app.chat_log() is not None and len(app.chat_log().messages()) == 2,  # type: ignore[union-attr]
                    what="the conversation")
        view = app.chat_log().messages()[-1]  # type: ignore[union-attr]
        assert view.content == "Once upon a ti" and view.message_id == draft
        assert "interrupted" in view._note
        last = app.store.messages(conv.id)[-1]  # type: ignore[union-attr]
        assert last.interrupted
