"""The potluck chat app and its factory.

After posting: the CLI only parses arguments, :func:`build_app` builds the app from
explicit arguments (settings, a session factory, the history file), and the tests build
it the same way with a scripted fake session. The engine runs in worker threads
(:mod:`.replies`); this module starts them and handles the messages they post.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import ContentSwitcher, Footer, Label, Static

from ...assets import DEFAULT_MODEL_NAME, asset
from ...engine import EngineSpec, Message, PlanChanged, PotluckError, checked_spec, get_strategy_class, validate
from ..config import Settings, save_settings
from ..store import Conversation, Store, StoredMessage
from .catalog import ModelInfo, StrategyClass, gather_models, read_model_info
from .cluster import (
    ClusterChoice,
    ClusterPlanned,
    ClusterState,
    LoadReporter,
    SliceProgress,
    bytes_per_token,
    stages_of,
    traffic,
)
from .export import code_blocks, conversation_markdown, export_path
from .replies import (
    ChatSession,
    ClusterEvent,
    ClusterNotice,
    Reply,
    ReplyFailed,
    ReplyFinished,
    SessionFactory,
    SessionLoaded,
    checkpoint_reply,
    load_in_thread,
    reply_in_thread,
)
from .screens import ClusterScreen, ConfirmScreen, LocalChoice, LogScreen, Pick, PickerScreen, TextPromptScreen
from .stats import Figures, ReplyProgress, SpeedMeter
from .widgets import ChatInput, ChatLog, ConversationList, MessageView, StatsPanel, finish_note

log = logging.getLogger(__name__)

NEW_TITLE = "New chat"
TEXT_PUMP_S = 1 / 20  # how often streamed text is drawn
ENGINE_GIL_WAIT_S = 0.001  # the longest the engine thread waits for the GIL while the UI draws


def spec_from_settings(settings: Settings) -> EngineSpec:
    """The chat's engine spec, checked by engine.limits (PotluckError: one line to show).

    The draft goes only to a strategy that uses one; config.toml keeps it for later picks."""
    m = settings.model
    cls = get_strategy_class(m.strategy)  # an unknown name: one line
    draft = validate.path("[model] draft", m.draft) if cls.needs_draft or cls.accepts_draft else None
    return checked_spec(
        EngineSpec(
            model=validate.path("[model] path", m.path),
            strategy=m.strategy,
            draft=draft,
            n_ctx=m.n_ctx,
            n_threads=m.n_threads,
            system=m.system or None,  # loading refuses one longer than the context
        )
    )


class LogBuffer(logging.Handler):
    """Keeps this run's warnings and errors for the log view."""

    def __init__(self, capacity: int = 500) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.capacity = capacity
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
        del self.lines[: -self.capacity]


def _b(keys: str, action: str, description: str, show: bool = True, **kw: object) -> Binding:
    return Binding(keys, action, description, show=show, id=action, **kw)  # type: ignore[arg-type]


class PotluckApp(App[None]):
    CSS_PATH = str(asset("potluck.tcss"))
    TITLE = "potluck"
    # Binding ids are KeySettings field names, so [keys] in config.toml remaps them.
    BINDINGS = [
        _b("escape", "stop", "Stop"),
        _b("ctrl+r", "regenerate", "Regenerate"),
        _b("ctrl+n", "new_conversation", "New"),
        _b("f2", "rename_conversation", "Rename"),
        _b("f8", "delete_conversation", "Delete"),
        _b("ctrl+pageup,alt+up", "previous_conversation", "Previous", show=False),
        _b("ctrl+pagedown,alt+down", "next_conversation", "Next", show=False),
        _b("f4", "system_prompt", "System"),
        _b("ctrl+o", "picker", "Model"),
        _b("f9", "cluster", "Cluster"),
        _b("ctrl+g", "replan", "Re-plan", show=False),
        _b("ctrl+t", "toggle_panels", "Panels"),
        _b("f3", "copy_reply", "Copy"),
        _b("f5", "copy_code", "Copy code"),
        _b("ctrl+s", "export", "Export"),
        _b("ctrl+l", "log", "Log"),
    ]

    def __init__(
        self,
        *,
        settings: Settings,
        session_factory: SessionFactory,
        history_path: Path,
        export_dir: Path,
        settings_path: Path | None,
        model_catalog: Callable[[], list[ModelInfo]],
        strategies: Mapping[str, StrategyClass],
        copy_fallback: Callable[[str], str],
        clock: Callable[[], float],
        cluster: ClusterChoice | None = None,
        discovery_interfaces: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__()
        self.cluster = cluster
        self.cluster_state: ClusterState | None = ClusterState() if cluster else None
        self.discovery_interfaces = discovery_interfaces
        self._traffic_at_load: tuple[int, dict[str, int]] = (0, {})
        self.settings = settings
        self.session_factory = session_factory
        self.history_path = history_path
        self.export_dir = export_dir
        self.settings_path = settings_path
        self.model_catalog = model_catalog
        self.strategies = strategies
        self.copy_fallback = copy_fallback
        self.clock = clock
        self.spec = spec_from_settings(settings)
        self.session: ChatSession | None = None
        self.loading = False
        self.load_error: str | None = None
        self.reply: Reply | None = None
        # The last reply's figures, shown between replies (a running reply has its own).
        self.progress = ReplyProgress(n_ctx=self.spec.n_ctx)
        self.meter = SpeedMeter()
        self.log_buffer = LogBuffer()
        self.store: Store | None = None
        self.active: int | None = None
        self._engine_idle = threading.Event()
        self._engine_idle.set()
        self._closed = False
        self.set_keymap(settings.keys.keymap())

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        keys = self.settings.keys
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Label("Conversations", classes="title")
                yield ConversationList(id="conversations")
            with Vertical(id="center"):
                yield Static(id="status")
                yield ContentSwitcher(id="chats")
                yield ChatInput(
                    send_keys=keys.send,
                    newline_keys=keys.newline,
                    cursor_blink=self.settings.ui.cursor_blink,
                )
            yield StatsPanel(id="stats")
        yield Footer()

    async def on_mount(self) -> None:
        # The engine thread drops the GIL in every llama.cpp call and needs it back to go on;
        # while the UI thread draws, it waits up to the switch interval (5 ms by default, as
        # long as a whole token of a small model). 1 ms bounds that wait.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, ENGINE_GIL_WAIT_S))
        # Widgets are looked up on the chat screen itself: a modal may be on top when a
        # reply finishes or the panels' timer fires.
        self._main = self.screen
        logging.getLogger("potluck").addHandler(self.log_buffer)
        if self.settings.ui.theme in self.available_themes:
            self.theme = self.settings.ui.theme
        else:
            log.warning("unknown theme %r in the settings; using the default", self.settings.ui.theme)
        self._main.query_one(StatsPanel).display = self.settings.ui.show_panels
        try:
            self.store = Store.open(self.history_path)
        except PotluckError as e:
            self.report_error(str(e))
            self.exit(message=f"potluck: error: {e}")
            return
        conversations = self.store.conversations()
        first = conversations[0] if conversations else self._create_conversation()
        await self.open_conversation(first.id)
        self._main.query_one(ChatInput).focus()
        self.sample_stats()
        if self.settings.ui.stats_interval_s > 0:
            self.set_interval(self.settings.ui.stats_interval_s, self.sample_stats)
        self.set_interval(TEXT_PUMP_S, self._pump_reply_text)
        self.start_loading(self.spec)

    def on_unmount(self) -> None:
        sys.setswitchinterval(getattr(self, "_switch_interval", sys.getswitchinterval()))
        self.close_engine()
        logging.getLogger("potluck").removeHandler(self.log_buffer)

    def close_engine(self, timeout_s: float = 30.0) -> None:
        """Stop a running reply, wait for the engine thread, free the model, close the store."""
        if self._closed:
            return
        self._closed = True
        if self.reply is not None:
            self.reply.cancel()
        if not self._engine_idle.wait(timeout_s):
            log.error("the engine did not stop within %.0f s; leaving the model loaded", timeout_s)
        elif self.session is not None:
            self.session.close()
        if self.store is not None:
            self.store.close()

    # ------------------------------------------------------------------ helpers
    @property
    def input(self) -> ChatInput:
        return self._main.query_one(ChatInput)

    @property
    def busy(self) -> bool:
        return self.reply is not None

    def report_error(self, message: str) -> None:
        """Every failure ends here: a notification and a line in the log view, never a crash."""
        log.error("%s", message)
        self.notify(message, title="Error", severity="error", timeout=8)

    def chat_log(self, conversation_id: int | None = None) -> ChatLog | None:
        cid = self.active if conversation_id is None else conversation_id
        found = self._main.query(f"#chat-{cid}")
        return found.first(ChatLog) if found else None

    def _model_label(self) -> str:
        spec = self.spec
        name = spec.model.name if spec.model else DEFAULT_MODEL_NAME.split(" (")[0] + " (bundled)"
        draft = f" + draft {spec.draft.name}" if spec.draft else ""
        where = ""
        if self.cluster_state is not None and self.cluster_state.stages:
            where = f" · cluster of {len(self.cluster_state.stages)}"
        return f"{name} · {spec.strategy}{draft}{where}"

    def update_status(self) -> None:
        """Show what the engine is doing; called whenever that changes."""
        self.refresh_bindings()  # check_action's answer for Esc depends on self.reply
        if self.reply is not None:
            state = "generating… (Esc stops)"
        elif self.loading and self.cluster_state is not None and self.cluster_state.transfer:
            what, done, total = self.cluster_state.transfer
            state = f"sending {what}: {100 * done / total if total else 100:.0f}% of {total / 1e6:,.1f} MB…"
        elif self.loading and self.cluster is not None:
            state = f"opening the cluster ({self.cluster.describe()})…"
        elif self.loading:
            state = "loading model…"
        elif self.session is None:
            state = "no model (ctrl+o picks one)" if self.load_error else "starting…"
        else:
            state = "ready"
        self._main.query_one("#status", Static).update(f"{state} · {self._model_label()}")

    def _history(self, conv: Conversation, messages: list[StoredMessage]) -> list[Message]:
        out = [Message("system", conv.system)] if conv.system else []
        return out + [Message(m.role, m.content) for m in messages]

    def _create_conversation(self) -> Conversation:
        assert self.store is not None
        return self.store.new_conversation(NEW_TITLE, self.settings.model.system)

    async def refresh_conversations(self) -> None:
        assert self.store is not None
        await self._main.query_one(ConversationList).show(self.store.conversations(), self.active)

    async def open_conversation(self, conversation_id: int) -> None:
        """Show a conversation; its message log is built once and kept (a reply may stream
        into it while another conversation is on screen)."""
        assert self.store is not None
        switcher = self._main.query_one("#chats", ContentSwitcher)
        chat = self.chat_log(conversation_id)
        if chat is None:
            chat = ChatLog(conversation_id)
            await switcher.mount(chat)
            views = [
                MessageView(m.role, m.content, message_id=m.id, note=finish_note(m.finish_reason))
                for m in self.store.messages(conversation_id)
            ]
            if views:
                await chat.mount_all(views)
        switcher.current = chat.id
        self.active = conversation_id
        await self.refresh_conversations()
        chat.scroll_end(animate=False)
        chat.call_after_refresh(chat.follow)
        self.update_status()

    # ------------------------------------------------------------------ engine: loading
    def start_loading(self, spec: EngineSpec) -> None:
        self.loading = True
        factory = self.session_factory
        choice = self.cluster
        if choice is not None:
            reporter = LoadReporter(self.post_message)
            self.cluster_state = ClusterState()
            # A worker serves one head at a time: the old chain lets its workers go first.
            old, self.session = self.session, None

            def factory(spec: EngineSpec) -> ChatSession:  # loader thread: discovery, plan, slices
                if old is not None:
                    old.close()
                return self.session_factory(replace(spec, cluster=choice.resolve(reporter.on_plan, reporter.progress)))
        else:
            self.cluster_state = None
        self.show_cluster()
        self.update_status()
        self.run_worker(
            partial(load_in_thread, self.post_message, factory, spec),
            thread=True, group="loader", exit_on_error=False,
        )

    # ------------------------------------------------------------------ cluster
    def show_cluster(self) -> None:
        panels = self._main.query(StatsPanel)
        if panels:
            panels.first().show_cluster(self.cluster_state, self.settings.keys.replan)

    def on_cluster_planned(self, event: ClusterPlanned) -> None:
        for line in event.lines:
            log.info("%s", line)
        if self.cluster_state is not None:
            self.cluster_state = self.cluster_state.planned(event.lines, event.stages, event.head_layers)
        self.notify("\n".join(event.lines), title="Cluster plan", timeout=10)
        self.show_cluster()
        self.update_status()

    def on_slice_progress(self, event: SliceProgress) -> None:
        if self.cluster_state is not None:
            self.cluster_state = self.cluster_state.sending(event.what, event.done, event.total)
        self.show_cluster()
        self.update_status()

    def on_cluster_event(self, event: ClusterEvent) -> None:
        if self.cluster_state is None:
            return
        e, notes = event.event, event.reply.cluster_notes
        if isinstance(e, PlanChanged):
            self.cluster_state = self.cluster_state.with_plan(e)
            # The new chain was loaded with fresh slices: count bytes per token from here.
            self._traffic_at_load = traffic(self.session.cluster_view() if self.session else None)
            notes[:] = [e.reason]  # it names the node and what the head did: the one line to keep
        else:
            self.cluster_state = self.cluster_state.with_status(e)
            if e.state in ("lost", "failed") and not notes:
                notes.append(f"{e.node} {e.state}" + (f": {e.detail}" if e.detail else ""))
        if notes and event.reply.view.is_attached:  # the conversation says it, under the reply
            event.reply.view.set_note(notes[-1])
        self.show_cluster()

    def action_replan(self) -> None:
        """Reopen the session over the chosen workers (``auto``: those found now); the next
        reply replays the conversation into the new chain through the normal prefill."""
        if self.cluster is None:
            self.notify("not in cluster mode: F9 picks workers", severity="warning")
            return
        if self.reply is not None:
            self.notify("a reply is still being generated; Esc stops it", severity="warning")
            return
        self.notify(f"re-planning over {self.cluster.describe()}…")
        self.start_loading(self.spec)

    def action_cluster(self) -> None:
        if self.reply is not None:
            self.notify("wait for the reply (or Esc) before changing workers", severity="warning")
            return
        self.run_worker(self._open_cluster_picker(), group="picker", exclusive=True)

    async def _open_cluster_picker(self) -> None:
        stages = self.cluster_state.stages if self.cluster_state else ()
        choice = await self.push_screen_wait(
            ClusterScreen(self.discovery_interfaces, {r.address for r in stages}, self.cluster)
        )
        if choice is None:
            return
        if isinstance(choice, LocalChoice):
            if self.cluster is None:
                return
            self.cluster = None
        else:
            self.cluster = choice
        self.start_loading(self.spec)

    def on_session_loaded(self, event: SessionLoaded) -> None:
        self.loading = False
        if self.cluster_state is not None:
            c = self.cluster_state
            self.cluster_state = ClusterState(
                plan=c.plan, stages=c.stages, sent_bytes=c.sent_bytes, cached_bytes=c.cached_bytes,
                head_layers=c.head_layers,
            )
        if event.error is not None:
            self.load_error = event.error
            self.report_error(f"could not load the model: {event.error}")
        elif event.session is not None:
            if self.cluster_state is not None:
                view = event.session.cluster_view()
                self.cluster_state = self.cluster_state.loaded(stages_of(view), view.head_layers if view else None)
                self._traffic_at_load = traffic(view)
            old, self.session, self.spec, self.load_error = self.session, event.session, event.spec, None
            if old is not None:
                old.close()
            log.info("model ready: %s", self._model_label())
            self.progress, self.meter = ReplyProgress(n_ctx=event.spec.n_ctx), SpeedMeter()
            self.sample_stats()
        self.show_cluster()
        self.update_status()

    # ------------------------------------------------------------------ engine: replies
    def _start_reply(self, reply: Reply, history: list[Message]) -> None:
        reply.session.load_messages(history)
        reply.progress = self.progress  # until the engine says the reply started
        self.reply = reply
        self._engine_idle.clear()
        self.update_status()
        self.run_worker(
            partial(
                reply_in_thread, self.post_message, reply, self.settings.sampling, self.clock, self._engine_idle
            ),
            thread=True, group="engine", exit_on_error=False,
        )

    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> bool:
        """Send the input as a user message; on refusal the text stays in the input."""
        if not text.strip():
            return False
        if self.reply is not None:
            self.notify("a reply is still being generated; Esc stops it", severity="warning")
            return False
        if self.session is None:
            why = "the model is still loading" if self.loading else "no model is loaded"
            self.notify(f"cannot send: {why}", severity="warning")
            return False
        assert self.store is not None and self.active is not None
        conv = self.store.conversation(self.active)
        assert conv is not None
        history = self._history(conv, self.store.messages(conv.id))
        stored = self.store.add_message(conv.id, "user", text)
        if conv.title == NEW_TITLE:
            self.store.rename(conv.id, _title_from(text))
        self.input.clear()
        chat = self.chat_log()
        assert chat is not None
        user_view = MessageView("user", text, message_id=stored.id)
        reply_view = MessageView("assistant", streaming=True)
        await chat.mount_all([user_view, reply_view])
        chat.scroll_end(animate=False)
        chat.call_after_refresh(chat.follow)
        reply = Reply(conv.id, self.session, reply_view, text, user_view, stored.id)
        self._start_reply(reply, history)
        await self.refresh_conversations()
        return True

    async def _pump_reply_text(self) -> None:
        """Draw what the engine streamed since the last tick (a few times a second, so a
        fast engine never floods the event loop with one repaint per token)."""
        reply = self.reply
        if reply is None:
            return
        text = reply.take()
        if text:
            reply.got_text = True
            if reply.view.is_attached:
                await reply.view.append(text)
        if self.store is not None:
            checkpoint_reply(self.store, reply)  # a crash loses at most SAVE_EVERY_S of it

    async def on_reply_finished(self, event: ReplyFinished) -> None:
        reply, f = event.reply, event.finished
        await self._pump_reply_text()
        self.reply, self.progress = None, reply.progress
        note = finish_note(f.reason, "; ".join(reply.cluster_notes))
        assert self.store is not None
        if self.store.conversation(reply.conversation_id) is not None:
            stored = self.store.add_message(
                reply.conversation_id,
                "assistant",
                f.text,
                finish_reason=f.reason,
                strategy=f.strategy,
                n_tokens=len(f.tokens),
                tokens_per_s=f.tokens_per_s,
                acceptance_rate=f.acceptance_rate,
                replaces=reply.replaces,
            )
            reply.view.message_id = stored.id
        if reply.view.is_attached:
            await reply.view.finish(f.text, note)
        self.sample_stats()
        self.update_status()
        await self.refresh_conversations()

    def on_cluster_notice(self, event: ClusterNotice) -> None:
        """A worker was lost mid-reply and the head re-planned: say so, the reply goes on."""
        log.warning("%s", event.text)
        self.notify(event.text, title="Cluster", severity="warning", timeout=8)

    async def on_reply_failed(self, event: ReplyFailed) -> None:
        reply = event.reply
        await self._pump_reply_text()
        self.reply, self.progress = None, reply.progress
        self.report_error(event.error)
        # In cluster mode the error names the stage that was lost or froze: the panel marks it
        # and the kept reply says it, so the conversation shows why it stopped.
        detail = ""
        if self.cluster_state is not None:
            self.cluster_state = self.cluster_state.failed(event.error)
            detail = event.error
            self.show_cluster()
        assert self.store is not None
        if reply.user_text is not None and not reply.got_text:
            # Nothing was generated: undo the send and give the text back for editing.
            if reply.user_message_id is not None:
                self.store.delete_message(reply.user_message_id)
            for view in (reply.user_view, reply.view):
                if view is not None and view.is_attached:
                    await view.remove()
            if not self.input.text:
                self.input.text = reply.user_text
        elif reply.user_text is None and not reply.got_text:
            if reply.view.is_attached:
                await reply.view.finish(reply.previous_text, reply.previous_note)
        else:
            text = reply.view.content
            if self.store.conversation(reply.conversation_id) is not None:
                self.store.add_message(
                    reply.conversation_id, "assistant", text, finish_reason="error",
                    replaces=reply.replaces,
                )
            if reply.view.is_attached:
                await reply.view.finish(text, finish_note("error", detail))
        self.update_status()

    # ------------------------------------------------------------------ panels
    def sample_stats(self, now: float | None = None) -> None:
        """Timer callback: redraw the panels from the latest reply's progress (never per token)."""
        panels = self._main.query(StatsPanel)
        if not panels:
            return  # shutting down
        if self.session is None:
            figures = Figures()
        else:
            progress = self.reply.progress if self.reply is not None else self.progress
            figures = self.meter.sample(progress, self.clock() if now is None else now)
        if self.cluster_state is not None and self.session is not None:
            now = traffic(self.session.cluster_view() if self.session else None)
            self.cluster_state = self.cluster_state.with_bytes(bytes_per_token(now, self._traffic_at_load))
            self.show_cluster()
        try:
            panels.first().show(figures)
        except NoMatches:
            pass  # the screen is being torn down

    def action_toggle_panels(self) -> None:
        panel = self._main.query_one(StatsPanel)
        panel.display = not panel.display

    # ------------------------------------------------------------------ actions
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.reply is not None
        return True

    def action_stop(self) -> None:
        """Esc: the engine stops after its current step; the partial reply is kept."""
        if self.reply is None:
            return
        self.reply.cancel()
        if self.reply.view.is_attached:
            self.reply.view.set_note("stopping…")

    async def action_regenerate(self) -> None:
        if self.reply is not None:
            self.notify("a reply is still being generated; Esc stops it", severity="warning")
            return
        if self.session is None or self.store is None or self.active is None:
            self.notify("no model is loaded", severity="warning")
            return
        conv = self.store.conversation(self.active)
        messages = self.store.messages(self.active)
        chat = self.chat_log()
        views = chat.messages() if chat else []
        if conv is None or not messages or messages[-1].role != "assistant" or not views:
            self.notify("there is no reply to regenerate", severity="warning")
            return
        view = views[-1]
        reply = Reply(
            conv.id, self.session, view, None, replaces=messages[-1].id,
            previous_text=view.content, previous_note=view._note,
        )
        await view.restart()
        self._start_reply(reply, self._history(conv, messages))

    async def action_new_conversation(self) -> None:
        assert self.store is not None
        if self.active is not None and not self.store.messages(self.active):
            self.input.focus()  # already on an empty conversation
            return
        conv = self._create_conversation()
        await self.open_conversation(conv.id)
        self.input.focus()

    async def on_conversation_list_opened(self, event: ConversationList.Opened) -> None:
        if event.conversation_id != self.active:
            await self.open_conversation(event.conversation_id)
        self.input.focus()

    async def _step_conversation(self, delta: int) -> None:
        assert self.store is not None
        ids = [c.id for c in self.store.conversations()]
        if self.active in ids and len(ids) > 1:
            await self.open_conversation(ids[(ids.index(self.active) + delta) % len(ids)])

    async def action_previous_conversation(self) -> None:
        await self._step_conversation(-1)

    async def action_next_conversation(self) -> None:
        await self._step_conversation(1)

    def action_rename_conversation(self) -> None:
        assert self.store is not None and self.active is not None
        conv = self.store.conversation(self.active)
        if conv is None:
            return

        async def done(title: str | None) -> None:
            if title and title.strip() and self.store is not None:
                self.store.rename(conv.id, title.strip())
                await self.refresh_conversations()

        self.push_screen(TextPromptScreen("Rename conversation", conv.title), done)

    def action_delete_conversation(self) -> None:
        assert self.store is not None and self.active is not None
        conv = self.store.conversation(self.active)
        if conv is None:
            return

        async def done(yes: bool | None) -> None:
            if yes:
                await self.delete_conversation(conv.id)

        self.push_screen(ConfirmScreen(f"Delete “{conv.title}” and its messages?"), done)

    async def delete_conversation(self, conversation_id: int) -> None:
        assert self.store is not None
        if self.reply is not None and self.reply.conversation_id == conversation_id:
            self.reply.cancel()
        self.store.delete(conversation_id)
        chat = self.chat_log(conversation_id)
        if chat is not None:
            await chat.remove()
        rest = self.store.conversations()
        await self.open_conversation((rest[0] if rest else self._create_conversation()).id)

    def action_system_prompt(self) -> None:
        assert self.store is not None and self.active is not None
        conv = self.store.conversation(self.active)
        if conv is None:
            return

        def done(text: str | None) -> None:
            if text is not None and self.store is not None:
                self.store.set_system(conv.id, text.strip() or None)
                self.notify("system prompt saved; it applies from the next message")

        self.push_screen(
            TextPromptScreen("System prompt", conv.system or "", multiline=True), done
        )

    def action_picker(self) -> None:
        if self.reply is not None:
            self.notify("wait for the reply (or Esc) before switching models", severity="warning")
            return
        self.run_worker(self._open_picker(), group="picker", exclusive=True)

    async def _open_picker(self) -> None:
        models = await self._in_thread(self.model_catalog)
        spec = self.spec
        current = next((m for m in models if m.key == (str(spec.model) if spec.model else "")), None)
        if current is None:
            current = read_model_info(spec.model)
            models.insert(0, current)
        kept = self.settings.model.draft  # offered again even while the strategy ignores it
        kept_key = str(Path(os.path.expanduser(kept))) if kept else None
        draft = next((m for m in models if kept_key and m.key == kept_key), None)
        pick = await self.push_screen_wait(
            PickerScreen(models, self.strategies, Pick(current, draft, spec.strategy))
        )
        if pick is not None:
            self.apply_pick(pick)

    async def _in_thread(self, fn: Callable[[], list[ModelInfo]]) -> list[ModelInfo]:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, fn)

    def apply_pick(self, pick: Pick) -> None:
        """Load the picked combination; remember it in config.toml once it loads."""
        m = self.settings.model
        model_path = str(pick.model.path) if pick.model.path else None
        draft_path = str(pick.draft.path) if pick.draft and pick.draft.path else None
        self.settings = replace(
            self.settings,
            model=replace(m, path=model_path, draft=draft_path, strategy=pick.strategy),
        )
        try:
            spec = spec_from_settings(self.settings)  # the same checks as at start
        except PotluckError as e:
            self.report_error(str(e))
            return
        if self.settings_path is not None:
            try:
                save_settings(self.settings, self.settings_path)
            except OSError as e:
                self.report_error(f"could not save the settings: {e}")
        self.start_loading(spec)

    # ------------------------------------------------------------------ copy / export / log
    def _last_reply_view(self) -> MessageView | None:
        chat = self.chat_log()
        replies = [v for v in chat.messages() if v.role == "assistant"] if chat else []
        return replies[-1] if replies else None

    def action_copy_reply(self) -> None:
        view = self._last_reply_view()
        if view is None or not view.content:
            self.notify("no reply to copy", severity="warning")
            return
        self.copy_text(view.content, "reply")

    def action_copy_code(self) -> None:
        chat = self.chat_log()
        for view in reversed(chat.messages() if chat else []):
            blocks = code_blocks(view.content)
            if blocks:
                self.copy_text(blocks[-1], "code block")
                return
        self.notify("no code block in this conversation", severity="warning")

    def on_message_view_copy_requested(self, event: MessageView.CopyRequested) -> None:
        self.copy_text(event.text, event.what)

    def copy_text(self, text: str, what: str) -> None:
        """OSC 52 to the terminal, and the fallback (system tool or file) off the UI thread."""
        self.copy_to_clipboard(text)

        def fallback() -> None:
            try:
                where = self.copy_fallback(text)
            except OSError as e:
                where = f"fallback failed: {e}"
            self.call_from_thread(
                self.notify, f"copied {what} ({len(text)} characters) · also in {where}"
            )

        self.run_worker(fallback, thread=True, group="clipboard", exit_on_error=False)

    def action_export(self) -> Path | None:
        assert self.store is not None and self.active is not None
        conv = self.store.conversation(self.active)
        if conv is None:
            return None
        path = export_path(self.export_dir, conv)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(conversation_markdown(conv, self.store.messages(conv.id)), "utf-8")
        except OSError as e:
            self.report_error(f"could not export: {e}")
            return None
        self.notify(f"exported to {path}")
        return path

    def action_log(self) -> None:
        self.push_screen(LogScreen(list(self.log_buffer.lines)))


def _title_from(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else NEW_TITLE
    return line if len(line) <= 40 else line[:39] + "…"


def build_app(
    *,
    settings: Settings,
    session_factory: SessionFactory,
    history_path: Path | None = None,
    export_dir: Path | None = None,
    settings_path: Path | None = None,
    model_catalog: Callable[[], list[ModelInfo]] | None = None,
    strategies: Mapping[str, StrategyClass] | None = None,
    copy_fallback: Callable[[str], str] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    cluster: ClusterChoice | None = None,
    discovery_interfaces: tuple[str, ...] | None = None,
) -> PotluckApp:
    """Build the chat app from explicit arguments; the CLI and every test call this.

    Unset locations come from :mod:`potluck.engine.core.paths` (XDG, or the tests' override);
    ``settings_path=None`` means the picker's choice is not saved.
    """
    from ...engine import STRATEGIES, paths
    from .clipboard import system_clipboard

    if export_dir is None:
        export_dir = (
            Path(settings.ui.export_dir).expanduser() if settings.ui.export_dir else paths.exports_dir()
        )
    m = settings.model
    return PotluckApp(
        settings=settings,
        session_factory=session_factory,
        history_path=history_path or paths.history_db(),
        export_dir=export_dir,
        settings_path=settings_path,
        model_catalog=model_catalog or (lambda: gather_models(m.path, m.draft, m.library)),
        strategies=strategies if strategies is not None else STRATEGIES,
        copy_fallback=copy_fallback
        or (lambda text: system_clipboard(text, paths.state_dir() / "clipboard.txt")),
        clock=clock,
        cluster=cluster,
        discovery_interfaces=discovery_interfaces,
    )
