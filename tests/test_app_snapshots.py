"""Snapshot tests (pytest-textual-snapshot): the first screen, a conversation, the picker,
the settings dialog and the help at 120x40, 80x24 and 60x20; the live and cluster panels.

Deterministic by construction: fixed terminal size, no cursor blink, no panel timer (the
panels are sampled by the test at chosen instants), a fake model catalog and strategy
table, fixed fake figures, the sampling pinned (not config.toml's defaults, which may change).
Update on purpose only: ``pytest --snapshot-update``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from potluck.app.config import SamplingSettings, Settings, UISettings
from potluck.app.tui import PotluckApp, build_app
from potluck.app.tui.catalog import ModelInfo
from potluck.app.tui.cluster import ClusterState, StageRow
from potluck.app.tui.screens import HelpScreen, PickerScreen
from potluck.app.tui.settings import SettingsScreen
from potluck.app.tui.stats import ReplyProgress
from potluck.engine.core.events import NodeStatus, ReplyStarted, RoundStats

from .app_fakes import FakeFactory, ScriptedSession, Step, until, words

SIZES = [(120, 40), (80, 24), (60, 20)]  # a full terminal, the classic one, a small split pane
STILL = Settings(
    ui=UISettings(cursor_blink=False, stats_interval_s=0),
    sampling=SamplingSettings(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, max_tokens=512),
)
REPLY = (
    "Sure! Here is a function that reverses a string:\n\n"
    "```python\ndef reverse(s: str) -> str:\n    return s[::-1]\n```\n\n"
    "It uses **slicing** with a step of `-1`."
)


class _Plain:
    name, needs_draft, description = "autoregressive", False, "plain decoding"


class _Spec:
    name, needs_draft, description = "sd", True, "draft model speculation"


CATALOG = [
    ModelInfo(None, "SmolLM2-135M-Instruct (bundled)", "llama", 30, 49152, vocab="a"),
    ModelInfo(Path("/models/smollm2-1.7b.gguf"), "SmolLM2-1.7B-Instruct", "llama", 24, 49152, vocab="a"),
    ModelInfo(Path("/models/gemma-3-270m.gguf"), "Gemma 3 270M", "gemma3", 18, 262144, vocab="b"),
]


def make(tmp_path: Path, steps: list[Step]) -> tuple[PotluckApp, FakeFactory]:
    factory = FakeFactory(lambda spec: ScriptedSession(steps, strategy="sd", tokens_per_s=61.5))
    app = build_app(
        settings=STILL,
        session_factory=factory,
        history_path=tmp_path / "history.sqlite3",
        export_dir=tmp_path / "exports",
        model_catalog=lambda: list(CATALOG),
        strategies={"autoregressive": _Plain, "sd": _Spec},
        copy_fallback=lambda text: "test",
        clock=lambda: 0.0,
    )
    return app, factory


async def converse(app: PotluckApp, pilot) -> None:  # noqa: ANN001
    await until(lambda: app.session is not None)
    app.input.text = "Write a Python function that reverses a string."
    await pilot.press("enter")
    await until(lambda: app.reply is None and len(app.store.messages(app.active)) == 2)  # type: ignore[union-attr, arg-type]
    app.input.text = ""
    # The log settles after a refresh: at its end, and with no gap above the first message
    # once the final Markdown fits again (a streamed reply is taller; seen on CI at 60x20).
    chat = app.chat_log()
    await pilot.pause()
    await until(lambda: chat is not None and chat.scroll_y == chat.max_scroll_y, what="the log at its end",
                state=lambda: chat and (f"scroll_y {chat.scroll_y}, max_scroll_y {chat.max_scroll_y}, "
                                        f"anchored {chat.is_anchored}, size {chat.size}, virtual {chat.virtual_size}"))
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_first_screen(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:  # noqa: ANN001
    app, _ = make(tmp_path, words("ok"))

    async def run_before(pilot) -> None:  # noqa: ANN001
        await until(lambda: app.session is not None)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_main_screen(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:  # noqa: ANN001
    app, _ = make(tmp_path, words(REPLY) + [Step("", drafted=4, accepted=3, draft_len=4)])
    assert snap_compare(app, terminal_size=size, run_before=lambda pilot: converse(app, pilot))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("key,screen", [("f6", SettingsScreen), ("f1", HelpScreen)], ids=["settings", "help"])
def test_dialogs(snap_compare, tmp_path: Path, size: tuple[int, int], key: str, screen: type) -> None:  # noqa: ANN001
    app, _ = make(tmp_path, words(REPLY))

    async def run_before(pilot) -> None:  # noqa: ANN001
        await converse(app, pilot)
        await pilot.press(key)
        await until(lambda: isinstance(app.screen, screen))
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_live_panels_mid_reply(snap_compare, tmp_path: Path) -> None:  # noqa: ANN001
    app, _ = make(tmp_path, words(REPLY))

    async def run_before(pilot) -> None:  # noqa: ANN001
        await converse(app, pilot)
        # A reply in progress, its events received and the panels sampled by hand at fixed
        # instants: 3 rounds between samples, 3 of 4 drafts pass per round.
        p = ReplyProgress().after(ReplyStarted(99, "sd", prompt_tokens=180, prefill_tokens=40, n_ctx=4096), 10.0)
        for i, t in enumerate([10.25, 10.5, 10.75, 11.0, 11.25, 11.5, 11.75, 12.0]):
            new_tokens = 12 * (i + 1) - i % 3  # accepted + rounds so far, a few short
            for emitted in (4, 4, new_tokens - p.new_tokens - 8):
                n_past = 180 + p.new_tokens + emitted
                p = p.after(RoundStats(99, 4, 3, emitted, 4 + i % 2, 0.0, 0.0, n_past), 10.08 if i == 0 else t)
            app.progress = p
            app.sample_stats(now=t)
        await pilot.pause()

    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_picker(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:  # noqa: ANN001
    app, _ = make(tmp_path, words("ok"))

    async def run_before(pilot) -> None:  # noqa: ANN001
        await until(lambda: app.session is not None)
        await pilot.press("ctrl+o")
        await until(lambda: isinstance(app.screen, PickerScreen))
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_cluster_panel(snap_compare, tmp_path: Path) -> None:  # noqa: ANN001
    # Two stages after a reply: the second worker was lost, the head carried on over the first.
    app, _ = make(tmp_path, words(REPLY))

    async def run_before(pilot) -> None:  # noqa: ANN001
        await converse(app, pilot)
        app.cluster_state = ClusterState(
            stages=(
                StageRow("ebe6b179", "192.168.1.20:5733", (0, 22), bytes_per_token=2418.0),
                StageRow("289ed316", "192.168.1.21:5733", (22, 30), bytes_per_token=1152.0),
            )
        ).with_status(NodeStatus(99, "289ed316", (22, 30), "lost", "disconnected"))
        app.show_cluster()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(120, 44), run_before=run_before)
