"""A scripted stand-in for the engine Session: a deterministic token stream with chosen
timings and per-round draft counters, so the app's tests need no model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from textual.pilot import Pilot

from potluck.engine.core.chat import Message
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.events import Event, Finished, ReplyStarted, RoundStats, TokenText
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.spec import EngineSpec


@dataclass(frozen=True)
class Step:
    """One round: text emitted after ``delay_s``, with the round's draft counters."""

    text: str
    drafted: int = 0
    accepted: int = 0
    draft_len: int = 0
    delay_s: float = 0.0
    gate: threading.Event | None = None  # the test opens it to let this step through


def words(text: str, delay_s: float = 0.0) -> list[Step]:
    """Plain decoding of ``text`` one word per round."""
    parts = text.split(" ")
    return [Step(p + (" " if i < len(parts) - 1 else ""), delay_s=delay_s) for i, p in enumerate(parts)]


Script = Callable[[str | None, list[Message]], list[Step]]


def prompt_tokens(messages: Sequence[Message]) -> int:
    return sum(len(m.content.split()) + 4 for m in messages)


class ScriptedSession:
    """Implements what the app uses of ``Session``; every reply follows ``script``."""

    def __init__(
        self,
        script: Script | list[Step],
        *,
        strategy: str = "autoregressive",
        n_ctx: int = 4096,
        fail: str | None = None,
        tokens_per_s: float = 50.0,
        ttft_s: float = 0.125,
        thinking_opened: bool = False,
    ) -> None:
        self.script = script if callable(script) else (lambda _u, _m, s=script: list(s))
        self.strategy = strategy
        self.messages: list[Message] = []
        self.n_ctx = n_ctx
        self.fail = fail
        self.tokens_per_s = tokens_per_s
        self.ttft_s = ttft_s
        self.thinking_opened = thinking_opened  # as a template that opens the <think> block would say
        self.loaded: list[list[Message]] = []
        self.fresh: list[bool] = []  # per load: whether the prompt is computed whole
        self.prompts: list[str | None] = []
        self.sampling: list[SamplingParams] = []
        self.closed = False
        self.running = threading.Event()
        self.run_id = 0  # the latest reply's
        self._cancel = threading.Event()

    def load_messages(self, messages: Sequence[Message], *, fresh: bool = False) -> None:
        self.messages = list(messages)
        self.loaded.append(list(messages))
        self.fresh.append(fresh)

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """A word is a token, and each message's framing 4 (as the prompt figure below)."""
        return prompt_tokens(messages) + 3

    def cancel(self, run_id: int | None = None) -> None:
        if run_id is None or run_id == self.run_id:
            self._cancel.set()

    def close(self) -> None:
        self.closed = True

    def cluster_view(self) -> None:
        return None  # one machine

    def generate(
        self, user: str | None, sampling: SamplingParams = SamplingParams(), max_tokens: int = 512
    ) -> Iterator[Event]:
        if self.fail is not None:
            raise PotluckError(self.fail)
        if user is not None:
            self.messages.append(Message("user", user))
        self.prompts.append(user)
        self.sampling.append(sampling)
        return self._run(self.script(user, list(self.messages)))

    def regenerate(
        self, sampling: SamplingParams = SamplingParams(), max_tokens: int = 512
    ) -> Iterator[Event]:
        if self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        return self.generate(None, sampling, max_tokens)

    def _run(self, steps: list[Step]) -> Iterator[Event]:
        self._cancel.clear()
        self.run_id = run = self.run_id + 1
        prompt = prompt_tokens(self.messages) + 3
        self.running.set()
        reason, text, tokens = "stop", [], []
        drafted = accepted = rounds = 0
        try:
            yield ReplyStarted(run, self.strategy, prompt, prompt, self.n_ctx, self.thinking_opened)
            for step in steps:
                if step.gate is not None:
                    while not step.gate.wait(0.005) and not self._cancel.is_set():
                        pass
                if self._cancel.wait(step.delay_s) if step.delay_s else self._cancel.is_set():
                    reason = "cancelled"
                    break
                n = step.accepted + 1  # accepted drafts + the target's own token
                ids = tuple(range(len(tokens), len(tokens) + n))
                tokens += ids
                text.append(step.text)
                rounds, drafted, accepted = rounds + 1, drafted + step.drafted, accepted + step.accepted
                yield RoundStats(run, step.drafted, step.accepted, n, step.draft_len, 0.0, 0.0, prompt + len(tokens))
                yield TokenText(run, step.text, ids)
        finally:
            self.running.clear()
            self.messages.append(Message("assistant", "".join(text)))
        yield Finished(
            run_id=run, reason=reason, text="".join(text), tokens=tuple(tokens), prompt_tokens=prompt,
            prefill_tokens=prompt, ttft_s=self.ttft_s, prefill_s=0.0, decode_s=1.0,
            tokens_per_s=self.tokens_per_s, prefill_tokens_per_s=0.0, drafted=drafted,
            accepted=accepted, rounds=rounds, strategy=self.strategy, n_past=prompt + len(tokens),
        )


class FakeFactory:
    """Session factory for ``build_app``: hands out sessions and remembers the specs asked."""

    def __init__(self, make: Callable[[EngineSpec], ScriptedSession]) -> None:
        self.make = make
        self.specs: list[EngineSpec] = []
        self.sessions: list[ScriptedSession] = []

    def __call__(self, spec: EngineSpec) -> ScriptedSession:
        self.specs.append(spec)
        session = self.make(spec)
        self.sessions.append(session)
        return session


async def until(
    cond: Callable[[], object], timeout_s: float = 10.0, what: str = "", state: Callable[[], object] | None = None
) -> None:
    """Poll ``cond`` on the app's event loop until it holds (never a fixed pause); ``state``:
    what the failure message shows of the app when it never does."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            seen = f" ({state()})" if state is not None else ""
            raise AssertionError(f"timed out waiting for {what or cond}{seen}")
        await asyncio.sleep(0.01)


async def click(pilot: Pilot, selector: str) -> None:
    """Click the widget where it is drawn now, and check the click landed on it.

    ``Pilot.click`` reads the widget's region before its own pause, so a layout still pending
    (rows just added above a button) moves the button away from the pointer and the click
    lands beside it: the cluster picker's "Use selected" missed that way on a quiet machine.
    ``Pilot.pause`` applies pending layout first."""
    await pilot.pause()
    assert await pilot.click(selector), f"the click missed {selector}"


def run_async(fn: Callable[..., object]) -> Callable[..., None]:
    """Run an ``async def`` test on a fresh event loop (no async pytest plugin needed)."""
    import asyncio
    import functools

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> None:
        asyncio.run(fn(*args, **kwargs))  # type: ignore[arg-type]

    return wrapper
