"""The potluck chat app and its factory.

After posting: the CLI only parses arguments, :func:`build_app` builds the app from
explicit arguments (settings, a session factory, the history file), and the tests build
it the same way with a scripted fake session. The engine runs in worker threads
(:mod:`.replies`); this module holds the app's state, its layout, loading and the panels,
and takes its other handlers from three mixins: replies (:mod:`.reply_handlers`), cluster
mode (:mod:`.cluster_handlers`) and the other keys (:mod:`.actions`).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path

from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import ContentSwitcher, Label, Static

from ...assets import DEFAULT_MODEL_NAME, asset
from ...engine import EngineSpec, PotluckError, PrintableFormatter
from ..config import Settings, spec_from_settings
from ..store import Store
from .actions import ConversationActions
from .catalog import ModelInfo, StrategyClass, gather_models
from .cluster import (
    ClusterChoice,
    ClusterState,
    LoadReporter,
    bytes_per_token,
    stages_of,
    traffic,
)
from .cluster_handlers import ClusterHandlers
from .commands import AppCommands
from .context import context_note
from .replies import (
    ChatSession,
    Reply,
    SessionFactory,
    SessionLoaded,
    load_in_thread,
)
from .reply_handlers import ReplyHandlers
from .settings import conversation_sampling, sampling_summary
from .stats import Figures, ReplyProgress, SpeedMeter
from .widgets import (
    ChatInput,
    ChatLog,
    ConversationList,
    FirstSteps,
    KeysFooter,
    MessageView,
    StatsPanel,
    finish_note,
)

log = logging.getLogger(__name__)

# How often streamed text is drawn. Each repaint takes the UI thread from one of llama.cpp's
# threads on a 2-core machine, which stalls both at the next barrier: in tmux at 120x40 the
# bundled model's reply came at 0.78x of `generate` drawing 20 times a second and laying out
# 4, 0.82x at 10 and 2 (docs/facts.md §26).
TEXT_PUMP_S = 1 / 10
ENGINE_GIL_WAIT_S = 0.001  # the longest the engine thread waits for the GIL while the UI draws
READING_SHOWN_FROM = 256  # prompt tokens: a shorter prompt is read before anyone looks


class LogBuffer(logging.Handler):
    """Keeps this run's warnings and errors for the log view."""

    def __init__(self, capacity: int = 500) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.capacity = capacity
        self.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
        del self.lines[: -self.capacity]


def _b(keys: str, action: str, description: str, show: bool = True, **kw: object) -> Binding:
    return Binding(keys, action, description, show=show, id=action, **kw)  # type: ignore[arg-type]


class PotluckApp(ReplyHandlers, ClusterHandlers, ConversationActions, App[None]):
    CSS_PATH = str(asset("potluck.tcss"))
    COMMANDS = App.COMMANDS | {AppCommands}
    TITLE = "potluck"
    # Binding ids are KeySettings field names, so [keys] in config.toml remaps them.
    # The footer shows the first ones that fit; F1 lists them all (HelpScreen).
    BINDINGS = [
        _b("ctrl+q", "quit", "Quit", priority=True),
        _b("escape", "stop", "Stop/Input"),  # stops a reply; otherwise back to the input
        _b("f1", "help", "Help"),
        _b("ctrl+o", "picker", "Model"),
        _b("f6", "settings", "Settings"),
        _b("ctrl+r", "regenerate", "Regen"),
        _b("ctrl+n", "new_conversation", "New"),
        _b("ctrl+f", "search", "Search"),
        # priority: in a real terminal alt+e arrives with the character "e", which the input
        # would take as text before the app saw the binding
        _b("alt+left", "previous_answer", "Older", show=False, priority=True),
        _b("alt+right", "next_answer", "Newer", show=False, priority=True),
        _b("alt+e", "edit_prompt", "Edit", show=False, priority=True),
        _b("f2", "rename_conversation", "Rename"),
        _b("f8", "delete_conversation", "Delete"),
        _b("ctrl+pageup,alt+up", "previous_conversation", "Previous", show=False),
        _b("ctrl+pagedown,alt+down", "next_conversation", "Next", show=False),
        _b("f4", "system_prompt", "System"),
        _b("f9", "cluster", "Cluster"),
        _b("ctrl+g", "replan", "Re-plan", show=False),
        _b("ctrl+t", "toggle_panels", "Panels"),
        _b("f3", "copy_reply", "Copy"),
        _b("f5", "copy_code", "Copy code"),
        _b("ctrl+s", "export", "Export"),
        _b("ctrl+l", "log", "Log"),
    ]
    # Below these widths the side panels fold away (the chat keeps the screen).
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]

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
        self.queued: tuple[int, int] | None = None
        self._shown_reading: tuple[int, int] | None = None
        self.editing: int | None = None
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
                yield Static(id="status", markup=False)  # it names model files: never markup
                yield ContentSwitcher(id="chats")
                yield ChatInput(
                    send_keys=keys.send,
                    newline_keys=keys.newline,
                    cursor_blink=self.settings.ui.cursor_blink,
                )
            yield StatsPanel(id="stats")
        yield KeysFooter()

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
        self._main.set_class(not self.settings.ui.show_panels, "-hide-panels")
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
        self.input.recall = lambda: self.store.recent_prompts() if self.store else []
        self.sample_stats()
        if self.settings.ui.stats_interval_s > 0:
            self.set_interval(self.settings.ui.stats_interval_s, self.sample_stats)
        self.set_interval(TEXT_PUMP_S, self._pump_reply_text)
        self.start_loading(self.spec)

    def on_unmount(self) -> None:
        sys.setswitchinterval(getattr(self, "_switch_interval", sys.getswitchinterval()))
        gc.enable()  # off while a reply runs (ReplyHandlers._start_reply); the app may close mid-reply
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
        self.notify(message, title="Error", severity="error", timeout=8, markup=False)  # it may quote a worker

    def chat_log(self, conversation_id: int | None = None) -> ChatLog | None:
        cid = self.active if conversation_id is None else conversation_id
        found = self._main.query(f"#chat-{cid}")
        return found.first(ChatLog) if found else None

    def _model_label(self) -> str:
        spec = self.spec
        name = spec.model.name if spec.model else DEFAULT_MODEL_NAME
        draft = f" + draft {spec.draft.name}" if spec.draft else ""
        where = ""
        if self.cluster_state is not None and self.cluster_state.stages:
            where = f" · cluster of {len(self.cluster_state.stages)}"
        return f"{name} · {spec.strategy}{draft}{where}"

    def update_status(self) -> None:
        """Show what the engine is doing; called whenever that changes."""
        self.refresh_bindings()  # check_action's answer for Esc depends on self.reply
        if self.reply is not None:
            reading = self._reading_prompt()
            if reading is None:
                state = "generating… (Esc stops)"
            elif reading[0]:
                state = f"reading the prompt: {reading[0]:,} of {reading[1]:,} tokens… (Esc stops)"
            else:
                state = f"reading the prompt: {reading[1]:,} tokens… (Esc stops)"
            if self.cluster_state is not None and self.cluster_state.recovering:
                state = "a worker was lost: recovering… (Esc stops)"
        elif self.loading and self.cluster_state is not None and self.cluster_state.transfer:
            what, done, total = self.cluster_state.transfer
            state = f"sending {what}: {100 * done / total if total else 100:.0f}% of {total / 1e6:,.1f} MB…"
        elif self.loading and self.cluster is not None:
            state = f"opening the cluster ({self.cluster.describe()})…"
        elif self.loading:
            state = "loading model…"
        elif self.session is None:
            state = f"no model ({self._key('picker')} picks one)" if self.load_error else "starting…"
        elif self.editing is not None:
            state = "editing a sent prompt: Enter resends from there, Esc cancels"
        else:
            state = "ready"
        if self.queued is not None and self.loading:
            state += " · your message waits"
        line = f"{state} · {self._model_label()} · {self._sampling_label()}"
        for status in self._main.query("#status").results(Static):  # none while the app closes
            status.update(line)

    def _reading_prompt(self) -> tuple[int, int] | None:
        """(tokens read, tokens to read) of the prompt the engine is reading now, when there
        are enough to wait for; read is 0 where the session cannot say (cluster heads, fakes)."""
        p = self.reply.progress if self.reply is not None else None
        if p is None or not p.running or p.first_token_at or p.rounds:
            return None
        todo = p.prompt_tokens - p.n_past
        if todo < READING_SHOWN_FROM:
            return None
        progress = getattr(self.reply.session, "prompt_progress", None) if self.reply else None
        done, total = progress() if progress is not None else (0, 0)
        return (done, total) if total else (0, todo)

    def _sampling_label(self) -> str:
        """The sampling the active conversation's next reply uses (config.toml's, or its own)."""
        conv = self.store.conversation(self.active) if self.store and self.active is not None else None
        sampling = conversation_sampling(self.settings.sampling, conv.params) if conv else self.settings.sampling
        return sampling_summary(sampling)

    def _key(self, action: str) -> str:
        """The key of an action as the user set it (the first of several)."""
        keys = getattr(self.settings.keys, action, "")
        return keys.split(",")[0].strip() if keys else action

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
            await self._fill(chat)
        switcher.current = chat.id
        self.active = conversation_id
        if self.editing is not None:
            self.editing = None
            self.input.clear()
        await self.refresh_conversations()
        chat.scroll_end(animate=False)
        chat.call_after_refresh(chat.follow)
        self.update_status()

    async def _fill(self, chat: ChatLog, focus: int | None = None) -> None:
        """Mount the active path's messages, and the line where the last cut began."""
        assert self.store is not None
        path = self.store.messages(chat.conversation_id)
        views = [
            MessageView(
                m.role, m.content, message_id=m.id, note=finish_note(m.finish_reason), variant=(m.variant, m.variants)
            )
            for m in path
        ]
        if not views:
            views = [FirstSteps(self.settings.keys)]
        await chat.mount_all(views)
        last = next((m for m in reversed(path) if m.role == "assistant"), None)
        if last is not None and last.context_from is not None:
            dropped = next((i for i, m in enumerate(path) if m.id == last.context_from), 0)
            await chat.show_context(last.context_from, context_note(dropped, self.spec.n_ctx, self._key("settings")))
        for view in chat.messages():
            if focus is not None and view.message_id == focus:
                view.focus()

    async def show_path(self, conversation_id: int, focus: int | None = None) -> None:
        """Redraw a conversation after its active path changed (another answer, an edit)."""
        chat = self.chat_log(conversation_id)
        if chat is None:
            return
        await chat.remove_children()
        await self._fill(chat, focus)
        if focus is None:
            chat.scroll_end(animate=False)
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
            self.queued_failed(event.error)
        elif event.session is not None:
            if self.cluster_state is not None:
                view = event.session.cluster_view()
                self.cluster_state = self.cluster_state.loaded(
                    stages_of(view), view.head_layers if view else None, view.experts if view else (0, 0, 0))
                self._traffic_at_load = traffic(view)
            old, self.session, self.spec, self.load_error = self.session, event.session, event.spec, None
            if old is not None:
                old.close()
            log.info("model ready: %s", self._model_label())
            self.progress, self.meter = ReplyProgress(n_ctx=event.spec.n_ctx), SpeedMeter()
            self.sample_stats()
        self.show_cluster()
        self.update_status()
        if self.session is not None and self.queued is not None:
            self.call_later(self.answer_queued)

    # ------------------------------------------------------------------ panels
    def sample_stats(self, now: float | None = None) -> None:
        """Timer callback: redraw the panels from the latest reply's progress (never per token)."""
        panels = self._main.query(StatsPanel)
        if not panels:
            return  # shutting down
        reading = self._reading_prompt()
        if reading != self._shown_reading:  # the prompt's reading began, went on or ended: say so
            self._shown_reading = reading
            self.update_status()
        if self.session is None:
            figures = Figures()
        else:
            progress = self.reply.progress if self.reply is not None else self.progress
            figures = self.meter.sample(progress, self.clock() if now is None else now)
        if self.cluster_state is not None and self.session is not None:
            view = self.session.cluster_view()
            now = traffic(view)
            was = self.cluster_state
            self.cluster_state = was.with_bytes(bytes_per_token(now, self._traffic_at_load))
            if view is not None and view.health and self.reply is not None:
                self.cluster_state = self.cluster_state.with_health(view.health)
                if self.cluster_state.recovering != was.recovering:
                    self.update_status()
            self.show_cluster()
        try:
            panels.first().show(figures)
        except NoMatches:
            pass  # the screen is being torn down

    def action_toggle_panels(self) -> None:
        """Show or hide the side panels (below 100 columns they are folded away until asked)."""
        main = self._main
        if main.has_class("-narrow"):
            main.toggle_class("-show-panels")
        else:
            main.toggle_class("-hide-panels")

    # ------------------------------------------------------------------ actions
    def on_key(self, event: events.Key) -> None:
        """Keys no widget took: ``?`` opens the help; a printable key typed outside the input
        goes to the input (after Shift+Tab into the messages, letters were silently lost)."""
        if self.screen is not self._main or event.key in self.screen.active_bindings:
            return  # a key the focused widget binds (y, b, e on a message) is its own
        if event.character == "?":
            event.stop()
            self.action_help()
        elif event.is_printable and event.character and not isinstance(self.focused, ChatInput):
            event.stop()
            self.input.focus()
            self.input.insert(event.character)



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
