"""Modal screens: model / strategy picker, text prompts (rename, system prompt), confirm, log."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, RichLog, Static, TextArea
from textual.widgets.option_list import Option

from .catalog import ModelInfo, StrategyClass, compatible_choices

NO_DRAFT = "(no draft)"


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
            with Horizontal(classes="buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self._refresh_lists()
        self.query_one("#pick-model", OptionList).focus()

    def _refresh_lists(self) -> None:
        choices = compatible_choices(self.model, self.models, self.draft, self.strategies)
        if self.draft is not None and all(d.key != self.draft.key for d in choices.drafts):
            self.draft = None
            choices = compatible_choices(self.model, self.models, None, self.strategies)
        if self.strategy not in choices.strategies:
            self.strategy = choices.strategies[0] if choices.strategies else ""

        def fill(list_id: str, rows: list[tuple[str, str, str]], selected: str) -> None:
            ol = self.query_one(list_id, OptionList)
            ol.clear_options()
            ol.add_options(
                [Option(("● " if key == selected else "  ") + text, id=key or "-") for key, text, _ in rows]
            )
            keys = [key for key, _, _ in rows]
            if selected in keys:
                ol.highlighted = keys.index(selected)

        fill("#pick-model", [(m.key, m.label, "") for m in self.models], self.model.key)
        drafts = [("", NO_DRAFT, "")] + [(d.key, d.label, "") for d in choices.drafts]
        fill("#pick-draft", drafts, self.draft.key if self.draft else "")
        strategy_rows = [
            (name, f"{name} — {self.strategies[name].description}", "") for name in choices.strategies
        ]
        fill("#pick-strategy", strategy_rows, self.strategy)
        hidden = [f"not offered: {line}" for line in choices.hidden]
        hidden += [f"unreadable: {m.name}: {m.error}" for m in self.unreadable]
        self.query_one("#picker-hidden", Static).update("\n".join(hidden))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        key = "" if event.option.id in (None, "-") else str(event.option.id)
        if event.option_list.id == "pick-model":
            self.model = next(m for m in self.models if m.key == key)
        elif event.option_list.id == "pick-draft":
            self.draft = next((m for m in self.models if m.key == key), None) if key else None
        else:
            self.strategy = key
        self._refresh_lists()
        self.focus_next()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self.action_apply()
        else:
            self.dismiss(None)

    def action_apply(self) -> None:
        if not self.strategy:
            self.notify("no strategy works with this model", severity="error")
            return
        self.dismiss(Pick(self.model, self.draft, self.strategy))


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
