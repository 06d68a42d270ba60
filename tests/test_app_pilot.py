"""Pilot tests of the chat app with a scripted fake session (no model, deterministic).

Every wait polls a condition (``until``); nothing relies on a fixed pause.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from textual.content import Content

from potluck.app.config import Settings, UISettings, load_settings
from potluck.app.tui import PotluckApp, build_app
from potluck.app.tui.catalog import ModelInfo
from potluck.app.tui.screens import ClusterScreen, PickerScreen
from potluck.app.tui.widgets import LAYOUT_EVERY_S, ChatLog, MessageView, StatsPanel
from potluck.discovery.lan import PROTOCOL_VERSION, DiscoveredNode
from potluck.engine.core.errors import PotluckError
from potluck.engine.speculation.strategies.registry import STRATEGIES

from .app_fakes import FakeFactory, ScriptedSession, Step, run_async, until, words

SIZE = (120, 36)
QUIET = Settings(ui=UISettings(cursor_blink=False, stats_interval_s=0.05))


def make_app(
    tmp_path: Path,
    factory: FakeFactory,
    copied: list[str] | None = None,
    **kwargs: object,
) -> PotluckApp:
    return build_app(
        settings=kwargs.pop("settings", QUIET),  # type: ignore[arg-type]
        session_factory=factory,
        history_path=tmp_path / "history.sqlite3",
        export_dir=tmp_path / "exports",
        copy_fallback=lambda text: (copied.append(text) if copied is not None else None) or "test",
        **kwargs,  # type: ignore[arg-type]
    )


async def ready(app: PotluckApp) -> None:
    await until(lambda: app.session is not None and not app.loading, what="the session to load")


async def send(app: PotluckApp, pilot, text: str) -> None:  # noqa: ANN001
    notes = len(app._notifications)
    app.input.text = text
    await pilot.press("enter")
    # Sent (the input empties) or refused (a notification says why, the text stays).
    await until(lambda: app.input.text == "" or len(app._notifications) > notes, what="the send")


async def reply_done(app: PotluckApp) -> None:
    await until(lambda: app.reply is None, what="the reply to finish")


def views(app: PotluckApp) -> list[MessageView]:
    chat = app.chat_log()
    assert chat is not None
    return chat.messages()


@run_async
async def test_send_streams_a_reply_and_stores_both_messages(tmp_path: Path) -> None:
    steps = words("Hello! Here is some code:\n\n```python\nprint('hi')\n```\n", delay_s=0.005)
    factory = FakeFactory(lambda spec: ScriptedSession(steps))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "say hi\nwith code")
        assert app.input.text == ""  # sent: the input is cleared
        await reply_done(app)
        user, reply = views(app)
        assert user.content == "say hi\nwith code"
        assert reply.content == "Hello! Here is some code:\n\n```python\nprint('hi')\n```\n"
        stored = app.store.messages(app.active)  # type: ignore[union-attr, arg-type]
        assert [(m.role, m.content) for m in stored] == [("user", user.content), ("assistant", reply.content)]
        assert stored[1].finish_reason == "stop"
        conv = app.store.conversation(app.active)  # type: ignore[union-attr, arg-type]
        assert conv is not None and conv.title == "say hi"  # titled from the first message
        # the status line follows the reply's end by one message: on a loaded machine, later
        await until(lambda: str(app.query_one("#status").render()).startswith("ready"), what="the status line")


@run_async
async def test_newline_key_inserts_a_line_break_instead_of_sending(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await pilot.press("a", "ctrl+j", "b")
        assert app.input.text == "a\nb" and app.reply is None
        await pilot.press("enter")
        await reply_done(app)
        assert views(app)[0].content == "a\nb"


@run_async
async def test_panels_show_what_the_stream_implies(tmp_path: Path) -> None:
    # 2 rounds: 3 of 4 drafts pass, then 3 of 4 again -> acceptance 0.75, 3.00 accepted/round.
    steps = [Step("one two three four ", 4, 3, 4), Step("five six seven eight", 4, 3, 5)]
    factory = FakeFactory(lambda spec: ScriptedSession(steps, strategy="sd", tokens_per_s=42.0))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        text = app.query_one(StatsPanel).text()
        assert "acceptance" in text and "—" in text  # nothing drafted yet: dashes, not zeros
        await send(app, pilot, "count")
        await reply_done(app)
        text = app.query_one(StatsPanel).text()
        lines = {" ".join(line.split()[:-1]): line.split()[-1] for line in text.splitlines() if line.strip()}
        assert lines["acceptance"] == "0.75"
        assert lines["accepted/round"] == "3.00"
        assert lines["draft length"] == "5"
        assert lines["drafted"] == "8" and lines["accepted"] == "6"
        assert lines["generated"] == "8"
        assert "42.0 tok/s" in text and "0.12 s" in text
        stored = app.store.messages(app.active)[-1]  # type: ignore[union-attr, arg-type]
        assert stored.acceptance_rate == 0.75 and stored.strategy == "sd"


@run_async
async def test_plain_decoding_shows_dashes_not_zero_acceptance(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("a b c")))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "x")
        await reply_done(app)
        text = app.query_one(StatsPanel).text()
        row = next(line for line in text.splitlines() if line.startswith("acceptance"))
        assert row.split()[-1] == "—"


@run_async
async def test_escape_stops_mid_reply_and_keeps_the_partial_text(tmp_path: Path) -> None:
    steps = words("this reply is cut", delay_s=0.01) + [Step(" never", delay_s=60.0)]
    factory = FakeFactory(lambda spec: ScriptedSession(steps))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "go")
        await until(lambda: views(app)[-1].content == "this reply is cut", what="the partial text")
        await pilot.press("escape")
        await reply_done(app)  # well before the 60 s step: the stop is immediate
        reply = views(app)[-1]
        assert reply.content == "this reply is cut"
        assert reply.has_class("stopped")
        stored = app.store.messages(app.active)[-1]  # type: ignore[union-attr, arg-type]
        assert stored.content == "this reply is cut" and stored.stopped
        # The next turn continues the conversation, partial reply included.
        factory.sessions[0].script = lambda _u, _m: words("next")
        await send(app, pilot, "again")
        await reply_done(app)
        assert [m.content for m in factory.sessions[0].loaded[-1]] == ["go", "this reply is cut"]


@run_async
async def test_regenerate_keeps_every_answer_and_steps_between_them(tmp_path: Path) -> None:
    answers = iter(["first answer", "second answer"])
    factory = FakeFactory(lambda spec: ScriptedSession(lambda _u, _m: words(next(answers))))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "question")
        await reply_done(app)
        await pilot.press("ctrl+r")
        await until(lambda: app.reply is not None or views(app)[-1].content == "second answer")
        await reply_done(app)
        assert [v.content for v in views(app)] == ["question", "second answer"]
        assert views(app)[-1].variant == (2, 2)
        stored = app.store.messages(app.active)  # type: ignore[union-attr, arg-type]
        assert [m.content for m in stored] == ["question", "second answer"]
        session = factory.sessions[0]
        assert session.prompts == ["question", None]  # regenerate answers the same history
        assert [m.content for m in session.loaded[-1]] == ["question"]
        # Both answers are kept: step back to the first and forward again.
        await pilot.press("alt+left")
        await until(lambda: views(app)[-1].content == "first answer", what="the earlier answer")
        assert views(app)[-1].variant == (1, 2)
        assert [m.content for m in app.store.messages(app.active)] == ["question", "first answer"]  # type: ignore[union-attr, arg-type]
        await pilot.press("alt+right")
        await until(lambda: views(app)[-1].content == "second answer", what="the later answer")


@run_async
async def test_switching_conversations_during_a_reply(tmp_path: Path) -> None:
    gate = threading.Event()
    steps = words("a slow reply")
    steps[1:1] = [Step("", gate=gate)]
    steps += words(" in the first chat")
    factory = FakeFactory(lambda spec: ScriptedSession(steps))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        first = app.active
        await send(app, pilot, "first")
        await until(lambda: views(app)[-1].content != "", what="streaming to start")
        await pilot.press("ctrl+n")  # new conversation while the reply streams
        second = app.active
        assert second != first and app.reply is not None
        await pilot.press("h", "i")  # typing works during the reply
        assert app.input.text == "hi" and views(app) == []
        await pilot.press("enter")  # sending is refused while busy, text kept
        assert app.input.text == "hi"
        gate.set()
        await reply_done(app)
        assert app.store.messages(second) == []  # type: ignore[union-attr, arg-type]
        stored = app.store.messages(first)  # type: ignore[union-attr, arg-type]
        assert stored[-1].content == "a slow reply in the first chat"
        await pilot.press("alt+down")  # back to the first conversation (list order: recent first)
        await until(lambda: app.active == first)
        assert views(app)[-1].content == "a slow reply in the first chat"


@run_async
async def test_restart_finds_the_history_and_continues_it(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("remembered reply")))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "remember me")
        await reply_done(app)
    assert factory.sessions[0].closed  # quitting frees the engine

    factory2 = FakeFactory(lambda spec: ScriptedSession(words("continued")))
    app2 = make_app(tmp_path, factory2)
    async with app2.run_test(size=SIZE) as pilot:
        await ready(app2)
        assert [v.content for v in views(app2)] == ["remember me", "remembered reply"]
        await send(app2, pilot, "and now?")
        await reply_done(app2)
        loaded = factory2.sessions[0].loaded[-1]
        assert [(m.role, m.content) for m in loaded] == [
            ("user", "remember me"),
            ("assistant", "remembered reply"),
        ]


@run_async
async def test_export_writes_markdown(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("**bold** answer")))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "Export test")
        await reply_done(app)
        await pilot.press("ctrl+s")
        files = list((tmp_path / "exports").glob("*.md"))
        assert len(files) == 1
        text = files[0].read_text()
        head, body = text.split("**System prompt:** none\n\n")
        assert head.startswith("# Export test\n\n*Exported 20") and "model SmolLM2-135M-Instruct (bundled)" in head
        assert "· auto ·" in head and "temp 0.8" in head  # the strategy and the sampling in use
        assert body == "## You\n\nExport test\n\n## Assistant\n\n**bold** answer\n"


@run_async
async def test_copy_reply_and_code_block(tmp_path: Path) -> None:
    text = "Use this:\n\n```sh\nls -la\n```\n\nand this:\n\n```py\nprint(2)\n```"
    factory = FakeFactory(lambda spec: ScriptedSession(words(text)))
    copied: list[str] = []
    app = make_app(tmp_path, factory, copied)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "cmds")
        await reply_done(app)
        await pilot.press("f3")
        assert app.clipboard == text  # OSC 52 went out
        await until(lambda: copied == [text], what="the clipboard fallback")
        await pilot.press("f5")
        assert app.clipboard == "print(2)"
        views(app)[-1].focus()
        await until(lambda: app.focused is views(app)[-1], what="the focus")
        await pilot.press("b")  # a focused message cycles through its code blocks
        assert app.clipboard == "ls -la"
        await pilot.press("y")
        assert app.clipboard == text


@run_async
async def test_failed_send_restores_the_prompt_and_logs_the_error(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession([], fail="the prompt is 5000 tokens"))
    app = make_app(tmp_path, factory)
    shown: list[str] = []  # every notification, kept (the app's own expire after 8 s: a slow box)
    notify = app.notify
    app.notify = lambda message, *a, **kw: (shown.append(message), notify(message, *a, **kw))[1]  # type: ignore
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "a very long prompt")
        await until(lambda: app.reply is None and app.input.text == "a very long prompt")
        assert views(app) == []
        assert app.store.messages(app.active) == []  # type: ignore[union-attr, arg-type]
        assert any("5000 tokens" in message for message in shown)
        await pilot.press("ctrl+l")
        assert any("5000 tokens" in line for line in app.log_buffer.lines)
        await pilot.press("escape")


@run_async
async def test_model_that_fails_to_load_is_reported_not_fatal(tmp_path: Path) -> None:
    def broken(spec: object) -> ScriptedSession:
        raise PotluckError("not a GGUF model file: /tmp/x.gguf")

    app = make_app(tmp_path, FakeFactory(broken))
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: app.load_error is not None)
        assert "no model" in str(app.query_one("#status").render())
        await send(app, pilot, "hello?")
        assert app.input.text == "hello?"  # refused, kept
        assert any("not a GGUF" in line for line in app.log_buffer.lines)


@run_async
async def test_rename_delete_and_system_prompt(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "one")
        await reply_done(app)
        await pilot.press("f2")
        await until(lambda: app.screen.query("#prompt-text"))
        app.screen.query_one("#prompt-text").value = "Renamed"  # type: ignore[attr-defined]
        await pilot.press("enter")
        await until(lambda: app.store.conversation(app.active).title == "Renamed")  # type: ignore[union-attr]

        await pilot.press("f4")
        await until(lambda: app.screen.query("#prompt-text"))
        app.screen.query_one("#prompt-text").text = "Answer in French."  # type: ignore[attr-defined]
        await pilot.press("ctrl+s")
        await until(lambda: app.store.conversation(app.active).system == "Answer in French.")  # type: ignore[union-attr]
        await send(app, pilot, "two")
        await reply_done(app)
        assert factory.sessions[0].loaded[-1][0].content == "Answer in French."

        doomed = app.active
        await pilot.press("f8")
        await until(lambda: app.screen.query("#yes"))
        await pilot.press("y")
        await until(lambda: app.active != doomed, what=f"deletion {app.log_buffer.lines}")
        assert app.store.conversation(doomed) is None  # type: ignore[union-attr, arg-type]
        assert len(app.store.conversations()) == 1  # a fresh one replaces the last  # type: ignore[union-attr]
        assert app.query(ChatLog).first().conversation_id == app.active


FAKE_VOCAB = ModelInfo(None, "Target", "llama", 30, 100, vocab="v1")
SAME_VOCAB = ModelInfo(Path("/models/small.gguf"), "Small", "llama", 8, 100, vocab="v1")
OTHER_VOCAB = ModelInfo(Path("/models/other.gguf"), "Other", "gemma3", 18, 200, vocab="v2")


class _Plain:
    name, needs_draft, description = "autoregressive", False, "plain decoding"


class _Spec:
    name, needs_draft, description = "sd", True, "draft model speculation"


@run_async
async def test_picker_offers_only_what_works_and_reloads(tmp_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    settings_path = tmp_path / "config.toml"
    app = make_app(
        tmp_path,
        factory,
        settings_path=settings_path,
        model_catalog=lambda: [FAKE_VOCAB, SAME_VOCAB, OTHER_VOCAB],
        strategies={"autoregressive": _Plain, "sd": _Spec},
    )
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await pilot.press("ctrl+o")
        await until(lambda: isinstance(app.screen, PickerScreen))
        picker = app.screen
        assert isinstance(picker, PickerScreen)

        assert picker._rows_draft == [None, SAME_VOCAB]  # other.gguf: different vocabulary
        assert picker._rows_strategy == ["autoregressive"]  # sd needs a draft, none chosen yet
        assert "other" in str(picker.query_one("#picker-hidden").render()).lower()
        picker.draft = SAME_VOCAB
        picker._refresh_lists()
        assert picker._rows_strategy == ["autoregressive", "sd"]
        picker.strategy = "sd"
        await pilot.press("ctrl+s")
        await until(lambda: len(factory.sessions) == 2 and not app.loading)
        spec = factory.specs[-1]
        assert spec.strategy == "sd" and spec.draft == Path("/models/small.gguf")
        assert factory.sessions[0].closed
        saved = load_settings(settings_path)
        assert saved.model.strategy == "sd" and saved.model.draft == "/models/small.gguf"


@run_async
async def test_picker_lists_the_registered_strategies(tmp_path: Path) -> None:
    """Strategies other engineers add to the registry show up without touching the app."""
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    app = make_app(tmp_path, factory, model_catalog=lambda: [FAKE_VOCAB, SAME_VOCAB])
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await pilot.press("ctrl+o")
        await until(lambda: isinstance(app.screen, PickerScreen))
        picker = app.screen
        picker.draft = SAME_VOCAB  # type: ignore[attr-defined]
        picker._refresh_lists()  # type: ignore[attr-defined]
        assert set(picker._rows_strategy) == set(STRATEGIES)  # type: ignore[attr-defined]


@pytest.mark.parametrize("key", ["ctrl+t"])
@run_async
async def test_panels_toggle(tmp_path: Path, key: str) -> None:
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession(words("ok"))))
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        panel = app.query_one(StatsPanel)
        assert panel.display
        await pilot.press(key)
        assert not panel.display


def test_settled_end_keeps_code_fences_open() -> None:
    from potluck.app.tui.widgets import settled_end

    assert settled_end("one\n\ntwo") == len("one\n\n")
    assert settled_end("```py\nx = 1\n\ny = 2\n") == 0  # a blank line inside a fence settles nothing
    text = "```py\nx = 1\n\ny = 2\n```\n\nafter"
    assert settled_end(text) == text.index("after")


@run_async
async def test_streaming_parses_finished_blocks_once_and_the_rest_as_plain_text(tmp_path: Path) -> None:
    gate = threading.Event()
    steps = [Step("Intro **bold**.\n\n"), Step("Still `typing"), Step("", gate=gate), Step(" code`.")]
    factory = FakeFactory(lambda spec: ScriptedSession(steps))
    app = make_app(tmp_path, factory)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "hi")
        reply = views(app)[-1]
        from textual.widgets import Static

        tail = reply.query_one(".tail", Static)
        await until(lambda: "Still" in str(tail.render()), what="the tail to show the open block")
        # Mid-reply: the finished paragraph is Markdown, the one being written is plain text.
        assert reply.markdown.source == "Intro **bold**.\n\n" and tail.display
        assert "`typing" in str(tail.render())
        gate.set()
        await reply_done(app)
        await pilot.pause()
        assert reply.markdown.source == "Intro **bold**.\n\nStill `typing code`." and not tail.display


async def streaming_view(app: PotluckApp) -> tuple[ChatLog, MessageView]:
    """A streaming reply's view, mounted in the loaded app's chat log (no engine behind it)."""
    await ready(app)
    chat = app.chat_log()
    assert chat is not None
    view = MessageView("assistant", streaming=True)
    await chat.mount(view)
    return chat, view


@run_async
async def test_streamed_text_and_the_reply_end_take_turns_on_the_markdown(tmp_path: Path) -> None:
    # The pump's timer task and the app's message queue both write to a reply: two Markdown
    # appends that overlap parse from the same line and lose a block.
    text = "First paragraph.\n\n```py\nx = 1\n```\n\nLast words."
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession([])))
    async with app.run_test(size=SIZE) as pilot:
        chat, view = await streaming_view(app)
        view._laid_out_at = -LAYOUT_EVERY_S  # the append may parse its finished blocks now
        await asyncio.gather(view.append(text[: text.index("Last")]), view.finish(text))
        await pilot.pause()
        blocks = list(view.markdown.children)
        assert view.markdown.source == text
        kinds = [type(b).__name__ for b in blocks]
        assert kinds == ["MarkdownParagraph", "MarkdownFence", "MarkdownParagraph"], kinds
        lines = text.splitlines()
        assert [lines[b.source_range[0]] for b in blocks] == ["First paragraph.", "```py", "Last words."]


@run_async
async def test_no_cyclic_garbage_collection_while_a_reply_runs(tmp_path: Path) -> None:
    # A collection holds the GIL the engine's threads need after every llama.cpp call.
    import gc

    gate = threading.Event()
    seen: list[bool] = []
    steps = [Step("Hello"), Step("", gate=gate), Step(" there.")]
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession(steps)))
    assert gc.isenabled()
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(app)
            await send(app, pilot, "hi")
            await until(lambda: app.reply is not None and app.reply.got_text, what="the reply to stream")
            seen.append(gc.isenabled())
            gate.set()
            await reply_done(app)
            await until(gc.isenabled, what="collections back on once the end is drawn")
            seen.append(gc.isenabled())
    finally:
        gc.enable()
    assert seen == [False, True]


@run_async
async def test_text_streamed_before_the_reply_is_mounted_is_drawn_once_it_is(tmp_path: Path) -> None:
    # The engine starts before the send mounts the reply's views; a pump tick that lands in
    # between must leave the text for the next one, not take it into a view not yet shown.
    gate = threading.Event()
    steps = [Step("Hello"), Step("", gate=gate), Step(" there.")]
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession(steps)))
    ticks: list[bool] = []
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(app)
            chat = app.chat_log()
            assert chat is not None
            mount_all = chat.mount_all

            async def mount_after_a_tick(widgets, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                await until(lambda: app.reply is not None and bool(app.reply.pending), what="text before the mount")
                ticks.append(app.reply.shown)
                await app._pump_reply_text()
                return await mount_all(widgets, *args, **kwargs)

            chat.mount_all = mount_after_a_tick  # type: ignore[method-assign]
            await send(app, pilot, "hi")
            reply = app.reply
            assert reply is not None
            await until(lambda: "Hello" in reply.view.content, what="the early text drawn")
            assert reply.view.is_attached and not reply.view.markdown.source.endswith("there.")
            gate.set()
            await reply_done(app)
            assert views(app)[-1].content == "Hello there."
    finally:
        gate.set()
    assert ticks == [False]


@run_async
async def test_a_reply_that_overflows_the_log_only_as_markdown_is_followed_to_its_end(tmp_path: Path) -> None:
    # Streaming anchors the log once it overflows; a reply whose final Markdown is the first
    # thing to overflow it must still end in view.
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession([])))
    async with app.run_test(size=SIZE) as pilot:
        chat, view = await streaming_view(app)
        await pilot.pause()
        assert chat.max_scroll_y == 0 and not chat.is_anchored
        await view.finish("\n\n".join(f"Paragraph {i}." for i in range(40)))
        await until(lambda: chat.max_scroll_y > 0 and chat.scroll_y == chat.max_scroll_y, what="the log at its end")


class _Found:
    """The LAN as a cluster picker sees it, changed by the test."""

    def __init__(self) -> None:
        self.list: list[DiscoveredNode] = []

    def add(self, port: int) -> str:
        self.list.append(DiscoveredNode(f"node{port}", f"127.0.0.1:{port}", "0", PROTOCOL_VERSION, 2, 1000, 3.0))
        return self.list[-1].address

    def nodes(self) -> list[DiscoveredNode]:
        return list(self.list)

    def close(self) -> None:
        pass


def _picker_over(lan: _Found) -> ClusterScreen:
    """The cluster picker, browsing ``lan`` instead of zeroconf."""

    class Picker(ClusterScreen):
        def _browse(self) -> None:
            self._membership = lan  # type: ignore[assignment]
            self.app.call_from_thread(self._refresh)

    return Picker(None, set())


@run_async
async def test_a_worker_found_after_the_user_changed_the_selection_is_offered_unselected(tmp_path: Path) -> None:
    # All workers are offered selected at first; once the user picks, one that appears later
    # (another PC starting `potluck worker`) must not join the split unasked.
    lan = _Found()

    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession([])))
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        a, b = lan.add(7001), lan.add(7002)
        picker = _picker_over(lan)
        await app.push_screen(picker)
        from textual.widgets import SelectionList

        sl = picker.query_one("#cluster-nodes", SelectionList)
        await until(lambda: sl.option_count == 2, what="the two workers listed")
        assert sorted(sl.selected) == [a, b]
        c = lan.add(7003)
        picker._refresh()
        assert sorted(sl.selected) == [a, b, c]  # untouched: a new worker is offered too
        sl.deselect(b)
        await pilot.pause()
        d = lan.add(7004)
        picker._refresh()
        assert sl.option_count == 4
        assert sorted(sl.selected) == [a, c]
        assert d not in sl.selected


@run_async
async def test_what_records_and_workers_say_is_shown_not_interpreted(tmp_path: Path) -> None:
    """Issue 39 item 7: a record's node id, or a worker's refusal, holding Textual markup
    (``[/x]`` raised MarkupError mid-render) or terminal escapes is shown as text."""
    evil = "[/x]\x1b]52;c;aGk=\x07[b]"
    lan = _Found()
    lan.list.append(DiscoveredNode(evil, "127.0.0.1:7001", evil, PROTOCOL_VERSION, 2, 1000, 3.0))

    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession([])))
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        app.report_error(f"node {evil} at 127.0.0.1:7001 refused: {evil}")
        picker = _picker_over(lan)
        await app.push_screen(picker)
        from textual.widgets import SelectionList

        sl = picker.query_one("#cluster-nodes", SelectionList)
        await until(lambda: sl.option_count == 1, what="the worker listed")
        await pilot.pause()
        prompt = sl.get_option_at_index(0).prompt
        shown = prompt.plain if isinstance(prompt, Content) else Content.from_markup(str(prompt)).plain
        assert "[/x]\\x1b]5" in shown and "\x1b" not in shown
        assert app.is_running


@run_async
async def test_thinking_is_folded_under_the_reply(tmp_path: Path) -> None:
    """A reasoning model's <think> block: the answer is the reply's Markdown, the thinking a
    folded Collapsible under it, for a streamed reply and one reopened from history."""
    from textual.widgets import Collapsible, Static

    text = "<think>\nThe user greets me.\n</think>\n\nHello **there**."
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession([])))
    async with app.run_test(size=SIZE) as pilot:
        chat, view = await streaming_view(app)
        await view.append(text[:20])
        await view.finish(text)
        await pilot.pause()
        fold = view.query_one(".thinking", Collapsible)
        assert view.markdown.source == "Hello **there**." and fold.display and fold.collapsed
        assert "The user greets me." in str(view.query_one(".thought", Static).render())
        assert view.content == text  # copied and saved as the model wrote it
        reopened = MessageView("assistant", text)
        await chat.mount(reopened)
        await pilot.pause()
        assert reopened.markdown.source == "Hello **there**." and reopened.query_one(".thinking", Collapsible).display
        plain = MessageView("assistant", "No thinking here.")
        await chat.mount(plain)
        await pilot.pause()
        assert not plain.query_one(".thinking", Collapsible).display


@run_async
async def test_a_thinking_reply_streams_its_thinking_folded_and_its_answer_without_markers(tmp_path: Path) -> None:
    """A reasoning model's reply, as llama.cpp's text writes it, token by token: while it
    streams, its thinking (gpt-oss's analysis channel, a <think> block, Gemma 4's thought
    channel) fills the folded block
    and the body shows the answer alone, never a tag or marker; the reply itself (stored,
    copied) stays as the engine wrote it."""
    from textual.widgets import Collapsible, Static

    harmony = ["<|channel|>", "analysis", "<|message|>", "Let me", " think.", "<|end|>", "<|start|>", "assistant",
               "<|channel|>", "final", "<|message|>", "Hello", " **there**."]
    think = ["<think>", "\nLet me", " think.", "</think>", "\n\nHello", " **there**."]
    gemma4 = ["<|channel>", "thought", "\n", "Let me", " think.", "<channel|>", "Hello", " **there**."]
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession([])))
    async with app.run_test(size=SIZE) as pilot:
        for pieces in (harmony, think, gemma4):
            chat, view = await streaming_view(app)
            for piece in pieces:
                view._laid_out_at = -LAYOUT_EVERY_S
                await view.append(piece)
                await pilot.pause()
                shown = view.markdown.source + str(view.query_one(".tail", Static).render())
                markers = ("<|", "think>", "channel|>", "thought", "analysis", "Let me")
                assert not any(m in shown for m in markers), shown
            assert str(view.query_one(".thought", Static).render()) == "Let me think."
            assert view.query_one(".thinking", Collapsible).display
            assert "Hello **there**." in view._shown
            await view.finish("".join(pieces))
            await pilot.pause()
            assert view.markdown.source == "Hello **there**." and view.content == "".join(pieces)


@run_async
async def test_a_reply_inside_a_block_the_template_opened_streams_its_thinking_folded(tmp_path: Path) -> None:
    """A thinking template opens ``<think>`` in the prompt itself (DeepSeek R1's, Qwen3's
    thinking ones): the reply starts inside the block and only closes it. The engine says so
    when the reply starts, and the app streams the thinking into the folded block from the
    first token, not into the body until the reply ends."""
    from textual.widgets import Collapsible, Static

    gate = threading.Event()
    steps = [Step("Let me"), Step(" think."), Step("</think>"), Step("", gate=gate), Step("\n\nHello"),
             Step(" **there**.")]
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession(steps, thinking_opened=True)))
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(app)
            await send(app, pilot, "hi")
            await until(lambda: app.reply is not None and "</think>" in app.reply.view.content,
                        what="the thinking to stream")
            reply = app.reply
            view = reply.view
            await pilot.pause()
            assert reply.thinking_opened
            shown = view.markdown.source + str(view.query_one(".tail", Static).render())
            assert "Let me" not in shown and "think" not in shown, shown
            assert str(view.query_one(".thought", Static).render()) == "Let me think."
            assert view.query_one(".thinking", Collapsible).display
            gate.set()
            await reply_done(app)
            await pilot.pause()
            assert view.markdown.source == "Hello **there**."
            assert view.content == "Let me think.</think>\n\nHello **there**."
    finally:
        gate.set()


@run_async
async def test_a_reply_cut_inside_a_block_the_template_opened_keeps_it_folded(tmp_path: Path) -> None:
    """Cut by the token limit before the block closed: the reply is all thinking, so the body
    stays empty when it ends, rather than showing the thinking unfolded there."""
    from textual.widgets import Collapsible, Static

    gate = threading.Event()
    steps = [Step("First, the"), Step(" sky"), Step(" scatters", gate=gate)]  # no </think>: the limit cut it
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession(steps, thinking_opened=True)))
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await send(app, pilot, "why blue?")
        await until(lambda: app.reply is not None, what="the reply to start")
        view = app.reply.view
        gate.set()
        await reply_done(app)
        await pilot.pause()
        assert view.content == "First, the sky scatters"  # stored as written
        assert view.markdown.source == "" and not str(view.query_one(".tail", Static).render())
        assert str(view.query_one(".thought", Static).render()) == "First, the sky scatters"
        assert view.query_one(".thinking", Collapsible).display


@run_async
async def test_a_reply_that_fits_again_as_markdown_leaves_no_gap_above_the_first_message(tmp_path: Path) -> None:
    # A streamed reply taller than its final Markdown anchors the log. On a busy machine the
    # anchored layout of the short Markdown can come first: it scrolls above the top
    # (scroll_y < 0) and hides the scrollbar, so a plain scroll home is then refused (seen on
    # CI at 60x20). The log must still end at its top.
    app = make_app(tmp_path, FakeFactory(lambda spec: ScriptedSession([])))
    async with app.run_test(size=SIZE) as pilot:
        chat, view = await streaming_view(app)
        view._laid_out_at = -LAYOUT_EVERY_S
        await view.append("\n\n".join(f"Line {i}." for i in range(60)))
        await until(lambda: chat.max_scroll_y > 0, what="the streamed reply overflowing")
        chat.follow()
        assert chat.is_anchored
        follow, chat.follow = chat.follow, lambda: None  # type: ignore[method-assign]
        await view.finish("Short.")
        await until(lambda: chat.scroll_y < 0 and not chat.vertical_scrollbar.display, what="the late follow's state",
                    state=lambda: f"scroll_y {chat.scroll_y}, scrollbar {chat.vertical_scrollbar.display}")
        follow()
        await pilot.pause()
        assert not chat.is_anchored and chat.scroll_y == 0
