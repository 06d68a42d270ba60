"""Conversations answered on lanes at the same time (engine/core/lanes.py), the hub stepped on
the calling thread as the server's owner thread does: what the lane tests share. And scripted
lanes, no model, for tests of serve's engine thread (which lane a request takes, in which order
requests run)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

from potluck.engine import Finished, Lanes, Message, ReplyStarted, SamplingParams
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


class ScriptedLane:
    """What serve's engine thread reads of a lane's session, answering every prompt at once with
    an empty reply; ``ran`` gets (lane, owner, prompt text) per answer. It holds its last
    owner's prompt (``held_text``), as a session holds its conversation."""

    class target:  # noqa: N801 - the attribute the engine thread reads
        n_ctx = 64

    class model:  # noqa: N801 - Lanes.close closes it
        @staticmethod
        def close() -> None:
            pass

    def __init__(self, lane: int, ran: list[tuple[int, str, str]]) -> None:
        self.lane, self.ran, self.owner, self.covered = lane, ran, "", ""

    def answer(self, prompt: SimpleNamespace, sampling: object, max_tokens: int, *,
               owner: str, **shape: object) -> Iterator[object]:  # grammar, logprobs, n
        self.ran.append((self.lane, owner, prompt.text))
        self.owner, self.covered = owner, prompt.text
        yield ReplyStarted(1, "plain", 1, 1, 64)
        yield Finished(1, "stop", "", (), 1, 1, 0.0, 0.0, 0.0, 0.0, 0.0)

    def held_text(self, owner: str = "") -> str:
        return self.covered if owner == self.owner else ""

    def cancel(self, run_id: int | None = None) -> None:
        pass

    def end_choice(self) -> None:
        pass

    def close(self) -> None:
        pass


class IdleHub:
    """The lanes' hub with nothing to batch: the owner thread only looks again."""

    def step(self, wait_s: float) -> None:
        time.sleep(0.01)

    def activate(self, lane: int, active: bool = True) -> None:
        pass

    def wake(self) -> None:
        pass

    def regroup(self) -> None:
        pass

    def close(self) -> None:
        pass


def scripted_lanes(n: int) -> tuple[Lanes, list[tuple[int, str, str]]]:
    """``n`` scripted lanes over an idle hub, and the record of what they answered."""
    ran: list[tuple[int, str, str]] = []
    return Lanes(IdleHub(), [ScriptedLane(i, ran) for i in range(n)]), ran  # type: ignore[arg-type, list-item]
