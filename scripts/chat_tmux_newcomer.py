"""The chat app as a newcomer meets it (issue 41), driven in tmux on the real bundled model:

    .venv/bin/python -m scripts.chat_tmux_newcomer [--out DIR]

A throwaway POTLUCK_HOME whose config.toml keeps a copy of the bundled model in a library
folder (a model with the same vocabulary, as the README's 1.7B + 135M setup: the picker
crashed on it) and a small context (256 tokens) so a conversation outgrows it in a few turns.
In a 120x40 pane: the first screen; long questions until the oldest turns are left out and
the conversation goes on; editing the last prompt and resending; regenerating and stepping
back to the first answer; a search; the settings dialog; the picker; then the same chat at
80x24 and 60x20. Each step waits on what the screen shows (never a fixed pause) and its pane
is written to DIR/NN-step.txt and printed. Exit code 0 when every step showed what it should.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from potluck.assets import default_model_path

from .chat_tmux_speed import TmuxControl, tmux

QUESTION = (
    "Tell me about {}: where the name comes from, what people believed about it long ago, what "
    "scientists know today, and one surprising fact. Keep it simple, it is for a school report."
)
TOPICS = ["the moon", "volcanoes", "honey bees", "the river Nile", "owls", "glaciers", "comets", "tides"]


class Newcomer:
    def __init__(self, name: str, out: Path) -> None:
        self.name, self.out, self.step = name, out, 0
        self.ctl = TmuxControl(name)

    def screen(self) -> str:
        return self.ctl.capture()

    def wait(self, what: str, cond: Callable[[str], bool], timeout_s: float = 240.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.screen()
            if cond(text):
                return text
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for {what}; the screen:\n{text}")
            time.sleep(0.2)

    def keys(self, *keys: str, literal: bool = False) -> None:
        args = ["send-keys", "-t", self.name, *(["-l"] if literal else []), *keys]
        tmux(*args)

    def ready(self) -> str:
        """The status line is back at "ready" (a reply is stored and drawn)."""
        return self.wait("the app to be ready", lambda s: "ready ·" in s.splitlines()[0] if s else False)

    def shot(self, title: str) -> str:
        self.step += 1
        text = self.screen()
        path = self.out / f"{self.step:02d}-{title}.txt"
        path.write_text(text, encoding="utf-8")
        print(f"\n===== {self.step:02d} {title} ({path.name}) =====\n{text}", flush=True)
        return text

    def resize(self, cols: int, rows: int) -> None:
        tmux("resize-window", "-t", self.name, "-x", str(cols), "-y", str(rows))


def run(out: Path) -> None:
    bundled = default_model_path()
    assert bundled is not None, "the bundled model is missing"
    home = Path(tempfile.mkdtemp(prefix="potluck-newcomer-"))
    library = home / "models"
    library.mkdir()
    shutil.copy(bundled, library / "SmolLM2-135M-copy.gguf")  # the same vocabulary: a draft candidate
    (home / "config").mkdir()
    (home / "config" / "config.toml").write_text(
        "# my potluck settings\n[model]\nn_ctx = 256  # small, so the chat outgrows it\n"
        f'library = ["{library}"]\n\n[sampling]\nmax_tokens = 64\n', encoding="utf-8"
    )
    name = f"potluck-newcomer-{os.getpid()}"
    cmd = f"POTLUCK_HOME={home} {sys.executable} -m potluck.app.cli"
    tmux("new-session", "-d", "-s", name, "-x", "120", "-y", "40", cmd)
    tmux("set-option", "-t", name, "window-size", "manual")
    me = Newcomer(name, out)
    try:
        me.ready()
        me.shot("first-start")
        for topic in TOPICS:  # until the oldest turns are left out, and one more turn after that
            me.keys(QUESTION.format(topic), literal=True)
            me.keys("Enter")
            me.wait("the reply to start", lambda s: "generating" in s or "reading the prompt" in s, 60)
            text = me.ready()
            if "not sent" in text:
                break
        me.shot("context-full-and-going-on")
        assert "not sent" in me.screen(), "the context never filled"
        me.keys(QUESTION.format("the sun"), literal=True)
        me.keys("Enter")
        me.wait("the reply to start", lambda s: "generating" in s or "reading the prompt" in s, 60)
        me.ready()
        me.shot("one-more-turn")
        me.keys("M-e")  # edit the last prompt
        me.wait("the edit", lambda s: "editing" in s, 30)
        me.keys("End")
        me.keys(" Answer in one sentence.", literal=True)
        me.shot("editing-a-sent-prompt")
        me.keys("Enter")
        me.wait("the resent reply", lambda s: "generating" in s or "reading the prompt" in s, 60)
        me.ready()
        me.shot("edited-and-resent")
        me.keys("C-r")
        me.wait("the regeneration", lambda s: "generating" in s, 60)
        me.wait("two answers", lambda s: "2/2" in s)
        me.ready()
        me.shot("regenerated")
        me.keys("M-Left")
        me.wait("the first answer", lambda s: "1/2" in s, 30)
        me.shot("stepped-back-to-the-first-answer")
        me.keys("C-f")
        me.wait("the search", lambda s: "Search every conversation" in s, 30)
        me.keys("volcanoes", literal=True)
        me.wait("hits", lambda s: "message" in s and "volcanoes" in s.split("Search every conversation")[-1], 30)
        me.shot("search")
        me.keys("Down", "Enter")
        me.wait("the hit opened", lambda s: "Search every conversation" not in s, 30)
        me.shot("search-hit-opened")
        me.keys("Escape")
        me.keys("F6")
        me.wait("the settings", lambda s: "Temperature" in s, 30)
        me.shot("settings")
        me.keys("Escape")
        me.wait("the settings closed", lambda s: "Temperature" not in s, 30)
        me.keys("C-o")
        me.wait("the picker", lambda s: "Model and decoding strategy" in s and "copy" in s, 60)
        me.shot("picker-with-a-same-vocabulary-model")
        me.keys("Escape")
        me.wait("the picker closed", lambda s: "Model and decoding strategy" not in s, 30)
        me.resize(80, 24)
        # the app laid out again: below 100 columns the conversation list folds away
        me.wait("80 columns", lambda s: "Conversations" not in s and "ready ·" in s.splitlines()[0], 30)
        me.shot("80x24")
        me.keys("F1")
        me.wait("the help", lambda s: "Keys" in s and "Everywhere" in s, 30)
        me.shot("80x24-help")
        me.keys("Escape")
        me.resize(60, 20)
        me.wait("60 columns", lambda s: len(s.splitlines()) <= 20 and "ready ·" in s.splitlines()[0], 30)
        me.keys("F6")
        me.wait("the settings", lambda s: "Save" in s and "Cancel" in s, 30)
        me.shot("60x20-settings")
        me.keys("Escape")
        me.keys("C-q")
        deadline = time.monotonic() + 30
        while subprocess.run(["tmux", "has-session", "-t", name], capture_output=True).returncode == 0:
            if time.monotonic() > deadline:
                raise TimeoutError("ctrl+q did not quit")
            time.sleep(0.2)
        print("\nquit with ctrl+q; every step showed what it should", flush=True)
    finally:
        me.ctl.close()
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True, check=False)
        shutil.rmtree(home, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "potluck-newcomer")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
