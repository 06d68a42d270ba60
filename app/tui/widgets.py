"""The chat screen's widgets: messages, the message log, the input, the panels, the list."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Collapsible, Footer, ListItem, ListView, Markdown, Sparkline, Static, TextArea

from ...engine import RenderedReader, ThinkSplitter, split_thinking
from ..store import Conversation
from .cluster import ClusterState, human_bytes
from .export import code_blocks
from .stats import DASH, Figures, fmt

# A streaming reply lays the screen out (a new line, a finished block) at most this often;
# words within a line are drawn at the text pump's rate (app.TEXT_PUMP_S).
LAYOUT_EVERY_S = 0.5

_ROLE_LABEL = {"user": "You", "assistant": "Assistant", "system": "System"}

_FINISH_NOTE = {
    "cancelled": "stopped",
    "length": "cut at the token limit",
    "context_full": "context full",
    "error": "failed",
    "interrupted": "interrupted (potluck closed mid-reply)",
}


def settled_end(text: str) -> int:
    """Where the Markdown that can no longer change ends: after the last blank line that is
    not inside a code fence. What follows is the block still being written."""
    end, in_fence, pos = 0, False, 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        if not line.endswith("\n"):
            break  # the line being written
        stripped = line.strip()
        if stripped.startswith("```") or stripped.startswith("~~~"):
            in_fence = not in_fence
        elif not stripped and not in_fence:
            end = pos
    return end


class MessageView(Vertical, can_focus=True):
    """One message. A reply streams in through :meth:`append`: finished blocks go to the
    Markdown widget once each, the block still being written is plain text (cheap to
    redraw at the pump's rate), and :meth:`finish` renders the whole reply as Markdown."""

    BINDINGS = [
        Binding("y", "copy_message", "Copy message"),
        Binding("b", "copy_code", "Copy code block"),
        Binding("e", "edit", "Edit and resend"),
        Binding("left", "app.previous_answer", "Earlier version", show=False),
        Binding("right", "app.next_answer", "Later version", show=False),
    ]

    class CopyRequested(Message):
        def __init__(self, text: str, what: str) -> None:
            super().__init__()
            self.text = text
            self.what = what

    class EditRequested(Message):
        def __init__(self, message_id: int) -> None:
            super().__init__()
            self.message_id = message_id

    def __init__(
        self,
        role: str,
        content: str = "",
        *,
        message_id: int | None = None,
        note: str = "",
        streaming: bool = False,
        variant: tuple[int, int] = (1, 1),
    ) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.variant = variant  # (this version, versions): regenerated answers, edited prompts
        self.content = content  # the reply as the engine wrote it (what is stored and copied)
        self._shown = content  # what the body shows while it streams (a harmony reply: its answer)
        # a reasoning model's reply read as it streams: gpt-oss's channels or a <think> block
        self._reader: RenderedReader | ThinkSplitter | None = None
        self.message_id = message_id
        self._note = note
        self._streaming = streaming
        self._rendered = len(content)  # characters of _shown the Markdown widget holds
        self._tail_lines = -1  # wrapped lines the streaming tail had at its last layout
        self._laid_out_at = 0.0  # when streaming last laid the screen out (monotonic)
        self._code_index = 0
        self._thought = ""  # a reasoning model's thinking, shown folded under the reply
        self._opened = False  # the prompt opened a <think> block: the reply starts in it
        # Streamed text arrives from the pump's timer task and the reply's end from the app's
        # message queue: Textual's Markdown.append is not safe to overlap (two appends parse
        # from the same line and one block is lost), so they take turns.
        self._drawing = asyncio.Lock()

    def _role_text(self) -> str:
        label = _ROLE_LABEL.get(self.role, self.role)
        i, n = self.variant
        return f"{label}  ‹ {i}/{n} ›" if n > 1 else label

    def set_variants(self, i: int, n: int) -> None:
        self.variant = (i, n)
        for role in self.query(".role").results(Static):
            role.update(self._role_text())

    def compose(self) -> ComposeResult:
        yield Static(self._role_text(), classes="role", markup=False)
        thought, answer = split_thinking(self.content) if self.role == "assistant" else ("", self.content)
        self._thought = thought
        yield Markdown(answer, classes="body")
        yield Static("", classes="tail", markup=False)
        with Collapsible(title="Thinking", collapsed=True, classes="thinking"):
            yield Static(thought.strip(), classes="thought", markup=False)
        yield Static(self._note, classes="note")

    def on_mount(self) -> None:
        self.set_class(self._streaming, "streaming")
        self.query_one(".note", Static).display = bool(self._note)
        self.query_one(".tail", Static).display = False
        self.query_one(".thinking", Collapsible).display = bool(self._thought)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(".body", Markdown)

    async def append(self, text: str, *, inside_thinking: bool = False) -> None:
        """Add streamed text. Parsing Markdown and laying out its blocks per pump tick cost
        the engine a third of a core on a 2-core machine, so only finished blocks are parsed,
        and the screen is laid out again at most every :data:`LAYOUT_EVERY_S`.
        ``inside_thinking``: the prompt opened a ``<think>`` block, so the reply starts in it."""
        async with self._drawing:
            await self._append(text, inside_thinking)

    async def _append(self, text: str, inside_thinking: bool) -> None:
        if not self.content and self.role == "assistant":  # thinking apart as it streams, no tags or markers
            start = text.lstrip()
            self._opened = inside_thinking
            thinks = inside_thinking or ThinkSplitter.may_open(start)
            self._reader = RenderedReader() if start.startswith("<|channel|>") else \
                ThinkSplitter.of_any_family(inside_thinking) if thinks else None
        self.content += text
        if self._reader is not None:
            thought, text = self._reader.feed(text)
            if thought:
                self._thought += thought
                self.query_one(".thought", Static).update(self._thought.strip())
                self.query_one(".thinking", Collapsible).display = True
        self._shown += text
        due = time.monotonic() - self._laid_out_at >= LAYOUT_EVERY_S
        end = settled_end(self._shown)
        if due and end > self._rendered:
            settled, self._rendered = self._shown[self._rendered:end], end
            self._laid_out_at = time.monotonic()
            await self.markdown.append(settled)
        self._show_tail(layout_allowed=due)
        if isinstance(self.parent, ChatLog):
            self.parent.follow()

    def _show_tail(self, layout_allowed: bool = True) -> None:
        """Redraw the block being written. Most pump ticks add a word to the same line: a
        repaint. A new line needs the screen laid out again (about 20 ms of the UI thread on
        a 2-core machine, where it stalls llama.cpp's threads): until that is allowed, the
        words of the new line wait, drawn with the next layout."""
        tail = self.query_one(".tail", Static)
        rest = self._shown[self._rendered:].strip("\n")
        text = Text(rest)
        width = tail.size.width
        lines = len(text.wrap(self.app.console, width)) if width and rest else -1
        layout = lines != self._tail_lines or tail.display != bool(rest)
        if layout and not layout_allowed:
            tail.update(text, layout=False)
            return
        if layout:
            self._laid_out_at = time.monotonic()
        self._tail_lines = lines
        tail.display = bool(rest)
        tail.update(text, layout=layout)

    async def finish(self, final_text: str, note: str = "") -> None:
        """End streaming: the whole reply as Markdown (the engine's final text wins)."""
        async with self._drawing:
            await self._finish(final_text, note)

    async def _finish(self, final_text: str, note: str) -> None:
        thought, answer = split_thinking(final_text, opened=self._opened) if self.role == "assistant" \
            else ("", final_text)
        self._thought = thought
        if thought:  # a reasoning model's thinking: folded, under the answer
            self.query_one(".thought", Static).update(thought.strip())
            self.query_one(".thinking", Collapsible).display = True
            await self.markdown.update(answer)
        elif answer != self._shown or self._rendered < len(answer):
            if answer.startswith(self._shown[: self._rendered]) and self._rendered:
                await self.markdown.append(answer[self._rendered:])
            else:
                await self.markdown.update(answer)
        self.content, self._shown, self._rendered, self._reader = final_text, answer, len(answer), None
        self._show_tail()
        self.set_note(note)
        self.remove_class("streaming")
        if isinstance(self.parent, ChatLog):  # the final Markdown may be what overflows the log
            self.parent.call_after_refresh(self.parent.follow)

    async def restart(self) -> None:
        """Empty the reply so a regenerated one can stream into the same place."""
        async with self._drawing:
            self.content, self._shown, self._rendered, self._reader = "", "", 0, None
            self._thought, self._opened = "", False
            self.query_one(".thinking", Collapsible).display = False
            await self.markdown.update("")
        self._show_tail()
        self.set_note("")
        self.add_class("streaming")

    def set_note(self, note: str) -> None:
        self._note = note
        label = self.query_one(".note", Static)
        label.update(note)
        label.display = bool(note)
        self.set_class(note.startswith("stopped"), "stopped")

    def action_edit(self) -> None:
        if self.role == "user" and self.message_id is not None:
            self.post_message(self.EditRequested(self.message_id))
        else:
            self.notify("only your own messages can be edited (ctrl+r writes another answer)", severity="warning")

    def action_copy_message(self) -> None:
        self.post_message(self.CopyRequested(self.content, "message"))

    def action_copy_code(self) -> None:
        """Copy a code block; pressing again moves to the next one."""
        blocks = code_blocks(self.content)
        if not blocks:
            self.notify("this message has no code block", severity="warning")
            return
        block = blocks[self._code_index % len(blocks)]
        self._code_index += 1
        self.post_message(self.CopyRequested(block, "code block"))


def finish_note(reason: str | None, detail: str = "") -> str:
    note = _FINISH_NOTE.get(reason or "", "")
    if note and detail:
        return f"{note} · {detail}"
    return note or detail


class ChatLog(VerticalScroll):
    """The messages of one conversation; stays scrolled to the end while a reply streams."""

    def __init__(self, conversation_id: int, **kwargs: object) -> None:
        super().__init__(id=f"chat-{conversation_id}", classes="chat-log", **kwargs)  # type: ignore[arg-type]
        self.conversation_id = conversation_id

    def follow(self) -> None:
        """Keep the end in view while a reply streams, until the user scrolls up.

        Anchoring only once the messages overflow: an anchored log bottom-aligns short
        content, leaving an empty gap above the first message. So the anchor is let go again
        when the messages fit once more (a streamed reply is taller than its final Markdown).
        The scroll home is forced: the anchored layout of content that fits has scrolled above
        the top and hidden the scrollbar, and Textual refuses to scroll a log without one.
        """
        if self.max_scroll_y > 0:
            if not self.is_anchored:
                self.anchor()
        elif self.is_anchored:
            self.anchor(False)
            self.scroll_home(animate=False, immediate=True, force=True)

    def on_resize(self) -> None:
        self.call_after_refresh(self.follow)

    def messages(self) -> list[MessageView]:
        return list(self.query(MessageView))

    async def show_context(self, first_id: int | None, note: str) -> None:
        """Mark where what the model was last sent begins: the messages before it are shown
        dimmed, under a line that says why (the context was full)."""
        for old in self.query(".context-note"):
            await old.remove()
        before = True
        for view in self.messages():
            if view.message_id == first_id:
                before = False
                await self.mount(Static(f"── {note} ──", classes="context-note", markup=False), before=view)
            view.set_class(before and first_id is not None, "outside")


class FirstSteps(Static):
    """What an empty conversation says: how to start, where the keys are."""

    def __init__(self, keys: Any) -> None:
        super().__init__(
            f"Type a message below and press Enter to chat with the model.\n"
            f"{keys.help.split(',')[0].upper()} lists every key · {keys.picker.split(',')[0]} picks a model · "
            f"{keys.settings.split(',')[0].upper()} this chat's settings",
            classes="first-steps", markup=False,
        )


class ChatInput(TextArea):
    """Multi-line message input: the send key submits, the newline keys insert a line break.
    F6 (TextArea's select line) is left to the app: it opens the settings."""

    BINDINGS = [
        Binding("f6", "app.settings", "Settings", show=False),
    ]

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, send_keys: str, newline_keys: str, cursor_blink: bool = True) -> None:
        super().__init__(id="input", soft_wrap=True, show_line_numbers=False, tab_behavior="focus")
        self._send = {k.strip() for k in send_keys.split(",") if k.strip()}
        self._newline = {k.strip() for k in newline_keys.split(",") if k.strip()}
        self.cursor_blink = cursor_blink
        # Up in an empty input recalls the last prompts, newest first (as a shell does); the
        # app sets where they come from. Down walks back; an edit ends the walk.
        self.recall: Callable[[], list[str]] = list
        self._recalled: list[str] = []
        self._recall_at = -1

    def _recall_step(self, delta: int) -> bool:
        walking = self._recall_at >= 0 and self._recalled and self.text == self._recalled[self._recall_at]
        if not walking:
            if delta < 0 or self.text:
                return False
            self._recalled, self._recall_at = self.recall(), -1
        at = self._recall_at + delta
        if at >= len(self._recalled):
            return True  # the oldest: stay
        self._recall_at = at
        self.text = self._recalled[at] if at >= 0 else ""
        self.move_cursor(self.document.end)
        return True

    async def _on_key(self, event: events.Key) -> None:
        if event.key in ("up", "down") and self.cursor_location[0] in (0, self.document.line_count - 1):
            if self._recall_step(1 if event.key == "up" else -1):
                event.stop()
                event.prevent_default()
                return
        if event.key in self._send:
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in self._newline:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)


class StatsPanel(Vertical):
    """Live speed and acceptance figures; fed by the app's sampling timer, never per token."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shown: dict[str, tuple[object, int]] = {}  # per section: its key and line count
        self._sections: list[tuple[str, list[tuple[str, str]]]] = []
        self._cluster: tuple[ClusterState, str] | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="stats-speed", classes="panel")
        yield Sparkline([], id="stats-spark")
        yield Static(id="stats-spec", classes="panel")
        yield Static(id="stats-tokens", classes="panel")
        yield Static(id="stats-cluster", classes="panel")

    def on_mount(self) -> None:
        self.query_one("#stats-cluster", Static).display = False

    def show(self, f: Figures) -> None:
        speed = ("Speed", [
                ("now", fmt(f.tokens_per_s_now, ".1f", " tok/s")),
                ("reply", fmt(f.tokens_per_s_reply, ".1f", " tok/s")),
                ("first token", fmt(f.ttft_s, ".2f", " s")),
            ])
        self.query_one("#stats-spark", Sparkline).data = list(f.speed_series[-60:])
        spec = ("Speculation", [
                ("strategy", f.strategy or DASH),
                *([(LINE, f.gain)] if f.gain else []),
                ("acceptance", fmt(f.acceptance_rate, ".2f")),
                ("accepted/round", fmt(f.mean_accepted_len, ".2f")),
                ("draft length", fmt(f.draft_len, "d")),
                ("drafted", str(f.drafted) if f.acceptance_rate is not None else DASH),
                ("accepted", str(f.accepted) if f.acceptance_rate is not None else DASH),
                *([("draft ∥ target", fmt(f.overlap_pct, ".0f", "%"))] if f.overlap_pct is not None else []),
                *[(("▸ " if d.voted else "  ") + d.name, f"w {d.weight:.2f}  acc {d.acceptance:.2f}")
                  for d in f.drafters],
            ])
        used = f"{f.n_past} / {f.n_ctx}" if f.n_ctx else DASH
        pct = f" ({100 * f.n_past / f.n_ctx:.0f}%)" if f.n_ctx else ""
        tokens = ("Tokens", [
            ("prompt", str(f.prompt_tokens)),
            ("generated", str(f.generated_tokens)),
            ("context", used + pct),
            (LINE, context_meter(f.n_past, f.n_ctx)),
        ])
        self._sections = [speed, spec, tokens]
        for widget_id, (title, rows) in zip(("#stats-speed", "#stats-spec", "#stats-tokens"), self._sections):
            self._put(widget_id, (title, rows), lambda t=title, r=rows: (_section(t, r), len(r)))

    def _put(self, widget_id: str, key: object, render: Callable[[], tuple[Table | Group, int]]) -> None:
        """Redraw a section only when its figures changed (``key``): ``render`` builds it and
        counts its lines only then. The screen is laid out again only when that count
        changed: a layout pass over a long conversation costs the engine time, and so does
        building Rich tables at every sample."""
        old = self._shown.get(widget_id)
        if old is not None and old[0] == key:
            return
        table, lines = render()
        self._shown[widget_id] = (key, lines)
        self.query_one(widget_id, Static).update(table, layout=old is None or old[1] != lines)

    def show_cluster(self, c: ClusterState | None, replan_key: str = "ctrl+g") -> None:
        """The cluster section: per stage its node, layers, health and bytes per token."""
        found = self.query("#stats-cluster")
        if not found:
            return  # not composed yet, or being torn down
        found.first(Static).display = c is not None
        self._cluster = None if c is None else (c, replan_key)
        if c is not None:
            self._put("#stats-cluster", self._cluster, lambda: _with_lines(cluster_table(c, replan_key)))

    def text(self) -> str:
        """The panels as plain text (tests and the log read figures from here)."""
        tables: list[Table | Group] = [_section(t, r) for t, r in self._sections]
        if self._cluster is not None:
            tables.append(cluster_table(*self._cluster))
        return "\n".join(_plain(t) for t in tables)


_STATE_STYLE = {"ok": "green", "loading": "yellow", "recovering": "yellow", "lost": "bold red", "failed": "bold red"}


def cluster_table(c: ClusterState, replan_key: str) -> Group:
    def grid(rows: list[tuple[Text | str, Text | str]]) -> Table:
        t = Table.grid(padding=(0, 1), expand=True)
        t.add_column(ratio=1)
        t.add_column(justify="right")
        for left, right in rows:
            t.add_row(left, right)
        return t

    title = Text(" · ".join(filter(None, [f"{len(c.stages)} stage(s)", c.experts_text])), style="dim")
    parts: list[Table | Text] = [grid([(Text("Cluster", style="bold"), title)])]
    for i, r in enumerate(c.stages, 1):
        parts.append(grid([
            (Text(f"{i} {r.node[:8]} layers {r.layer_text}"), Text(r.state, style=_STATE_STYLE.get(r.state, ""))),
            (Text("  per token", style="dim"), human_bytes(r.bytes_per_token)),
        ]))
        here = " (this machine)" if r.address.startswith(("127.", "localhost", "[::1]")) else ""
        parts.append(Text(f"  {r.address}{here}", style="dim", overflow="ellipsis", no_wrap=True))
    if c.head_layers is not None:  # the workers compute every layer, the head the output layer
        parts.append(grid([(Text("head: output layer"), Text("this machine", style="dim"))]))
    if c.sent_bytes or c.cached_bytes:
        parts.append(grid([(Text("slices sent", style="dim"), human_bytes(c.sent_bytes))]))
    if c.cached_bytes:
        parts.append(grid([(Text("already on workers", style="dim"), human_bytes(c.cached_bytes))]))
    if c.transfer is not None:
        what, done, total = c.transfer
        parts.append(grid([(Text(f"sending {what}", style="dim"), f"{100 * done / total if total else 100:.0f}%")]))
    if c.note:
        parts.append(Text(c.note, style="yellow"))
    if c.broken:
        parts.append(Text(f"{replan_key}: re-plan over the workers found", style="bold"))
    return Group(*parts)


def context_meter(n_past: int, n_ctx: int, width: int = 20) -> str:
    """The context used as a bar: long documents fill it, and a full one ends replies."""
    if n_ctx <= 0:
        return DASH
    filled = min(width, round(width * n_past / n_ctx))
    return "█" * filled + "░" * (width - filled)


LINE = "\n"  # a row's name that makes its value a line of its own (a one-line verdict)


def _section(title: str, rows: list[tuple[str, str]]) -> Table | Group:
    def grid() -> Table:
        table = Table.grid(padding=(0, 1), expand=True)
        table.add_column(ratio=1)
        table.add_column(justify="right")
        return table

    parts: list[Table | Text] = [grid()]
    parts[0].add_row(Text(title, style="bold"), "")  # type: ignore[union-attr]
    for name, value in rows:
        if name == LINE:
            parts += [Text(value, no_wrap=True, overflow="ellipsis"), grid()]
        else:
            parts[-1].add_row(Text(name, style="dim"), value)  # type: ignore[union-attr]
    return parts[0] if len(parts) == 1 else Group(*parts)


def _with_lines(table: Group) -> tuple[Group, int]:
    """A section whose notes may wrap: its lines as rendered at the panel's width."""
    return table, _plain(table).count("\n")


def _plain(renderable: object) -> str:
    import io

    from rich.console import Console

    console = Console(width=40, color_system=None, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


class KeysFooter(Footer):
    """Textual's footer, rebuilt only when the keys it shows change. Textual's own rebuilds
    its every key widget on each bindings refresh (a reply's start and end, a focus change):
    about 0.1 s of the UI thread on a 2-core machine, which stalls llama.cpp's threads."""

    _shown: tuple[tuple[str, str, bool], ...] | None = None

    def bindings_changed(self, screen: Screen) -> None:
        shown = tuple(
            (key, b.binding.description, b.enabled)
            for key, b in screen.active_bindings.items() if b.binding.show
        )
        if shown == self._shown:
            return
        super().bindings_changed(screen)
        if screen.app.app_focus and self.is_attached and screen is self.screen:
            self._shown = shown  # Footer recomposes only in this case


class ConversationList(ListView):
    """Conversations, most recent first; selecting one opens it."""

    class Opened(Message):
        def __init__(self, conversation_id: int) -> None:
            super().__init__()
            self.conversation_id = conversation_id

    async def show(self, conversations: list[Conversation], active: int | None) -> None:
        """List these; items are rebuilt only when the order changed (each send and reply
        refreshes the list, and rebuilding a long one stalls the engine's threads)."""
        ids = [f"conv-{c.id}" for c in conversations]
        items = list(self.query(ListItem))
        if [item.id for item in items] == ids:
            for item, c in zip(items, conversations):
                label = item.query_one(Static)
                if str(label.content) != c.title:
                    label.update(c.title)
        else:
            await self.clear()
            await self.extend(
                ListItem(Static(c.title, markup=False), id=i, classes="conversation")
                for i, c in zip(ids, conversations)
            )
        for i, c in enumerate(conversations):
            if c.id == active and self.index != i:
                self.index = i

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if event.item.id and event.item.id.startswith("conv-"):
            self.post_message(self.Opened(int(event.item.id.removeprefix("conv-"))))
