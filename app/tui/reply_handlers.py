"""The chat app's side of a reply: sending a message (queued while the model loads),
drawing the streamed text, keeping the finished (or failed, or stopped) reply, regenerating
the last one beside the earlier answers, stepping between those, and editing a sent prompt.

A mixin of :class:`~.app.PotluckApp`. The reply itself runs in a worker thread
(:func:`~.replies.reply_in_thread`); these handlers start it and take what it posts.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from functools import partial

from ...engine import EngineSpec, Message
from ..config import Settings
from ..store import Conversation, Store, StoredMessage
from .actions import NEW_TITLE, title_from
from .cluster import ClusterState
from .context import context_note
from .replies import (
    ChatSession,
    ClusterNotice,
    ContextFitted,
    Reply,
    ReplyFailed,
    ReplyFinished,
    checkpoint_reply,
    reply_in_thread,
)
from .settings import conversation_sampling, conversation_spec
from .stats import ReplyProgress
from .widgets import ChatInput, FirstSteps, MessageView, finish_note

log = logging.getLogger(__name__)

GC_RESUME_AFTER_S = 0.3  # after a reply's end, well past its last frame's trip to the terminal


class ReplyHandlers:
    """Send, stream, finish, fail, stop, regenerate, step and edit (the app's state lives on the app)."""

    settings: Settings
    session: ChatSession | None
    spec: EngineSpec
    loading: bool
    store: Store | None
    active: int | None
    reply: Reply | None
    progress: ReplyProgress
    cluster_state: ClusterState | None
    clock: Callable[[], float]
    _engine_idle: threading.Event
    queued: tuple[int, int] | None  # (conversation, user message) sent once the model is loaded
    editing: int | None  # the sent prompt being edited: the next send is another version of it

    def _reply(
        self, conv: Conversation, sent: list[StoredMessage], view: MessageView, user_text: str | None = None,
        *, variant_of: StoredMessage | None = None, **kw: object,
    ) -> Reply:
        """A reply to the stored messages ``sent`` (the prompt last), in conversation ``conv``."""
        assert self.session is not None
        # where the previous reply's cut began: the next one starts there too (its KV is reused)
        before = variant_of or next((m for m in reversed(sent) if m.role == "assistant"), None)
        ids = [m.id for m in sent]
        start = ids.index(before.context_from) if before and before.context_from in ids else 0
        return Reply(
            conv.id, self.session, view, user_text,
            variant_of=variant_of.id if variant_of else None,
            system=Message("system", conv.system) if conv.system else None,
            turns=[Message(m.role, m.content) for m in sent],
            turn_ids=list(ids),
            start=start,
            sampling=conversation_sampling(self.settings.sampling, conv.params),
            settings_key=self._key("settings"),
            **kw,  # type: ignore[arg-type]
        )

    def _start_reply(self, reply: Reply) -> None:
        reply.progress = self.progress  # until the engine says the reply started
        # No cyclic garbage collection while a reply runs: a collection holds the GIL, and the
        # engine's threads need it back after every llama.cpp call. With Textual's objects on
        # the heap a full collection took 50-100 ms, and the young ones 20-40 ms a reply in
        # all: the engine decoded 6 % faster in tmux without them (docs/facts.md §26).
        # Garbage without cycles is still freed at once; the rest waits for the reply's end.
        gc.disable()
        self.reply = reply
        self._engine_idle.clear()
        self.update_status()
        self.run_worker(
            partial(reply_in_thread, self.post_message, reply, self.clock, self._engine_idle),
            thread=True, group="engine", exit_on_error=False,
        )

    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    def _needs_reload(self, conv: Conversation) -> EngineSpec | None:
        """The spec to load first when this conversation decodes with another strategy."""
        spec = conversation_spec(self.spec, self.settings, conv.params)
        return None if spec == self.spec else spec

    async def send(self, text: str) -> bool:
        """Send the input as a user message; on refusal the text stays in the input. While the
        model loads (or must load first, for this conversation's strategy) it is queued."""
        if not text.strip():
            return False
        if self.reply is not None:
            self.notify("a reply is still being generated; Esc stops it", severity="warning")
            return False
        if self.queued is not None:
            self.notify("a message is already waiting for the model", severity="warning")
            return False
        assert self.store is not None and self.active is not None
        conv = self.store.conversation(self.active)
        assert conv is not None
        reload = None
        if self.session is not None and not self.loading:
            try:
                reload = self._needs_reload(conv)
            except Exception as e:  # a strategy that needs a draft, none set: one line
                self.report_error(str(e))
                return False
        if self.session is None and not self.loading and reload is None:
            self.notify("cannot send: no model is loaded (ctrl+o picks one)", severity="warning")
            return False
        editing, self.editing = self.editing, None
        if editing is not None:
            stored = self.store.add_message(conv.id, "user", text, variant_of=editing)
        else:
            stored = self.store.add_message(conv.id, "user", text)
        if conv.title == NEW_TITLE:
            self.store.rename(conv.id, title_from(text))
        self.input.clear()
        chat = self.chat_log()
        assert chat is not None
        for hint in chat.query(FirstSteps):
            await hint.remove()
        if editing is not None:
            await self.show_path(conv.id)  # the edited branch: what followed the old prompt goes
        if self.loading or reload is not None:
            self.queued = (conv.id, stored.id)
            if editing is None:
                await chat.mount(MessageView("user", text, message_id=stored.id, note=QUEUED))
            else:
                self._note_on(stored.id, QUEUED)
            if reload is not None:
                self.start_loading(reload)
            chat.scroll_end(animate=False)
            await self.refresh_conversations()
            self.update_status()
            return True
        user_view = self._view_of(stored.id) if editing is not None else MessageView("user", text, message_id=stored.id)
        reply_view = MessageView("assistant", streaming=True)
        path = self.store.messages(conv.id)
        reply = self._reply(conv, path, reply_view, text, user_view=user_view, user_message_id=stored.id, shown=False)
        # The engine starts before the views are mounted (25 ms of the UI thread): its
        # prompt computes meanwhile, and what it streams waits in the reply until drawn.
        self._start_reply(reply)
        await chat.mount_all([reply_view] if editing is not None else [user_view, reply_view])
        reply.shown = True
        chat.scroll_end(animate=False)
        chat.call_after_refresh(chat.follow)
        await self.refresh_conversations()
        return True

    def _view_of(self, message_id: int) -> MessageView | None:
        chat = self.chat_log()
        return next((v for v in chat.messages() if v.message_id == message_id), None) if chat else None

    def _note_on(self, message_id: int, note: str) -> None:
        view = self._view_of(message_id)
        if view is not None:
            view.set_note(note)

    async def answer_queued(self) -> None:
        """The model is loaded: answer the prompt that waited for it."""
        queued, self.queued = self.queued, None
        if queued is None or self.store is None:
            return
        conversation_id, message_id = queued
        conv = self.store.conversation(conversation_id)
        path = self.store.messages(conversation_id)
        if conv is None or not path or path[-1].id != message_id:
            return  # deleted or edited meanwhile
        if conversation_id != self.active:
            await self.open_conversation(conversation_id)
        self._note_on(message_id, "")
        await self._answer(conv, path)

    def queued_failed(self, error: str) -> None:
        """The model did not load: the queued prompt stays in the conversation, unanswered."""
        queued, self.queued = self.queued, None
        if queued is not None:
            self._note_on(queued[1], f"not answered: the model did not load · {self._key('regenerate')} answers it")

    async def _answer(self, conv: Conversation, path: list[StoredMessage]) -> None:
        """Stream a reply to a conversation that ends with an unanswered prompt."""
        chat = self.chat_log()
        assert chat is not None
        view = MessageView("assistant", streaming=True)
        await chat.mount(view)
        self._start_reply(self._reply(conv, path, view))
        chat.scroll_end(animate=False)
        chat.call_after_refresh(chat.follow)

    async def _pump_reply_text(self) -> None:
        """Draw what the engine streamed since the last tick (a few times a second, so a
        fast engine never floods the event loop with one repaint per token)."""
        reply = self.reply
        if reply is None or not reply.shown:
            return
        text = reply.take()
        if text:
            reply.got_text = True
            if reply.view.is_attached:
                await reply.view.append(text, inside_thinking=reply.thinking_opened)
        if self.store is not None:
            checkpoint_reply(self.store, reply)  # a crash loses at most SAVE_EVERY_S of it

    async def on_context_fitted(self, event: ContextFitted) -> None:
        """The oldest turns are left out of this reply: the conversation shows where what is
        sent begins."""
        reply = event.reply
        chat = self.chat_log(reply.conversation_id)
        first = reply.context_from
        if chat is not None and first is not None:
            await chat.show_context(first, context_note(event.fit.dropped, reply.session.n_ctx, self._key("settings")))

    async def on_reply_finished(self, event: ReplyFinished) -> None:
        reply, f = event.reply, event.finished
        await self._pump_reply_text()
        self.progress = reply.progress
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
                parent=reply.parent_id,
                variant_of=reply.variant_of,
                context_from=reply.context_from,
            )
            reply.view.message_id = stored.id
            reply.view.set_variants(stored.variant, stored.variants)
        if reply.view.is_attached:
            await reply.view.finish(f.text, note)
        await self.refresh_conversations()
        self._reply_over()

    def _reply_over(self) -> None:
        """The reply ends only once it is stored and drawn: until then a new send waits, and
        so does whoever watches ``self.reply`` (a test that then closes the app)."""
        self.reply = None
        self.sample_stats()
        self.update_status()
        # Collections resume once the end is on screen: the first one can be a full collection
        # of all the reply left behind (tens of ms), and it would hold up that last paint
        # (the writer thread needs the GIL to send the frame to the terminal).
        self.set_timer(GC_RESUME_AFTER_S, self._resume_gc)

    def _resume_gc(self) -> None:
        if self.reply is None:  # not when a new reply began in between
            gc.enable()

    def on_cluster_notice(self, event: ClusterNotice) -> None:
        """A worker was lost mid-reply and the head re-planned: say so, the reply goes on."""
        log.warning("%s", event.text)
        self.notify(event.text, title="Cluster", severity="warning", timeout=8, markup=False)  # it names workers

    async def on_reply_failed(self, event: ReplyFailed) -> None:
        reply = event.reply
        await self._pump_reply_text()
        self.progress = reply.progress
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
            # Nothing was generated: undo the send and give the text back for editing (an
            # edit undone shows the version it was made from again).
            if reply.user_message_id is not None:
                self.store.delete_message(reply.user_message_id)
            for view in (reply.user_view, reply.view):
                if view is not None and view.is_attached:
                    await view.remove()
            if reply.user_view is not None and reply.user_view.variant[1] > 1:
                await self.show_path(reply.conversation_id)
            if not self.input.text:
                self.input.text = reply.user_text
        elif reply.user_text is None and not reply.got_text:
            if reply.view.is_attached:
                if reply.variant_of is None:  # an unanswered prompt stays unanswered
                    await reply.view.remove()
                else:
                    await reply.view.finish(reply.previous_text, reply.previous_note)
        else:
            text = reply.view.content
            if self.store.conversation(reply.conversation_id) is not None:
                self.store.add_message(
                    reply.conversation_id, "assistant", text, finish_reason="error",
                    parent=reply.parent_id, variant_of=reply.variant_of, context_from=reply.context_from,
                )
            if reply.view.is_attached:
                await reply.view.finish(text, finish_note("error", detail))
        self._reply_over()

    def action_stop(self) -> None:
        """Esc: the engine stops after its current step; the partial reply is kept. Without a
        reply, Esc cancels an edit and brings the focus back to the input."""
        if self.reply is None:
            if self.editing is not None:
                self.editing = None
                self.input.clear()
                self.update_status()
            self.input.focus()
            return
        self.reply.cancel()
        if self.reply.view.is_attached:
            self.reply.view.set_note("stopping…")

    async def action_regenerate(self) -> None:
        """Answer the last prompt again; the earlier answers are kept (alt+left steps back)."""
        if self.reply is not None:
            self.notify("a reply is still being generated; Esc stops it", severity="warning")
            return
        if self.session is None or self.store is None or self.active is None or self.loading:
            self.notify("no model is loaded yet", severity="warning")
            return
        conv = self.store.conversation(self.active)
        messages = self.store.messages(self.active)
        chat = self.chat_log()
        views = chat.messages() if chat else []
        if conv is None or not messages or not views:
            self.notify("there is no reply to regenerate", severity="warning")
            return
        if messages[-1].role == "user":  # a prompt left unanswered (the model did not load)
            self._note_on(messages[-1].id, "")
            await self._answer(conv, messages)
            return
        view = views[-1]
        reply = self._reply(
            conv, messages[:-1], view, variant_of=messages[-1],
            previous_text=view.content, previous_note=view._note,
        )
        await view.restart()
        self._start_reply(reply)

    async def step_answer(self, delta: int, message_id: int | None = None) -> None:
        """Show another version of a message (the last reply by default): an earlier or later
        answer, or another version of an edited prompt, with what followed it."""
        if self.reply is not None:
            self.notify("a reply is still being generated; Esc stops it", severity="warning")
            return
        if self.store is None or self.active is None:
            return
        path = self.store.messages(self.active)
        target = next((m for m in path if m.id == message_id), None) if message_id else None
        if target is None:
            target = next((m for m in reversed(path) if m.variants > 1), None)
        if target is None:
            self.notify("this conversation has no other answers (ctrl+r writes one)", severity="warning")
            return
        ids = self.store.variants(target.id)
        i = ids.index(target.id) + delta
        if not 0 <= i < len(ids):
            self.notify(f"version {target.variant} of {target.variants}", timeout=2)
            return
        self.store.select(ids[i])
        await self.show_path(self.active, focus=ids[i])

    async def action_previous_answer(self) -> None:
        await self.step_answer(-1, self._focused_message_id())

    async def action_next_answer(self) -> None:
        await self.step_answer(1, self._focused_message_id())

    def _focused_message_id(self) -> int | None:
        focused = self.focused
        return focused.message_id if isinstance(focused, MessageView) else None

    def on_message_view_edit_requested(self, event: MessageView.EditRequested) -> None:
        self.edit_prompt(event.message_id)

    def action_edit_prompt(self) -> None:
        self.edit_prompt(None)

    def edit_prompt(self, message_id: int | None) -> None:
        """Put a sent prompt (the last one by default) in the input: sending it resends the
        conversation from there, as another version (the old one and its answers are kept)."""
        if self.store is None or self.active is None:
            return
        if self.reply is not None:
            self.notify("a reply is still being generated; Esc stops it", severity="warning")
            return
        prompts = [m for m in self.store.messages(self.active) if m.role == "user"]
        chosen = next((m for m in prompts if m.id == message_id), prompts[-1] if prompts else None)
        if chosen is None:
            self.notify("nothing sent yet to edit", severity="warning")
            return
        self.editing = chosen.id
        self.input.text = chosen.content
        self.input.move_cursor(self.input.document.end)  # to go on writing, as a recalled prompt
        self.input.focus()
        self.update_status()


QUEUED = "queued: sent once the model is loaded"
