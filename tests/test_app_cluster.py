"""Cluster mode in the chat app, against real `potluck worker` processes on loopback.

`--nodes auto` discovers the workers (zeroconf bound to 127.0.0.1), the panel shows the
plan's stages, a reply streams through them with bytes per token counted per stage; the
cluster picker lists the workers found live and reopens the session over the chosen
ones; a worker killed between replies is named in the panel and the conversation, the
user's message is kept, and the re-plan key reopens the session over what is left.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.app.config import ClusterSettings, ModelSettings, SamplingSettings, Settings, UISettings
from potluck.app.store import Store
from potluck.app.tui import PotluckApp, build_app
from potluck.app.tui.cluster import AUTO, ClusterChoice
from potluck.app.tui.screens import ClusterScreen, PickerScreen
from potluck.engine.loader import open_session

from .app_fakes import click, run_async, until
from .cluster_support import JOIN_S, TOKEN, WorkerProc, start_workers, stop_workers

LOOPBACK = ("127.0.0.1",)
SETTINGS = Settings(
    model=ModelSettings(n_ctx=512, n_threads=1),
    sampling=SamplingSettings(max_tokens=8),
    ui=UISettings(cursor_blink=False, stats_interval_s=0.1),
    cluster=ClusterSettings(join_timeout_s=JOIN_S),
)


@pytest.fixture()
def workers(tmp_path: Path) -> Iterator[list[WorkerProc]]:
    procs = start_workers(tmp_path / "workers", ["w0", "w1"], zeroconf=True)
    try:
        yield procs
    finally:
        for w in procs:
            if w.alive():
                os.kill(w.proc.pid, signal.SIGCONT)
        stop_workers([w.proc for w in procs])


def make(tmp_path: Path, cluster: ClusterChoice | None) -> PotluckApp:
    return build_app(
        settings=SETTINGS,
        session_factory=open_session,
        history_path=tmp_path / "history.sqlite3",
        export_dir=tmp_path / "exports",
        copy_fallback=lambda text: "test",
        cluster=cluster,
        discovery_interfaces=LOOPBACK,
    )


def panel(app: PotluckApp) -> str:
    return app.query_one("#stats").text()  # type: ignore[attr-defined]


async def send(app: PotluckApp, pilot, text: str) -> None:  # noqa: ANN001
    """Send ``text`` and wait until its reply is over: stored, or failed with the text given
    back. (Not "no reply and the input cleared": that also holds while the send mounts the
    reply's view, before the reply starts, and a loaded machine caught it there.)"""
    store, conversation = app.store, app.active
    assert store is not None and conversation is not None

    def replies() -> int:
        return sum(m.role == "assistant" for m in store.messages(conversation))

    before = replies()
    app.input.text = text
    await pilot.press("enter")
    await until(lambda: app.reply is None and (replies() > before or app.input.text == text), 120, "the reply")


@run_async
async def test_nodes_auto_plans_streams_names_a_lost_worker_and_replans(
    tmp_path: Path, workers: list[WorkerProc]
) -> None:
    choice = ClusterChoice(nodes=AUTO, token=TOKEN, interfaces=LOOPBACK, discover_timeout_s=6.0, join_timeout_s=JOIN_S)
    app = make(tmp_path, choice)
    async with app.run_test(size=(130, 40)) as pilot:
        await until(lambda: app.session is not None or app.load_error, 120, "the cluster to load")
        assert app.load_error is None
        state = app.cluster_state
        assert state is not None and len(state.stages) == 2 and state.plan
        assert state.sent_bytes > 10_000_000 and state.transfer is None  # fresh workers: slices were sent
        assert "slices sent" in panel(app)
        assert {r.address for r in state.stages} == {w.address for w in workers}
        text = panel(app)
        assert "Cluster" in text and all(w.node_id[:8] in text for w in workers), text
        assert state.head_layers == (30, 30) and "head: output layer" in text, text  # the workers hold every layer
        assert "cluster of 2" in str(app.query_one("#status").render())

        await send(app, pilot, "What is the capital of France?")
        reply = app.chat_log().messages()[-1]  # type: ignore[union-attr]
        assert reply.role == "assistant" and reply.content.strip()
        await until(lambda: all(r.bytes_per_token for r in app.cluster_state.stages), 5, "bytes/token")  # type: ignore[union-attr]
        assert all(r.state == "ok" for r in app.cluster_state.stages)  # type: ignore[union-attr]
        assert "per token" in panel(app) and "—" not in panel(app).split("Cluster")[1]

        # The second stage's worker dies between replies.
        victim = next(w for w in workers if w.address == app.cluster_state.stages[-1].address)  # type: ignore[union-attr]
        victim.proc.kill()
        victim.proc.wait(10)
        shown = len(app.chat_log().messages())  # type: ignore[union-attr]
        message = "And of Italy?"
        await send(app, pilot, message)
        state = app.cluster_state
        text = panel(app)
        # Either the head re-planned over the survivor (PlanChanged) or the reply failed
        # naming the lost stage: both must say which node went.
        assert victim.node_id in (state.note if state else "") or victim.address in (state.note if state else ""), text
        if state.broken:  # type: ignore[union-attr]
            assert "re-plan over the workers found" in text
        views = app.chat_log().messages()  # type: ignore[union-attr]
        if len(views) > shown:  # the reply was kept (a failure before any text takes both back)
            assert views[-1].role == "assistant"  # and it says what happened under it
            assert victim.node_id in views[-1]._note or victim.address in views[-1]._note, views[-1]._note
        # Nothing typed is lost: the message is stored, or back in the input for a resend.
        stored = [m.content for m in app.store.messages(app.active)]  # type: ignore[union-attr, arg-type]
        assert message in stored or app.input.text == message

        # One key re-plans over the workers found now (only the survivor answers).
        app.input.text = ""
        await pilot.press("ctrl+g")
        await until(lambda: not app.loading and app.session is not None, 120, "the re-plan")
        assert app.load_error is None
        assert [r.address for r in app.cluster_state.stages] == [  # type: ignore[union-attr]
            w.address for w in workers if w is not victim
        ]
        assert app.cluster_state.healthy  # type: ignore[union-attr]
        # The survivor already holds what the new plan gives it (cached since the recovery,
        # or a slice it had): whatever it had is counted as cached, not sent again.
        assert app.cluster_state.sent_bytes + app.cluster_state.cached_bytes > 0  # type: ignore[union-attr]
        await send(app, pilot, "Thanks!")
        assert app.chat_log().messages()[-1].content.strip()  # type: ignore[union-attr]

    store = Store.open(tmp_path / "history.sqlite3")
    try:
        contents = [m.content for m in store.messages(store.conversations()[0].id)]
    finally:
        store.close()
    assert "What is the capital of France?" in contents and "Thanks!" in contents


@run_async
async def test_cluster_picker_lists_live_workers_and_opens_the_chosen_ones(
    tmp_path: Path, workers: list[WorkerProc]
) -> None:
    os.environ["POTLUCK_TOKEN"] = TOKEN
    try:
        app = make(tmp_path, None)  # starts on this PC
        async with app.run_test(size=(130, 40)) as pilot:
            await until(lambda: app.session is not None, 120, "the local model")
            assert app.cluster_state is None
            await pilot.press("ctrl+o")  # the model picker's Cluster… button opens it (as F9 does)
            await until(lambda: isinstance(app.screen, PickerScreen), 10, "the model picker")
            await click(pilot, "#cluster")
            await until(lambda: isinstance(app.screen, ClusterScreen), 10, "the cluster picker")
            screen = app.screen
            assert isinstance(screen, ClusterScreen)
            ours = {w.address for w in workers}
            await until(lambda: ours <= screen.found.keys(), 20, "both workers to be discovered")
            from textual.widgets import SelectionList

            sl = screen.query_one("#cluster-nodes", SelectionList)
            rows = [str(sl.get_option_at_index(i).prompt) for i in range(sl.option_count)]
            for w in workers:
                assert any(w.node_id[:9] in r and w.address in r for r in rows), rows
            # all offered by default (ours; on a shared machine, other runs' workers on loopback too)
            assert sorted(sl.selected) == sorted(screen.found)
            for address in list(sl.selected):
                if address != workers[0].address:
                    sl.deselect(address)  # use one worker: the whole model on it
            # its key, not a click: rows of other runs' workers found meanwhile move the button
            await pilot.press("ctrl+s")
            await until(lambda: app.cluster is not None, 10, "the choice")
            await until(lambda: not app.loading and app.session is not None, 120, "the cluster session")
            assert app.load_error is None
            assert app.cluster is not None and app.cluster.nodes == (workers[0].address,)
            assert [r.address for r in app.cluster_state.stages] == [workers[0].address]  # type: ignore[union-attr]
            assert app.cluster_state.stages[0].layers == (0, 30)  # type: ignore[union-attr]
            await send(app, pilot, "Hi")
            assert app.chat_log().messages()[-1].content.strip()  # type: ignore[union-attr]
            assert workers[0].node_id[:8] in panel(app)
            await pilot.press("f9")  # the picker's own key; Esc keeps the chain as it is
            await until(lambda: isinstance(app.screen, ClusterScreen), 10, "the cluster picker by F9")
            await pilot.press("escape")
            await until(lambda: not isinstance(app.screen, ClusterScreen), 10, "the picker to close")
            assert app.cluster.nodes == (workers[0].address,) and not app.loading
    finally:
        os.environ.pop("POTLUCK_TOKEN", None)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["chat", "--split", "0,15,30"], "--split only applies to cluster mode"),
        (["chat", "--nodes", "nohost"], "nohost"),
        (["chat", "--nodes", "127.0.0.1:5733", "--discover-timeout", "3"], "--discover-timeout"),
        (["chat", "--nodes", "auto"], "no cluster token"),
        # named as the option given, not as the [cluster] setting it overrides
        (["chat", "--nodes", "127.0.0.1:5733", "--join-timeout", "0"], "--join-timeout must be more than 0"),
        (["chat", "--join-timeout", "30"], "--join-timeout only applies to cluster mode"),
        (["chat", "--strict-nodes"], "--strict-nodes only applies to cluster mode"),
        (["chat", "--nodes", "auto", "--strict-nodes"], "--strict-nodes applies to a list of workers"),
    ],
)
def test_chat_cluster_options_refused_in_one_line(
    argv: list[str], needle: str, tmp_home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from potluck.app.cli import main

    monkeypatch.delenv("POTLUCK_TOKEN", raising=False)
    assert main(argv) == 2  # before the screen opens: nothing is drawn
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("potluck: error:") and needle in lines[0], lines
