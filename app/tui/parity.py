"""The chat app's speed against `potluck generate` (``potluck bench --chat-parity``).

The same greedy reply is streamed twice in one run: through the real chat app under
Textual's headless driver (the reply runner, text pump, Markdown and panels all run as
they do on screen) and through a `potluck generate --json` process. Both figures are the
engine's own decode speed (:attr:`Finished.tokens_per_s`), which is what the reply panel
shows, so the ratio says how much the app costs the engine. ``--load`` repeats both with
one background process spinning a core, as a busy machine (a compile, a browser) would.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ...engine import open_session, paths
from ..config import ModelSettings, SamplingSettings, Settings, UISettings

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class Speed:
    """One reply's decode speed and its tokens (the two paths must give the same ones)."""

    tokens_per_s: float
    tokens: tuple[int, ...]


def chat_app_reply(model: Path | None, prompt: str, max_tokens: int, n_threads: int, n_ctx: int) -> Speed:
    """Stream one reply through the real chat app (headless) and return its Finished figures."""
    return asyncio.run(_chat_app_reply(model, prompt, max_tokens, n_threads, n_ctx))


async def _chat_app_reply(model: Path | None, prompt: str, max_tokens: int, n_threads: int, n_ctx: int) -> Speed:
    from .app import build_app

    settings = Settings(
        # like for like with `generate`'s defaults: plain greedy decoding
        model=ModelSettings(path=str(model) if model else None, n_ctx=n_ctx, n_threads=n_threads,
                            strategy="plain"),
        sampling=SamplingSettings(max_tokens=max_tokens, temperature=0.0),
        ui=UISettings(cursor_blink=False),
    )
    with tempfile.TemporaryDirectory(prefix="potluck-parity-") as home:
        paths.override_home(Path(home))
        try:
            app = build_app(settings=settings, session_factory=open_session, copy_fallback=lambda _t: "-")
            async with app.run_test(size=(120, 40)) as pilot:
                await _until(lambda: app.session is not None or app.load_error is not None, 300)
                if app.load_error is not None:
                    raise RuntimeError(app.load_error)
                app.input.text = prompt
                await pilot.press("enter")
                # The app keeps the last reply's progress (with its Finished) once it is drawn.
                await _until(lambda: app.reply is None and app.progress.finished is not None, 600)
                f = app.progress.finished
                await pilot.pause()
        finally:
            paths.override_home(None)
    assert f is not None
    return Speed(f.tokens_per_s, f.tokens)


async def _until(condition: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("the chat app did not finish the reply in time")
        await asyncio.sleep(0.05)


def generate_reply(model: Path | None, prompt: str, max_tokens: int, n_threads: int, n_ctx: int) -> Speed:
    """The same reply from a `potluck generate --json` process, as a user would run it."""
    argv = [sys.executable, "-m", "potluck.app.cli", "generate", "--json", "--max-tokens", str(max_tokens),
            "--threads", str(n_threads), "--ctx", str(n_ctx)]
    if model is not None:
        argv += ["-m", str(model)]
    out = subprocess.run([*argv, prompt], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"potluck generate failed: {out.stderr.strip()}")
    data = json.loads(out.stdout)
    return Speed(float(data["tokens_per_s"]), tuple(data["tokens"]))


def _spin() -> None:  # pragma: no cover - runs in the background process
    while True:
        pass


@contextmanager
def one_core_busy(busy: bool) -> Iterator[None]:
    """A background process spinning one core for the duration (nothing when ``busy`` is False)."""
    if not busy:
        yield
        return
    proc = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    proc.start()
    try:
        time.sleep(0.5)  # let it take its core
        yield
    finally:
        proc.terminate()
        proc.join(5)


@dataclass(frozen=True)
class ParityRow:
    load: str  # "quiet" or "one core busy"
    chat_tokens_per_s: float
    generate_tokens_per_s: float
    identical: bool  # the two paths produced the same tokens

    @property
    def ratio(self) -> float:
        return self.chat_tokens_per_s / self.generate_tokens_per_s if self.generate_tokens_per_s else 0.0


def run_parity(
    model: Path | None, prompt: str, max_tokens: int, reps: int, n_threads: int, n_ctx: int,
    with_load: bool, progress: object = None,
) -> list[ParityRow]:
    """Quiet (and, with ``with_load``, one core busy) rows; medians over ``reps`` alternated runs."""
    import statistics

    rows = []
    for load in (False, True) if with_load else (False,):
        chat, gen, same = [], [], True
        with one_core_busy(load):
            for rep in range(reps):
                if progress is not None:
                    progress(f"{'one core busy' if load else 'quiet'}: rep {rep + 1}/{reps}")  # type: ignore[operator]
                g = generate_reply(model, prompt, max_tokens, n_threads, n_ctx)
                c = chat_app_reply(model, prompt, max_tokens, n_threads, n_ctx)
                chat.append(c.tokens_per_s)
                gen.append(g.tokens_per_s)
                same = same and c.tokens == g.tokens
        rows.append(ParityRow("one core busy" if load else "quiet", statistics.median(chat),
                              statistics.median(gen), same))
    return rows


def format_parity(rows: list[ParityRow], max_tokens: int, reps: int) -> str:
    import os

    wait = os.environ.get("OMP_WAIT_POLICY", "default (spin, then sleep)").lower()
    lines = [f"chat app (headless) vs potluck generate: same greedy reply, {max_tokens} tokens, "
             f"medians of {reps}; llama.cpp threads wait {wait}"
             " (OMP_WAIT_POLICY)", "",
             f"{'load':<15}{'chat tok/s':>11}{'generate tok/s':>15}{'chat/generate':>14}  identical"]
    quiet = rows[0]
    for r in rows:
        lines.append(f"{r.load:<15}{r.chat_tokens_per_s:>11.1f}{r.generate_tokens_per_s:>15.1f}"
                     f"{r.ratio:>13.2f}x  {'yes' if r.identical else 'NO'}")
    for r in rows[1:]:
        lines.append(
            f"busy/quiet: chat {r.chat_tokens_per_s / quiet.chat_tokens_per_s:.2f}x, "
            f"generate {r.generate_tokens_per_s / quiet.generate_tokens_per_s:.2f}x"
        )
    return "\n".join(lines)
