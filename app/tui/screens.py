"""Modal screens: model / strategy picker, text prompts (rename, system prompt), confirm, log."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Input, Label, OptionList, RichLog, SelectionList, Static, TextArea
from textual.widgets.option_list import Option
from textual.widgets.selection_list import Selection

from ...discovery.lan import DiscoveredNode, Membership
from ...engine import JOIN_TIMEOUT_S, printable
from ..store import SearchHit
from .catalog import ModelInfo, StrategyClass, compatible_choices, read_model_info
from .cluster import ClusterChoice

NO_DRAFT = "(no draft)"


def steady_cursors(screen: Screen) -> None:
    """A dialog's text fields blink as the chat's input does ([ui] cursor_blink: the snapshot
    tests turn it off, or a field drew its cursor or not by the clock)."""
    blink = getattr(getattr(screen.app, "settings", None), "ui", None)
    for field in screen.query("Input, TextArea"):
        field.cursor_blink = blink.cursor_blink if blink is not None else True  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Pick:
    """The picker's answer: what the next session should load."""

    model: ModelInfo
    draft: ModelInfo | None
    strategy: str


class PickerScreen(ModalScreen[Pick | None]):
    """Choose model, draft and strategy; only combinations that work are listed."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Cancel"),
        Binding("ctrl+s", "apply", "Apply"),
    ]

    def __init__(
        self,
        models: list[ModelInfo],
        strategies: Mapping[str, StrategyClass],
        current: Pick,
    ) -> None:
        super().__init__(classes="modal")
        self.models = [m for m in models if not m.error]
        self.unreadable = [m for m in models if m.error]
        self.strategies = strategies
        self.model = current.model
        self.draft = current.draft
        self.strategy = current.strategy

    def compose(self) -> ComposeResult:
        with Vertical(id="picker", classes="dialog"):
            yield Label("Model and decoding strategy", classes="title")
            with VerticalScroll(classes="dialog-body"):
                with Horizontal(id="picker-lists"):
                    with Vertical():
                        yield Label("Model")
                        yield OptionList(id="pick-model")
                    with Vertical():
                        yield Label("Draft (same vocabulary)")
                        yield OptionList(id="pick-draft")
                    with Vertical():
                        yield Label("Strategy")
                        yield OptionList(id="pick-strategy")
                yield Static(id="picker-hidden", classes="hint")
            yield Input(placeholder="or open a GGUF by path: ~/models/model.gguf (Enter)", id="pick-path")
            with Horizontal(classes="buttons"):
                yield Button("Cluster… (F9)", id="cluster")
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        steady_cursors(self)
        self._refresh_lists()
        self.query_one("#pick-model", OptionList).focus()

    def _refresh_lists(self) -> None:
        choices = compatible_choices(self.model, self.models, self.draft, self.strategies)
        if self.draft is not None and all(d.key != self.draft.key for d in choices.drafts):
            self.draft = None
            choices = compatible_choices(self.model, self.models, None, self.strategies)
        if self.strategy not in choices.strategies:
            self.strategy = choices.strategies[0] if choices.strategies else ""

        # Option ids are positions, never model keys: the bundled model's key is "" like
        # "(no draft)", and two equal ids make Textual's OptionList raise DuplicateID.
        def fill(list_id: str, rows: list[tuple[str, str]], selected: int) -> None:
            ol = self.query_one(list_id, OptionList)
            ol.clear_options()
            ol.add_options(
                [  # file names may hold markup's brackets: plain text
                    Option(Text(("● " if i == selected else "  ") + printable(text)), id=row_id)
                    for i, (row_id, text) in enumerate(rows)
                ]
            )
            if 0 <= selected < len(rows):
                ol.highlighted = selected

        self._rows_model = list(self.models)
        fill(
            "#pick-model",
            [(f"model-{i}", m.label) for i, m in enumerate(self._rows_model)],
            _index_of(self._rows_model, self.model),
        )
        self._rows_draft = [None, *choices.drafts]
        fill(
            "#pick-draft",
            [("draft-none", NO_DRAFT)] + [(f"draft-{i}", d.label) for i, d in enumerate(choices.drafts, 1)],
            _index_of(self._rows_draft, self.draft),
        )
        self._rows_strategy = list(choices.strategies)
        strategy_rows = [
            (f"strategy-{i}", f"{name} — {self.strategies[name].description}")
            for i, name in enumerate(self._rows_strategy)
        ]
        fill("#pick-strategy", strategy_rows, _index_of(self._rows_strategy, self.strategy))
        hidden = [f"not offered: {line}" for line in choices.hidden]
        hidden += [f"unreadable: {m.name}: {m.error}" for m in self.unreadable]
        self.query_one("#picker-hidden", Static).update("\n".join(hidden))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        i = event.option_index
        if event.option_list.id == "pick-model":
            self.model = self._rows_model[i]
        elif event.option_list.id == "pick-draft":
            self.draft = self._rows_draft[i]
        else:
            self.strategy = self._rows_strategy[i]
        self._refresh_lists()
        self.focus_next()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """A GGUF by path: read its header (fast, no weights) and make it the target."""
        event.stop()
        text = event.value.strip()
        if not text:
            return
        path = Path(text).expanduser()
        if not path.is_file():
            self.notify(f"no such file: {path}", severity="error")
            return
        info = read_model_info(path)
        if info.error:
            self.notify(f"{path.name}: {info.error}", severity="error")
            return
        known = next((m for m in self.models if m.key == info.key), None)
        if known is None:
            self.models.append(info)
        self.model = known or info
        event.input.value = ""
        self._refresh_lists()
        self.query_one("#pick-model", OptionList).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self.action_apply()
        elif event.button.id == "cluster":  # where the target's layers run: the cluster picker
            self.dismiss(None)
            self.app.call_later(self.app.run_action, "cluster")
        else:
            self.dismiss(None)

    def action_apply(self) -> None:
        if not self.strategy:
            self.notify("no strategy works with this model", severity="error")
            return
        self.dismiss(Pick(self.model, self.draft, self.strategy))


def _index_of(rows: list, wanted: object) -> int:
    """Where ``wanted`` is among a list's rows (models compare by key, None by itself), or -1."""
    def key(row: object) -> object:
        return ("none",) if row is None else getattr(row, "key", row)

    return next((i for i, row in enumerate(rows) if key(row) == key(wanted)), -1)


class TextPromptScreen(ModalScreen[str | None]):
    """Ask for one line (rename) or several (system prompt); None when cancelled."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, title: str, value: str, *, multiline: bool = False) -> None:
        super().__init__(classes="modal")
        self.title_text = title
        self.value = value
        self.multiline = multiline

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="title")
            if self.multiline:
                yield TextArea(self.value, id="prompt-text", soft_wrap=True, tab_behavior="focus")
                yield Static("ctrl+s saves, Esc cancels", classes="hint")
            else:
                yield Input(self.value, id="prompt-text")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        steady_cursors(self)
        self.query_one("#prompt-text").focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_save(self) -> None:
        widget = self.query_one("#prompt-text")
        self.dismiss(widget.text if isinstance(widget, TextArea) else widget.value)  # type: ignore[union-attr]


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("escape", "dismiss(False)", "Cancel"), Binding("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str) -> None:
        super().__init__(classes="modal")
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, classes="title")
            with Horizontal(classes="buttons"):
                yield Button("Delete", variant="error", id="yes")
                yield Button("Cancel", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class LogScreen(ModalScreen[None]):
    """Warnings and errors of this run (also written to ``potluck locate``'s log file)."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, lines: list[str]) -> None:
        super().__init__(classes="modal")
        self.lines = lines

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="log-dialog"):
            yield Label("Log", classes="title")
            yield RichLog(id="log-view", wrap=True, markup=False, highlight=False)

    def on_mount(self) -> None:
        log = self.query_one(RichLog)
        for line in self.lines or ["(nothing logged)"]:
            log.write(line)


@dataclass(frozen=True)
class LocalChoice:
    """The cluster picker's "run on this PC" answer."""


class ClusterScreen(ModalScreen["ClusterChoice | LocalChoice | None"]):
    """Workers found on the LAN right now (zeroconf, live): choose the ones to split over."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Cancel"),
        Binding("ctrl+s", "use", "Use selected"),
    ]

    def __init__(
        self, interfaces: tuple[str, ...] | None, in_use: set[str], current: ClusterChoice | None = None,
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:
        super().__init__(classes="modal")
        self.interfaces = interfaces
        self.in_use = in_use
        self.current = current  # its token settings carry over to the new choice
        self.join_timeout_s = join_timeout_s  # [cluster] join_timeout_s
        self.found: dict[str, DiscoveredNode] = {}
        self._membership: Membership | None = None
        self._offered: set[str] = set()  # what the list last offered selected
        self._touched = False  # the user changed that: workers found later come unselected

    def compose(self) -> ComposeResult:
        with Vertical(id="cluster-picker", classes="dialog"):
            yield Label("Cluster: workers on the LAN", classes="title")
            yield Static(CLUSTER_HEADER, id="cluster-header", classes="hint")
            yield SelectionList[str](id="cluster-nodes")
            yield Static("looking for workers…", id="cluster-hint", classes="hint")
            with Horizontal(classes="buttons"):
                yield Button("Use selected", variant="primary", id="use")
                yield Button("Run on this PC", id="local")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#cluster-nodes", SelectionList).focus()
        self.run_worker(self._browse, thread=True, group="browse", exit_on_error=False)

    def _browse(self) -> None:  # worker thread: zeroconf calls back on its own threads
        try:
            self._membership = Membership(
                interfaces=list(self.interfaces) if self.interfaces else None,
                on_change=lambda _kind, _node: self.app.call_from_thread(self._refresh),
            )
        except Exception as e:  # no network interface, zeroconf refused: say so, stay usable
            self.app.call_from_thread(self._hint, f"discovery failed: {e}")
            return
        self.app.call_from_thread(self._refresh)

    def _hint(self, text: str) -> None:
        for hint in self.query("#cluster-hint").results(Static):
            hint.update(text)

    def _refresh(self) -> None:
        # a worker found while the screen closes: its widgets may already be gone
        lists = list(self.query("#cluster-nodes").results(SelectionList))
        if self._membership is None or not self.is_attached or not lists:
            return
        nodes = [n for n in self._membership.nodes() if n.compatible]
        sl = lists[0]
        chosen = set(sl.selected)
        new = {n.address: n for n in nodes}
        if new.keys() == self.found.keys():
            return
        seen = self.found.keys()
        self.found = new
        self._touched = self._touched or chosen != self._offered
        sl.clear_options()
        for n in nodes:
            # a worker just found is offered selected (all of them, or those in use now)
            # until the user changes the selection; one already listed keeps what they made of it
            default = not self._touched and (not self.in_use or n.address in self.in_use)
            pick = n.address in chosen if n.address in seen else default
            sl.add_option(Selection(node_row(n), n.address, pick))
        self._offered = set(sl.selected)
        self._hint(
            f"{len(nodes)} worker(s) found · space toggles · order = pipeline order"
            if nodes else "no workers yet: start `potluck worker` on a PC of this LAN"
        )

    def on_unmount(self) -> None:
        m, self._membership = self._membership, None
        if m is not None:
            m.close()

    def action_use(self) -> None:
        chosen = list(self.query_one("#cluster-nodes", SelectionList).selected)
        if not chosen:
            self.notify("select at least one worker (or Run on this PC)", severity="warning")
            return
        keep = self.current
        self.dismiss(ClusterChoice(
            nodes=tuple(chosen), token=keep.token if keep else None, token_file=keep.token_file if keep else None,
            join_timeout_s=self.join_timeout_s,
        ))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "use":
            self.action_use()
        elif event.button.id == "local":
            self.dismiss(LocalChoice())
        else:
            self.dismiss(None)


CLUSTER_HEADER = "      " + f"{'node':<10}{'address':<22}{'cores':>5}{'free MB':>9}{'speed':>7}"


def node_row(n: DiscoveredNode) -> str:
    return f"{n.node_id[:9]:<10}{n.address:<22}{n.cores:>5}{n.free_mb:>9,}{n.speed:>7.2f}"


class HelpScreen(ModalScreen[None]):
    """Every key of the app (F1, or ``?`` outside the input), grouped by where it works."""

    BINDINGS = [Binding("escape,f1,q", "dismiss(None)", "Close")]

    def __init__(self, sections: list[tuple[str, list[tuple[str, str]]]]) -> None:
        super().__init__(classes="modal")
        self.sections = sections

    def compose(self) -> ComposeResult:
        from rich.table import Table
        from rich.text import Text

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for title, rows in self.sections:
            table.add_row(Text(title, style="bold underline"), "")
            for keys, what in rows:
                table.add_row(keys, what)
            table.add_row("", "")
        with Vertical(id="help", classes="dialog"):
            yield Label("Keys", classes="title")
            with VerticalScroll(id="help-keys"):
                yield Static(table)
            yield Static("Esc closes · ctrl+p searches every command", classes="hint")

    def on_mount(self) -> None:
        self.query_one("#help-keys").focus()


class SearchScreen(ModalScreen["SearchHit | None"]):
    """Search every conversation (FTS5); Enter on a hit opens it there."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close"), Binding("down", "to_hits", "Hits", show=False)]

    def __init__(self, search: Callable[[str], list[SearchHit]]) -> None:
        super().__init__(classes="modal")
        self.search = search
        self.hits: list[SearchHit] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="search", classes="dialog"):
            yield Label("Search every conversation", classes="title")
            yield Input(placeholder="words to find", id="search-text")
            yield OptionList(id="search-hits")
            yield Static("type to search · ↓ to the hits · Enter opens · Esc closes", id="search-hint", classes="hint")

    def on_mount(self) -> None:
        steady_cursors(self)
        self.query_one("#search-text", Input).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.hits = self.search(event.value)
        hits = self.query_one("#search-hits", OptionList)
        hits.clear_options()
        hits.add_options([  # the text is the model's and the user's: shown as it is, never as markup
            Option(Text(printable(f"{h.title[:30]} · {'you' if h.role == 'user' else 'reply'}: {h.snippet}")))
            for h in self.hits
        ])
        n = len(self.hits)
        hint = f"{n} message{'s' if n != 1 else ''} · ↓ to the hits · Enter opens" if event.value.strip() else ""
        self.query_one("#search-hint", Static).update(hint or "type to search · Esc closes")

    def on_input_submitted(self) -> None:
        if self.hits:
            self.dismiss(self.hits[0])

    def action_to_hits(self) -> None:
        hits = self.query_one("#search-hits", OptionList)
        if hits.option_count:
            hits.focus()
            hits.highlighted = 0

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.hits[event.option_index])
