"""Which part of a conversation is sent when it no longer fits the context (pure, no Textual).

As ollama and LM Studio do, the system prompt and the latest turns are kept and the oldest
turns are left out, whole turns at a time (a kept history starts with a user message, which
some chat templates require). A cut goes deeper than it must, down to half the context, and
stays where it is on the next turns: the KV cache of the part sent is then reused turn after
turn, instead of every turn shifting the start and computing the whole prompt again.

When the start moves, the app has the session compute the prompt whole (``fresh``), so the
reply equals what a fresh session gives for the history actually sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...engine import Message, PotluckError

CUT_TO = 0.5  # a cut leaves the prompt at most this share of the context


@dataclass(frozen=True)
class Fit:
    """What is sent: the system prompt (if any) and ``turns[first:]``."""

    messages: list[Message]
    first: int  # index of the first turn sent
    tokens: int  # the prompt's tokens

    @property
    def dropped(self) -> int:
        return self.first


def reply_room(n_ctx: int, max_tokens: int) -> int:
    """Tokens kept free for the reply: the longest reply, at most a quarter of the context."""
    return max(1, min(max_tokens, n_ctx // 4))


def fit_history(
    system: Message | None,
    turns: Sequence[Message],
    count: Callable[[list[Message]], int],
    n_ctx: int,
    room: int,
    start: int = 0,
    settings_key: str = "F6",
) -> Fit:
    """The messages to send: ``turns[start:]`` if they leave ``room`` tokens for the reply,
    else fewer, from a later user message, down to :data:`CUT_TO` of the context. ``count``
    gives a prompt's tokens (``Session.count_tokens``); it is called about log2(turns) times.

    Raises PotluckError when even the last user message does not fit the context."""
    head = [system] if system is not None else []
    if not turns:
        return Fit(head, 0, count(head))
    starts = [i for i, m in enumerate(turns) if m.role == "user" and i >= start] or [len(turns) - 1]

    def sent(i: int) -> list[Message]:
        return head + list(turns[i:])

    tokens = count(sent(starts[0]))
    if tokens + room <= n_ctx:
        return Fit(sent(starts[0]), starts[0], tokens)
    goal = max(n_ctx * CUT_TO, 1)
    # the first start (fewest turns dropped) whose prompt is within the goal; prompts shrink
    # as the start moves later, so a binary search over the user messages finds it
    lo, hi = 0, len(starts) - 1
    best = (starts[-1], count(sent(starts[-1])))
    while lo <= hi:
        mid = (lo + hi) // 2
        n = best[1] if starts[mid] == best[0] else count(sent(starts[mid]))
        if n <= goal:
            best, hi = (starts[mid], n), mid - 1
        else:
            lo = mid + 1
    first, tokens = best
    if tokens + 1 > n_ctx:  # the latest message alone is too long: only the user can fix that
        what = "your message" if len(turns) - first == 1 else "the latest turn"
        raise PotluckError(
            f"{what} is {tokens} tokens with the system prompt but the context holds {n_ctx}; "
            f"shorten it or raise the context ({settings_key}, Settings)"
        )
    return Fit(sent(first), first, tokens)


def context_note(dropped: int, n_ctx: int, settings_key: str) -> str:
    """The line the conversation shows where what is sent begins."""
    s = "" if dropped == 1 else "s"
    return f"{dropped} earlier message{s} not sent: the context holds {n_ctx:,} tokens ({settings_key} raises it)"
