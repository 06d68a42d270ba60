"""The chat app as a newcomer uses it (issue 41): a full context, the settings dialog, edits,
answers kept, search, the last prompt recalled, a message queued while the model loads, help
and the palette, Esc and typing outside the input. A scripted session stands in for the
model (a word is a token: ``app_fakes.prompt_tokens``); tests/test_chat_context_exact.py
checks the context cut on the real model."""

from __future__ import annotations

import threading
from pathlib import Path

from textual.command import CommandPalette
from textual.widgets import Input, OptionList

from potluck.app.config import KeySettings, ModelSettings, SamplingSettings, Settings, UISettings
from potluck.app.tui.app import PotluckApp
from potluck.app.tui.commands import ACTIONS
from potluck.app.tui.screens import HelpScreen, SearchScreen
from potluck.app.tui.settings import SettingsScreen
from potluck.app.tui.widgets import ChatInput, FirstSteps, MessageView
from potluck.engine.core.chat import Message

from .app_fakes import FakeFactory, ScriptedSession, Step, run_async, until, words
from .test_app_pilot import SIZE, make_app, ready, reply_done, send, views

QUIET = Settings(ui=UISettings(cursor_blink=False, stats_interval_s=0))


def status(app: PotluckApp) -> str:
    return str(app.query_one("#status").render())


# ---------------------------------------------------------------- item 2: a full context
@run_async
async def test_a_full_context_drops_the_oldest_turns_says_so_and_goes_on(tmp_path: Path) -> None:
    # A 120-token context: each turn below is ~25 tokens, the reply's room 30 (max_tokens).
    long = " ".join(["word"] * 16)
    factory = FakeFactory(lambda spec: ScriptedSession(lambda _u, _m: words(long), n_ctx=120))
    settings = Settings(
        model=ModelSettings(system="Be brief."), sampling=SamplingSettings(max_tokens=30),
        ui=UISettings(cursor_blink=False, stats_interval_s=0),
    )
    app = make_app(tmp_path, factory, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        session = factory.sessions[0]
        for i in range(3):
            await send(app, pilot, f"question number {i}")
            await reply_done(app)
        assert [m.content for m in session.loaded[-1]][:2] == ["Be brief.", "question number 0"]
        assert not any(session.fresh)  # everything fitted: the KV cache is reused
        await send(app, pilot, "question number 3")  # 3 turns and this one: past 120 - 30
        await reply_done(app)
        sent = session.loaded[-1]
        assert sent[0] == Message("system", "Be brief.")  # the system prompt is kept
        assert sent[1].role == "user" and sent[1].content != "question number 0"  # the oldest went
        assert session.fresh[-1]  # a new start: the prompt is computed whole (a fresh session's)
        assert session.prompts[-1] == "question number 3"
        stored = app.store.messages(app.active)  # type: ignore[union-attr, arg-type]
        first_sent = next(m for m in stored if m.content == sent[1].content)
        assert stored[-1].context_from == first_sent.id and stored[-1].finish_reason == "stop"
        notes = [str(n.render()) for n in app.chat_log().query(".context-note")]  # type: ignore[union-attr]
        assert len(notes) == 1 and "not sent" in notes[0] and "120" in notes[0]
        outside = [v for v in views(app) if v.has_class("outside")]
        assert outside and outside[0].content == "question number 0"
        # The next turn keeps that start: its KV cache is reused, nothing is computed whole.
        cut = len(session.loaded[-1])
        await send(app, pilot, "and one more")
        await reply_done(app)
        assert not session.fresh[-1] and session.loaded[-1][1] == sent[1]
        assert len(session.loaded[-1]) == cut + 2
        # The cut is shown again when the conversation is reopened.
        await app.show_path(app.active)  # type: ignore[arg-type]
        assert len(app.chat_log().query(".context-note")) == 1  # type: ignore[union-attr]


@run_async
async def test_a_message_longer_than_the_context_is_refused_in_one_line_and_kept(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok"), n_ctx=40))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        text = " ".join(["long"] * 60)
        await send(app, pilot, text)
        await until(lambda: app.reply is None and app.input.text == text, what="the text given back")
        assert any("context holds 40" in line for line in app.log_buffer.lines)
        assert app.store.messages(app.active) == []  # type: ignore[union-attr, arg-type]


# ---------------------------------------------------------------- item 3: settings
@run_async
async def test_the_settings_dialog_stores_parameters_with_the_conversation(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    app = make_app(tmp_path, factory, settings=QUIET)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        assert "temp 0.8 top-k 40 top-p 0.95 min-p 0.05" in status(app)  # config.toml's defaults
        await pilot.press("f6")
        await until(lambda: isinstance(app.screen, SettingsScreen), what="the settings dialog")
        dialog = app.screen
        dialog.query_one("#set-temperature", Input).value = "0"
        dialog.query_one("#set-seed", Input).value = "7"
        dialog.query_one("#set-max_tokens", Input).value = "64"
        await pilot.press("ctrl+s")
        await until(lambda: not isinstance(app.screen, SettingsScreen), what="the dialog closed")
        conv = app.store.conversation(app.active)  # type: ignore[union-attr, arg-type]
        assert (conv.params.temperature, conv.params.seed, conv.params.max_tokens) == (0.0, 7, 64)  # type: ignore[union-attr]
        await until(lambda: "greedy seed 7" in status(app), what="the status line")
        await send(app, pilot, "hi")
        await reply_done(app)
        used = factory.sessions[0].sampling[-1]
        assert used.temperature == 0.0 and used.seed == 7
        # Another conversation keeps the defaults.
        await pilot.press("ctrl+n")
        await until(lambda: "temp 0.8" in status(app), what="the defaults for a new chat")
        # A bad value is refused inside the dialog, in one line.
        await pilot.press("f6")
        await until(lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#set-top_p", Input).value = "7"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen)
        assert "top" in str(app.screen.query_one("#settings-error").render()).lower()
        await pilot.press("escape")


@run_async
async def test_the_context_size_changes_in_the_app_and_reloads(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok"), n_ctx=spec.n_ctx))
    app = make_app(tmp_path, factory, settings=QUIET, settings_path=tmp_path / "config.toml")
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await pilot.press("f6")
        await until(lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#set-n_ctx", Input).value = "8000"
        await pilot.press("ctrl+s")
        await until(lambda: len(factory.sessions) == 2 and not app.loading, what="the reload")
        assert factory.specs[-1].n_ctx == 8192  # rounded up as llama.cpp allocates it
        assert "n_ctx = 8192" in (tmp_path / "config.toml").read_text()


@run_async
async def test_a_conversation_strategy_reloads_before_its_reply(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok"), strategy=spec.strategy))
    app = make_app(tmp_path, factory, settings=QUIET)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await pilot.press("f6")
        await until(lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#set-strategy").value = "anpd"  # type: ignore[attr-defined]
        await pilot.press("ctrl+s")
        await until(lambda: not isinstance(app.screen, SettingsScreen))
        await send(app, pilot, "hello")
        await until(lambda: len(app.store.messages(app.active)) == 2, what="the queued reply")  # type: ignore[union-attr, arg-type]
        assert [s.strategy for s in factory.specs] == ["auto", "anpd"]
        assert factory.sessions[1].prompts == [None]  # the queued prompt, answered after the load


# ---------------------------------------------------------------- item 4: chat basics
@run_async
async def test_edit_a_sent_message_and_resend_from_there(tmp_path: Path) -> None:
    answers = iter(["A1", "A2", "A2 again"])
    factory = FakeFactory(lambda spec: ScriptedSession(lambda _u, _m: words(next(answers))))
    app = make_app(tmp_path, factory, settings=QUIET)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "first")
        await reply_done(app)
        await send(app, pilot, "second")
        await reply_done(app)
        first = views(app)[0]
        first.focus()
        await until(lambda: app.focused is first, what="the focus")
        await pilot.press("e")
        await until(lambda: app.input.text == "first" and app.editing is not None, what="the prompt in the input")
        assert "editing" in status(app)
        app.input.text = "first, edited"
        await pilot.press("enter")
        await reply_done(app)
        await until(lambda: [v.content for v in views(app)] == ["first, edited", "A2 again"], what="the new branch")
        assert factory.sessions[0].loaded[-1] == []  # resent from there: nothing before it
        assert views(app)[0].variant == (2, 2)
        # the old branch is kept: step back to it on the edited message
        views(app)[0].focus()
        await until(lambda: app.focused is views(app)[0], what="the focus")
        await pilot.press("left")
        await until(lambda: [v.content for v in views(app)] == ["first", "A1", "second", "A2"], what="the old branch")


@run_async
async def test_search_opens_the_conversation_at_the_hit(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(lambda u, _m: words(f"answer to {u}")))
    app = make_app(tmp_path, factory, settings=QUIET)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "how do I cook spaghetti")
        await reply_done(app)
        pasta = app.active
        await pilot.press("ctrl+n")
        await send(app, pilot, "bicycle gears")
        await reply_done(app)
        assert app.active != pasta
        await pilot.press("ctrl+f")
        await until(lambda: isinstance(app.screen, SearchScreen), what="the search")
        await pilot.press(*"spaghetti")
        hits = app.screen.query_one("#search-hits", OptionList)
        await until(lambda: hits.option_count == 2, what="two hits")  # the prompt and the reply
        await pilot.press("down", "enter")
        await until(lambda: app.active == pasta, what="the hit's conversation")
        assert isinstance(app.focused, MessageView) and "spaghetti" in app.focused.content


@run_async
async def test_up_in_an_empty_input_recalls_the_last_prompts(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    app = make_app(tmp_path, factory, settings=QUIET)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        for text in ("one", "two"):
            await send(app, pilot, text)
            await reply_done(app)
        await pilot.press("up")
        assert app.input.text == "two"
        await pilot.press("up")
        assert app.input.text == "one"
        await pilot.press("down")
        assert app.input.text == "two"
        await pilot.press("down")
        assert app.input.text == ""


@run_async
async def test_a_message_typed_while_the_model_loads_is_sent_when_it_is_ready(tmp_path: Path) -> None:
    loaded = threading.Event()

    def slow(spec: object) -> ScriptedSession:
        loaded.wait(30)
        return ScriptedSession(words("hello back"))

    factory = FakeFactory(slow)
    app = make_app(tmp_path, factory, settings=QUIET)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: app.loading, what="the load to start")
        await send(app, pilot, "hello")
        assert app.input.text == "" and app.queued is not None
        assert views(app)[0].content == "hello" and "queued" in views(app)[0]._note
        loaded.set()
        await until(lambda: len(app.store.messages(app.active)) == 2, what="the answer")  # type: ignore[union-attr, arg-type]
        await reply_done(app)
        assert [v.content for v in views(app)] == ["hello", "hello back"] and not views(app)[0]._note
        assert factory.sessions[0].prompts == [None]


# ---------------------------------------------------------------- item 6: discoverable
@run_async
async def test_help_palette_first_steps_esc_and_typing_outside_the_input(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    app = make_app(tmp_path, factory, settings=QUIET)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        first = app.chat_log().query(FirstSteps)  # type: ignore[union-attr]
        assert first and "press Enter" in str(first.first().render())
        await pilot.press("f1")
        await until(lambda: isinstance(app.screen, HelpScreen), what="help")
        shown = " ".join(f"{k} {w}" for _, rows in app.screen.sections for k, w in rows)  # type: ignore[attr-defined]
        for keys in (KeySettings().quit, "escape", KeySettings().settings, KeySettings().search):
            assert keys in shown
        await pilot.press("escape")
        await send(app, pilot, "hi")
        await reply_done(app)
        assert not app.chat_log().query(FirstSteps)  # type: ignore[union-attr]
        # Shift+Tab into the messages: Esc brings the focus back, and so does typing.
        await pilot.press("shift+tab")
        assert not isinstance(app.focused, ChatInput)
        await pilot.press("escape")
        assert isinstance(app.focused, ChatInput)
        views(app)[-1].focus()
        await until(lambda: app.focused is views(app)[-1], what="the focus")
        await pilot.press("h", "i")
        assert isinstance(app.focused, ChatInput) and app.input.text == "hi"
        app.input.text = ""
        views(app)[-1].focus()
        await until(lambda: app.focused is views(app)[-1], what="the focus")
        await pilot.press("question_mark")
        await until(lambda: isinstance(app.screen, HelpScreen), what="? opens the help")
        await pilot.press("escape")
        # The palette holds the app's own commands.
        await pilot.press("ctrl+p")
        await until(lambda: isinstance(app.screen, CommandPalette), what="the palette")
        await pilot.press(*"search")
        palette = app.screen
        await until(lambda: palette.query_one(OptionList).option_count > 0, what="palette hits")
        found = [str(palette.query_one(OptionList).get_option_at_index(i).prompt)
                 for i in range(palette.query_one(OptionList).option_count)]
        assert any("Search" in f for f in found)
        await pilot.press("escape")
    for wanted in ("new_conversation", "regenerate", "export", "picker", "cluster", "settings", "search",
                   "copy_reply", "toggle_panels"):
        assert wanted in ACTIONS


# ---------------------------------------------------------------- item 10: the screenshot
@run_async
async def test_the_screenshot_falls_back_to_the_data_directory(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from potluck.engine.core import paths

    monkeypatch.setenv("XDG_DOWNLOAD_DIR", str(tmp_path / "no-such-downloads"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    paths.override_home(tmp_path / "home")
    try:
        app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession(words("ok"))), settings=QUIET)
        async with app.run_test(size=SIZE) as pilot:
            await ready(app)
            app.action_screenshot()
            await until(lambda: list((paths.data_dir() / "screenshots").glob("*.svg")), what="the screenshot")
            await pilot.pause()
    finally:
        paths.override_home(None)


# ---------------------------------------------------------------- item 7: the cluster view
@run_async
async def test_a_lost_worker_shows_lost_and_recovering_at_once(tmp_path: Path) -> None:
    from potluck.app.tui.cluster import ClusterState, stages_of
    from potluck.engine.core.events import ClusterView, StageView

    gate = threading.Event()
    stages = (StageView("aaaa1111", "10.0.0.1:5733", (0, 15), 0), StageView("bbbb2222", "10.0.0.2:5733", (15, 29), 0))

    class ClusterSession(ScriptedSession):
        health: tuple[tuple[str, str, str], ...] = ()

        def cluster_view(self) -> ClusterView:  # type: ignore[override]
            return ClusterView(stages, (29, 30), 0, self.health)

    steps = words("first words") + [Step("", gate=gate)] + words(" and the rest")
    factory = FakeFactory(lambda spec: ClusterSession(steps))
    settings = Settings(ui=UISettings(cursor_blink=False, stats_interval_s=0.05))
    app = make_app(tmp_path, factory, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        # as a chain loaded over two workers leaves it (cluster mode's loading needs a LAN)
        app.cluster_state = ClusterState().loaded(stages_of(factory.sessions[0].cluster_view()), (29, 30))
        await send(app, pilot, "hello")
        await until(lambda: app.reply is not None and app.reply.got_text, what="the reply to stream")
        session = factory.sessions[0]
        # the head found the loss and rebuilds (its reply thread is busy): no event comes yet
        session.health = (("bbbb2222", "lost", "disconnected"), ("aaaa1111", "recovering", "rebuilding"))
        await until(lambda: "lost" in app.query_one("#stats").text(), what="lost, at once")  # type: ignore[attr-defined]
        text = app.query_one("#stats").text()  # type: ignore[attr-defined]
        assert "recovering" in text and "ok" not in text.split("Cluster")[1].split("per token")[0]
        await until(lambda: "recovering" in status(app), what="the status line")
        gate.set()
        await reply_done(app)


@run_async
async def test_a_long_prompt_shows_how_much_of_it_is_read(tmp_path: Path) -> None:
    gate = threading.Event()

    class Reading(ScriptedSession):
        def prompt_progress(self) -> tuple[int, int]:
            return (512, 1500) if not gate.is_set() else (0, 0)

    factory = FakeFactory(lambda spec: Reading([Step("", gate=gate)] + words("done")))
    app = make_app(tmp_path, factory, settings=Settings(ui=UISettings(cursor_blink=False, stats_interval_s=0.05)))
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, " ".join(["word"] * 400))
        await until(lambda: "reading the prompt: 512 of 1,500 tokens" in status(app), what="the prompt's progress")
        gate.set()
        await reply_done(app)
        await until(lambda: "ready" in status(app), what="the status back at ready")
