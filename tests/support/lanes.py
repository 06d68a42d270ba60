"""Conversations answered on lanes at the same time (engine/core/lanes.py), the hub stepped on
the calling thread as the server's owner thread does: what the lane tests share."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from potluck.engine import Finished, Lanes, Message, SamplingParams
from potluck.engine.core.events import Event


@dataclass
class Ask:
    """One conversation on one lane: its turns in order (``history`` loaded first, if any)."""

    lane: int
    turns: Sequence[str | None]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 24
    history: Sequence[Message] | None = None


def together(lanes: Lanes, asks: Sequence[Ask], on_event: Callable[[int, Event], None] | None = None
             ) -> list[list[Finished]]:
    """Every ask's turns answered on its lane's thread, the asks at the same time; returns each
    ask's replies. ``on_event(i, event)`` sees ask ``i``'s events as they come."""
    out: list[list[Finished]] = [[] for _ in asks]
    errors: list[BaseException] = []

    def answer(i: int) -> None:
        ask = asks[i]
        session = lanes.sessions[ask.lane]
        try:
            if ask.history is not None:
                session.load_messages(list(ask.history))
            for turn in ask.turns:
                for event in session.generate(turn, ask.sampling, ask.max_tokens):
                    if on_event is not None:
                        on_event(i, event)
                    if isinstance(event, Finished):
                        out[i].append(event)
        except BaseException as e:
            errors.append(e)
        finally:
            lanes.hub.activate(ask.lane, False)

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(len(asks))]
    for ask, t in zip(asks, threads):
        lanes.hub.activate(ask.lane)
        t.start()
    while any(t.is_alive() for t in threads):
        lanes.hub.step(0.05)
    if errors:
        raise errors[0]
    return out
