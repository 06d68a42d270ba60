"""The chat app's side of a reply: sending a message, drawing the streamed text, keeping
the finished (or failed, or stopped) reply, and regenerating the last one.

A mixin of :class:`~.app.PotluckApp`. The reply itself runs in a worker thread
(:func:`~.replies.reply_in_thread`); these handlers start it and take what it posts.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from functools import partial

from ...engine import Message
from ..config import Settings
from ..store import Store
from .actions import NEW_TITLE, title_from
from .cluster import ClusterState
from .replies import ChatSession, ClusterNotice, Reply, ReplyFailed, ReplyFinished, checkpoint_reply, reply_in_thread
from .stats import ReplyProgress
from .widgets import ChatInput, MessageView, finish_note

log = logging.getLogger(__name__)

GC_RESUME_AFTER_S = 0.3  # after a reply's end, well past its last frame's trip to the terminal


class ReplyHandlers:
    """Send, stream, finish, fail, stop and regenerate (the app's state lives on the app)."""

    settings: Settings
    session: ChatSession | None
    loading: bool
    store: Store | None
    active: int | None
    reply: Reply | None
    progress: ReplyProgress
    cluster_state: ClusterState | None
    clock: Callable[[], float]
    _engine_idle: threading.Event

    def _start_reply(self, reply: Reply, history: list[Message]) -> None:
        reply.session.load_messages(history)
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
            self.store.rename(conv.id, title_from(text))
        self.input.clear()
        chat = self.chat_log()
        assert chat is not None
        user_view = MessageView("user", text, message_id=stored.id)
        reply_view = MessageView("assistant", streaming=True)
        reply = Reply(conv.id, self.session, reply_view, text, user_view, stored.id, shown=False)
        # The engine starts before the views are mounted (25 ms of the UI thread): its
        # prompt computes meanwhile, and what it streams waits in the reply until drawn.
        self._start_reply(reply, history)
        await chat.mount_all([user_view, reply_view])
        reply.shown = True
        chat.scroll_end(animate=False)
        chat.call_after_refresh(chat.follow)
        await self.refresh_conversations()
        return True

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
                await reply.view.append(text)
        if self.store is not None:
            checkpoint_reply(self.store, reply)  # a crash loses at most SAVE_EVERY_S of it

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
                replaces=reply.replaces,
            )
            reply.view.message_id = stored.id
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
        self._reply_over()


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

