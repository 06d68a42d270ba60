"""The UI stays responsive during a long generation: key presses are handled within
100 ms of being posted while a fast fake reply streams (the engine runs in a thread).

The bound is on the median and on most presses, not on every one: this 2-core machine
is shared, and a single press can wait behind another process's time slice.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from textual import events

from potluck.app.config import Settings, UISettings
from potluck.app.tui import build_app

from .app_fakes import FakeFactory, ScriptedSession, Step, run_async, until

BOUND_S = 0.100


@run_async
async def test_keys_are_handled_quickly_while_a_long_reply_streams(tmp_path: Path) -> None:
    # ~4000 rounds at 1 ms each, with Markdown that keeps the renderer busy.
    steps = [Step(f"word{i} " + ("\n\n" if i % 25 == 0 else ""), delay_s=0.001) for i in range(4000)]
    factory = FakeFactory(lambda spec: ScriptedSession(steps))
    app = build_app(
        settings=Settings(ui=UISettings(cursor_blink=False, stats_interval_s=0.1)),
        session_factory=factory,
        history_path=tmp_path / "history.sqlite3",
        export_dir=tmp_path / "exports",
        copy_fallback=lambda text: "test",
    )
    async with app.run_test(size=(120, 36)) as pilot:
        await until(lambda: app.session is not None)
        app.input.text = "go"
        await pilot.press("enter")
        chat = app.chat_log()
        assert chat is not None
        await until(lambda: len(chat.messages()[-1].content) > 500, what="the reply to be streaming")

        latencies: list[float] = []
        for ch in "responsive typing":
            before = app.input.text
            t0 = time.perf_counter()
            app.post_message(events.Key(ch, ch))
            while app.input.text == before:
                await asyncio.sleep(0.001)
            latencies.append(time.perf_counter() - t0)
        assert app.reply is not None, "the reply ended before the keys were measured"
        assert app.input.text == "responsive typing"
        app.action_stop()
        await until(lambda: app.reply is None)

    print(f"key latency ms: median {1000 * statistics.median(latencies):.1f}, "
          f"max {1000 * max(latencies):.1f}")
    shown = [round(x * 1000, 1) for x in latencies]
    assert statistics.median(latencies) < BOUND_S, shown
    assert sum(x < BOUND_S for x in latencies) >= 0.8 * len(latencies), shown
