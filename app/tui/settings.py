"""A conversation's own parameters: what they make of config.toml's defaults, the status
line's summary of the sampling in use, and the dialog that edits them (as oterm's "Edit chat
parameters"). The context size is the model's, for every conversation: changing it reloads
the model, checked against free memory as ``--ctx`` is."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from ...engine import EngineSpec, PotluckError, validate
from ..config import SamplingSettings, Settings, spec_from_settings
from ..store import ConversationParams
from .catalog import StrategyClass
from .screens import steady_cursors

# ConversationParams field -> (label, Input type); the sampling ones are SamplingSettings fields.
FIELDS: dict[str, tuple[str, str]] = {
    "temperature": ("Temperature (0 = greedy)", "number"),
    "top_k": ("Top-k (0 = off)", "integer"),
    "top_p": ("Top-p (1 = off)", "number"),
    "min_p": ("Min-p (0 = off)", "number"),
    "repeat_penalty": ("Repeat penalty (1 = off)", "number"),
    "frequency_penalty": ("Frequency penalty (0 = off)", "number"),
    "presence_penalty": ("Presence penalty (0 = off)", "number"),
    "max_tokens": ("Max tokens per reply", "integer"),
    "seed": ("Seed (empty = a new one each reply)", "integer"),
}


def conversation_sampling(defaults: SamplingSettings, params: ConversationParams) -> SamplingSettings:
    """config.toml's sampling with the conversation's own values over it."""
    own = {f: getattr(params, f) for f in FIELDS if getattr(params, f) is not None}
    return replace(defaults, **own) if own else defaults


def conversation_spec(spec: EngineSpec, settings: Settings, params: ConversationParams) -> EngineSpec:
    """The loaded spec, or the one to load for this conversation's strategy (PotluckError when
    that strategy cannot run with what is configured, e.g. it needs a draft and none is set)."""
    strategy = params.strategy or settings.model.strategy
    if strategy == spec.strategy:
        return spec
    chosen = replace(settings, model=replace(settings.model, strategy=strategy, n_ctx=spec.n_ctx))
    return replace(spec_from_settings(chosen), cluster=spec.cluster)


def sampling_summary(s: SamplingSettings) -> str:
    """The sampling in use, for the status line: what is on, in llama.cpp's order."""
    if s.temperature <= 0:
        parts = ["greedy"]
    else:
        parts = [f"temp {s.temperature:g}"]
        if s.top_k:
            parts.append(f"top-k {s.top_k}")
        if s.top_p < 1:
            parts.append(f"top-p {s.top_p:g}")
        if s.min_p > 0:
            parts.append(f"min-p {s.min_p:g}")
    if s.repeat_penalty != 1:
        parts.append(f"repeat {s.repeat_penalty:g}")
    for f in dataclasses.fields(s):  # penalties added to the settings later show up too
        value = getattr(s, f.name)
        if f.name.endswith("_penalty") and f.name != "repeat_penalty" and isinstance(value, float) and value:
            parts.append(f"{f.name.removesuffix('_penalty')} {value:g}")
    if s.seed is not None:
        parts.append(f"seed {s.seed}")
    return " ".join(parts)


@dataclass(frozen=True)
class ChatSettings:
    """The dialog's answer."""

    params: ConversationParams
    n_ctx: int


class SettingsScreen(ModalScreen["ChatSettings | None"]):
    """Edit one conversation's sampling, reply length, seed and strategy, and the context size."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(
        self, title: str, params: ConversationParams, defaults: Settings, n_ctx: int,
        strategies: Mapping[str, StrategyClass], has_draft: bool,
    ) -> None:
        super().__init__(classes="modal")
        self.title_text = title
        self.params = params
        self.defaults = defaults
        self.n_ctx = n_ctx
        self.strategies = [n for n, cls in strategies.items() if has_draft or not cls.needs_draft]

    def compose(self) -> ComposeResult:
        d = self.defaults.sampling
        with Vertical(id="settings", classes="dialog"):
            yield Label(f"Settings · {self.title_text}", classes="title")
            with VerticalScroll(id="settings-form", classes="dialog-body"):
                for name, (label, kind) in FIELDS.items():
                    value = getattr(self.params, name)
                    default = getattr(d, name)
                    with Horizontal(classes="field"):
                        yield Label(label)
                        yield Input(
                            "" if value is None else str(value), id=f"set-{name}", type=kind,  # type: ignore[arg-type]
                            placeholder="random" if default is None else f"{default:g}", compact=True,
                        )
                with Horizontal(classes="field"):
                    yield Label("Strategy")
                    yield Select(
                        [(n, n) for n in self.strategies], id="set-strategy", compact=True,
                        prompt=f"default ({self.defaults.model.strategy})",
                        value=self.params.strategy if self.params.strategy in self.strategies else Select.NULL,
                    )
                with Horizontal(classes="field"):
                    yield Label("Context tokens (every chat; reloads)")
                    yield Input(str(self.n_ctx), id="set-n_ctx", type="integer", compact=True)
                yield Static(
                    "Empty fields take config.toml's value (shown grey). The context is "
                    "bounded by free memory, as --ctx is.", classes="hint",
                )
            yield Static("", id="settings-error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Defaults", id="defaults")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        steady_cursors(self)
        self.query_one("#set-temperature", Input).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        elif event.button.id == "defaults":
            for name in FIELDS:
                self.query_one(f"#set-{name}", Input).value = ""
            self.query_one("#set-strategy", Select).clear()
        else:
            self.dismiss(None)

    def on_input_submitted(self) -> None:
        self.action_save()

    def read(self) -> ChatSettings:
        """The form's values, checked as config.toml's are (PotluckError: one line)."""
        values: dict[str, object] = {}
        for name, (label, kind) in FIELDS.items():
            text = self.query_one(f"#set-{name}", Input).value.strip()
            if text:
                try:
                    values[name] = int(text) if kind == "integer" else float(text)
                except ValueError:
                    raise PotluckError(f"{label.split(' (')[0]}: {text!r} is not a number") from None
        strategy = self.query_one("#set-strategy", Select).value
        params = ConversationParams(**values, strategy=strategy if isinstance(strategy, str) else None)  # type: ignore[arg-type]
        conversation_sampling(self.defaults.sampling, params).params()  # the engine's own checks
        text = self.query_one("#set-n_ctx", Input).value.strip()
        try:
            n_ctx = validate.context_sizes(int(text)).n_ctx
        except ValueError:
            raise PotluckError(f"context: {text!r} is not a whole number") from None
        return ChatSettings(params, n_ctx)

    def action_save(self) -> None:
        try:
            result = self.read()
        except PotluckError as e:
            self.query_one("#settings-error", Static).update(str(e))
            return
        self.dismiss(result)
