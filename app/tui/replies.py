"""The engine side of the chat app: loading a model and streaming a reply, each in a worker thread.

A reply is one task (as in oterm): its thread streams the engine's events, and Esc cancels
it. The threads talk to the UI only through the Textual messages below and the
:class:`Reply` they share, so typing, scrolling and switching conversations never wait on
a decode; the app only starts them and handles what they post.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from textual.message import Message as TMessage

from ...engine import (
    EngineSpec,
    Event,
    Finished,
    Message,
    NodeStatus,
    PlanChanged,
    PotluckError,
    ReplyStarted,
    SamplingParams,
    TokenText,
)
from ..config import SamplingSettings
from ..store import Store
from .context import Fit, fit_history, reply_room
from .stats import ReplyProgress
from .widgets import MessageView

log = logging.getLogger(__name__)

SAVE_EVERY_S = 0.5  # a streaming reply is saved this often: a crash loses at most ~this much text


class ChatSession(Protocol):
    """What the app needs from :class:`potluck.engine.core.session.Session` (tests fake it)."""

    messages: list[Message]

    @property
    def n_ctx(self) -> int: ...

    def count_tokens(self, messages: Sequence[Message]) -> int: ...

    def generate(
        self, user: str | None, sampling: SamplingParams = ..., max_tokens: int = ...
    ) -> Iterator[Event]: ...

    def regenerate(self, sampling: SamplingParams = ..., max_tokens: int = ...) -> Iterator[Event]: ...

    def cancel(self, run_id: int | None = None) -> None: ...

    def load_messages(self, messages: Sequence[Message], *, fresh: bool = False) -> None: ...

    def close(self) -> None: ...


SessionFactory = Callable[[EngineSpec], ChatSession]
Post = Callable[[TMessage], bool]  # App.post_message: False once the app is gone


@dataclass
class Reply:
    """One reply in flight: where it streams to, what it will be stored as, how far it got."""

    conversation_id: int
    session: ChatSession
    view: MessageView
    user_text: str | None  # None: answer the conversation as it stands (regenerate, a queued prompt)
    user_view: MessageView | None = None
    user_message_id: int | None = None
    variant_of: int | None = None  # regenerate: the stored reply the new one is another answer to
    # What may be sent (the reply thread fits it to the context): the system prompt and the
    # turns, the new prompt last; their ids in the history, and where the last cut began.
    system: Message | None = None
    turns: list[Message] = field(default_factory=list)
    turn_ids: list[int | None] = field(default_factory=list)
    start: int = 0
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    fit: Fit | None = None  # set by the reply thread before it generates
    settings_key: str = "F6"  # named when the prompt alone is too long for the context
    previous_text: str = ""
    previous_note: str = ""
    got_text: bool = False
    thinking_opened: bool = False  # the prompt opened a <think> block (ReplyStarted): the reply starts in it
    shown: bool = True  # its view is mounted (send starts the engine first): the pump waits
    # The panels' figures; the reply thread replaces the (immutable) snapshot per event.
    progress: ReplyProgress = field(default_factory=ReplyProgress)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # What happened to the cluster during the reply (a lost worker, a re-plan): its note says it.
    cluster_notes: list[str] = field(default_factory=list)
    # Text the engine thread produced that the UI has not drawn yet (guarded by the lock).
    pending: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # UI thread: the text taken so far, and what of it the history holds (checkpoint_reply).
    text: str = ""
    draft_id: int | None = None
    saved_len: int = 0
    saved_at: float = float("-inf")

    @property
    def parent_id(self) -> int | None:
        """The stored message this reply answers: the last turn sent."""
        return self.turn_ids[-1] if self.turn_ids else None

    @property
    def context_from(self) -> int | None:
        """The first message sent, when the oldest were left out (None: all were sent)."""
        fit = self.fit
        return self.turn_ids[fit.first] if fit is not None and fit.first > 0 else None

    def push(self, text: str) -> None:  # engine thread
        with self.lock:
            self.pending.append(text)

    def take(self) -> str:  # UI thread
        with self.lock:
            text = "".join(self.pending)
            self.pending.clear()
        self.text += text
        return text

    def cancel(self) -> None:  # any thread
        """Stop the reply after the engine's current step; the partial text is kept."""
        self.cancelled.set()
        self.session.cancel()


def checkpoint_reply(store: Store, reply: Reply, now: float | None = None) -> None:  # UI thread
    """Save the streaming reply's text to the history if it grew and the last save is
    ``SAVE_EVERY_S`` old, so a killed app loses at most that much; the finished reply then
    takes the saved one's place (:meth:`Store.add_message`)."""
    now = time.monotonic() if now is None else now
    if len(reply.text) == reply.saved_len or now - reply.saved_at < SAVE_EVERY_S:
        return
    if store.conversation(reply.conversation_id) is None:
        return  # deleted while it streamed
    if reply.draft_id is None:
        reply.draft_id = store.begin_reply(
            reply.conversation_id, reply.text, parent=reply.parent_id, variant_of=reply.variant_of
        )
    else:
        store.save_partial(reply.draft_id, reply.text)
    reply.saved_len, reply.saved_at = len(reply.text), now


class ReplyFinished(TMessage):
    def __init__(self, reply: Reply, finished: Finished) -> None:
        super().__init__()
        self.reply, self.finished = reply, finished


class ClusterEvent(TMessage):
    """A stage's health or the chain's plan changed (cluster panel; a few per reply)."""

    def __init__(self, reply: Reply, event: NodeStatus | PlanChanged) -> None:
        super().__init__()
        self.reply, self.event = reply, event


class ClusterNotice(TMessage):
    """The cluster lost a worker and carried on over a new plan (the reply goes on)."""

    def __init__(self, reply: Reply, text: str) -> None:
        super().__init__()
        self.reply, self.text = reply, text


class ContextFitted(TMessage):
    """The conversation did not fit the context: the reply is sent without its oldest turns."""

    def __init__(self, reply: Reply, fit: Fit) -> None:
        super().__init__()
        self.reply, self.fit = reply, fit


class ReplyFailed(TMessage):
    def __init__(self, reply: Reply, error: str) -> None:
        super().__init__()
        self.reply, self.error = reply, error


class SessionLoaded(TMessage):
    def __init__(self, spec: EngineSpec, session: ChatSession | None, error: str | None) -> None:
        super().__init__()
        self.spec, self.session, self.error = spec, session, error


def load_in_thread(post: Post, factory: SessionFactory, spec: EngineSpec) -> None:  # worker thread
    """Open a session for ``spec`` and post :class:`SessionLoaded`, with the session or the error."""
    try:
        session = factory(spec)
    except PotluckError as e:
        post(SessionLoaded(spec, None, str(e)))
    except Exception as e:  # a crash in llama.cpp bindings must not take the UI down
        log.exception("loading the model failed")
        post(SessionLoaded(spec, None, f"{type(e).__name__}: {e}"))
    else:
        if not post(SessionLoaded(spec, session, None)):
            session.close()  # the app is gone


def fit_reply(reply: Reply) -> Fit:  # worker thread
    """What of the conversation to send: all of it if it leaves room for the reply, else the
    last cut (the KV cache of what was sent then is reused), else a new, deeper cut."""
    session, sampling = reply.session, reply.sampling
    room = reply_room(session.n_ctx, sampling.max_tokens)
    count = session.count_tokens
    if not reply.turns and reply.user_text is not None:  # a bare reply: its prompt alone
        reply.turns, reply.turn_ids = [Message("user", reply.user_text)], [None]
    key = reply.settings_key
    whole = fit_history(reply.system, reply.turns, count, session.n_ctx, room, settings_key=key)
    if whole.first == 0 or reply.start == 0:
        return whole
    return fit_history(reply.system, reply.turns, count, session.n_ctx, room, start=reply.start, settings_key=key)


def reply_in_thread(
    post: Post,
    reply: Reply,
    clock: Callable[[], float],
    idle: threading.Event,
) -> None:  # worker thread
    """Stream one reply: text goes to ``reply.pending`` (drawn by the UI's pump, never per
    token), every event into ``reply.progress`` stamped with ``clock``, and the end is
    posted as :class:`ReplyFinished` or :class:`ReplyFailed`. ``idle`` is set on the way out.

    First the conversation is fitted to the context (:func:`fit_reply`); when its start moved,
    the session computes the prompt whole, so the reply is what a fresh session gives for the
    messages sent (:meth:`Session.load_messages`)."""
    try:
        sampling = reply.sampling
        params = sampling.params()
        fit = reply.fit = fit_reply(reply)
        if fit.first > 0:
            post(ContextFitted(reply, fit))
        fresh = fit.first != reply.start
        if reply.user_text is None:
            reply.session.load_messages(fit.messages, fresh=fresh)
            events = reply.session.regenerate(params, sampling.max_tokens)
        else:
            reply.session.load_messages(fit.messages[:-1], fresh=fresh)
            events = reply.session.generate(reply.user_text, params, sampling.max_tokens)
        for event in events:
            reply.progress = reply.progress.after(event, clock())
            if isinstance(event, ReplyStarted):
                reply.thinking_opened = event.thinking_opened  # before any of its text is pushed
                if reply.cancelled.is_set():
                    reply.session.cancel(event.run_id)  # Esc came before the engine started this run
            elif isinstance(event, TokenText) and event.text:
                reply.push(event.text)
            elif isinstance(event, PlanChanged):
                post(ClusterEvent(reply, event))
                post(ClusterNotice(reply, event.reason))
            elif isinstance(event, NodeStatus):
                post(ClusterEvent(reply, event))
            elif isinstance(event, Finished):
                post(ReplyFinished(reply, event))
    except Exception as e:
        reply.progress = reply.progress.stopped()
        if isinstance(e, PotluckError):
            error = str(e)
        else:
            log.exception("generation failed")
            error = f"generation failed: {type(e).__name__}: {e}"
        post(ReplyFailed(reply, error))
    finally:
        idle.set()
