"""The chat app's keys that are not about a running reply: conversations (new, previous,
next, rename, delete, system prompt), the model picker, copy, export and the log view.

A mixin of :class:`~.app.PotluckApp` (the app's state lives on the app itself).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from ...engine import EngineSpec, PotluckError, paths
from ..config import Settings, save_settings, spec_from_settings
from ..store import Conversation, SearchHit, Store
from .catalog import ModelInfo, StrategyClass, read_model_info
from .commands import help_sections
from .export import code_blocks, conversation_markdown, export_path
from .replies import Reply
from .screens import ConfirmScreen, HelpScreen, LogScreen, Pick, PickerScreen, SearchScreen, TextPromptScreen
from .settings import ChatSettings, SettingsScreen
from .widgets import ConversationList, MessageView

NEW_TITLE = "New chat"


def title_from(text: str) -> str:
    """A new conversation's title: the first line of its first message, cut to 40 characters."""
    line = text.strip().splitlines()[0] if text.strip() else NEW_TITLE
    return line if len(line) <= 40 else line[:39] + "…"


class ConversationActions:
    """Conversations, the model picker, copy/export/log (the app's state lives on the app)."""

    settings: Settings
    settings_path: Path | None
    export_dir: Path
    store: Store | None
    active: int | None
    reply: Reply | None
    spec: EngineSpec
    model_catalog: Callable[[], list[ModelInfo]]
    strategies: Mapping[str, StrategyClass]
    copy_fallback: Callable[[str], str]

    def _create_conversation(self) -> Conversation:
        assert self.store is not None
        return self.store.new_conversation(NEW_TITLE, self.settings.model.system)

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
        draft = next((m for m in models if m.is_file(kept)), None)
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
        model_path = str(pick.model.path) if pick.model.path else None  # None: the bundled model
        # The bundled model as a draft is named by its file: an unset draft means none.
        draft_file = pick.draft.file if pick.draft else None
        draft_path = str(draft_file) if draft_file else None
        self.settings = replace(
            self.settings,
            model=replace(m, path=model_path, draft=draft_path, strategy=pick.strategy),
        )
        try:
            spec = spec_from_settings(self.settings)  # the same checks as at start
        except PotluckError as e:
            self.report_error(str(e))
            return
        self.save_choice()
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
            text = conversation_markdown(
                conv, self.store.messages(conv.id), model=self._model_label(), sampling=self._sampling_label(),
                exported_at=datetime.now(),
            )
            path.write_text(text, "utf-8")
        except OSError as e:
            self.report_error(f"could not export: {e}")
            return None
        self.notify(f"exported to {path}")
        return path

    def action_log(self) -> None:
        self.push_screen(LogScreen(list(self.log_buffer.lines)))

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(help_sections(self.settings.keys)))

    def action_search(self) -> None:
        assert self.store is not None
        store = self.store

        async def done(hit: SearchHit | None) -> None:
            if hit is None or self.store is None:
                return
            if self.reply is not None and hit.conversation_id == self.reply.conversation_id:
                await self.open_conversation(hit.conversation_id)  # its path cannot change mid-reply
                return
            self.store.select(hit.message_id)  # the branch that holds the hit, if an older one
            await self.open_conversation(hit.conversation_id)
            await self.show_path(hit.conversation_id, focus=hit.message_id)

        self.push_screen(SearchScreen(store.search), done)

    def action_settings(self) -> None:
        assert self.store is not None and self.active is not None
        conv = self.store.conversation(self.active)
        if conv is None:
            return
        has_draft = bool(self.settings.model.draft)

        async def done(result: ChatSettings | None) -> None:
            if result is None or self.store is None:
                return
            self.store.set_params(conv.id, result.params)
            self.update_status()
            if result.n_ctx != self.spec.n_ctx:
                self.change_context(result.n_ctx)
            else:
                self.notify("settings saved; they apply from the next reply")

        self.push_screen(
            SettingsScreen(conv.title, conv.params, self.settings, self.spec.n_ctx, self.strategies, has_draft), done
        )

    def change_context(self, n_ctx: int) -> None:
        """Reload the model with another context size (free memory is checked at load: a size
        that does not fit is refused in one line and the loaded model stays)."""
        if self.reply is not None:
            self.notify("wait for the reply (or Esc) before changing the context", severity="warning")
            return
        self.settings = replace(self.settings, model=replace(self.settings.model, n_ctx=n_ctx))
        self.notify(f"reloading the model with a context of {n_ctx:,} tokens…")
        self.start_loading(replace(self.spec, n_ctx=n_ctx))
        self.save_choice()

    def save_choice(self) -> None:
        """Remember the model choices in config.toml (its comments and layout are kept)."""
        if self.settings_path is None:
            return
        try:
            save_settings(self.settings, self.settings_path)
        except OSError as e:
            self.report_error(f"could not save the settings: {e}")

    def action_screenshot(self, filename: str | None = None, path: str | None = None) -> None:
        """Textual's screenshot command saves to Downloads, and fails where there is none:
        then the data directory's screenshots folder."""
        if path is None:
            from platformdirs import user_downloads_dir

            downloads = Path(user_downloads_dir())
            path = str(downloads if downloads.is_dir() else paths.screenshots_dir())
        super().action_screenshot(filename, path)  # type: ignore[misc]
