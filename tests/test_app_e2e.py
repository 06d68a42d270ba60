"""End to end with the real bundled model: a short message gets a reply, and it is stored."""

from __future__ import annotations

from pathlib import Path

from potluck.app.config import ModelSettings, SamplingSettings, Settings, UISettings
from potluck.app.store import Store
from potluck.app.tui import build_app
from potluck.engine.loader import open_session

from .app_fakes import run_async, until


@run_async
async def test_real_model_replies_and_the_reply_is_stored(model_path: Path, tmp_path: Path) -> None:
    settings = Settings(
        model=ModelSettings(n_ctx=512, n_threads=1),
        sampling=SamplingSettings(max_tokens=16),
        ui=UISettings(cursor_blink=False, stats_interval_s=0.25),
    )
    history = tmp_path / "history.sqlite3"
    app = build_app(
        settings=settings,
        session_factory=open_session,
        history_path=history,
        export_dir=tmp_path / "exports",
        copy_fallback=lambda text: "test",
    )
    async with app.run_test(size=(120, 36)) as pilot:
        await until(lambda: app.session is not None or app.load_error, 120, "the model to load")
        assert app.load_error is None
        app.input.text = "What is the capital of France?"
        await pilot.press("enter")
        await until(lambda: app.reply is None and app.input.text == "", 120, "the reply")
        chat = app.chat_log()
        assert chat is not None
        reply = chat.messages()[-1]
        assert reply.role == "assistant" and reply.content.strip()
        panel_text = app.query_one("#stats").text()  # type: ignore[attr-defined]
        assert "auto: anpd" in panel_text and "generated" in panel_text  # the default strategy's pick

    store = Store.open(history)
    convs = store.conversations()
    messages = store.messages(convs[0].id)
    store.close()
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].content == reply.content
    assert messages[1].finish_reason in ("stop", "length") and messages[1].n_tokens
