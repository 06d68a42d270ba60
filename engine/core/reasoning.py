"""A reasoning model's thinking, told apart from its answer as a reply streams.

Templates that think (Qwen3, DeepSeek R1, SmolLM3 and others) have the model write
``<think>...</think>`` before its answer, or open the block themselves at the end of the
prompt. :class:`ThinkSplitter` sends text inside the block to the reasoning side and the rest
to the answer, holding back only what may be the start of a tag (as llama.cpp's server
separates ``reasoning_content``). A gpt-oss reply's channels, as llama.cpp's text shows them,
are split by :mod:`.harmony`.
"""

from __future__ import annotations

from .harmony import split_rendered

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str) -> bool:
    """Whether a chat template has its model think in ``<think>`` blocks."""
    return OPEN in template or CLOSE in template


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt opened the reply's ``<think>`` block itself (DeepSeek R1's and
    Qwen3's thinking templates): the reply starts inside it (``ThinkSplitter(opened=...)``)."""
    return prompt_text.rstrip().endswith(OPEN)


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may start ``tag``."""
    return next((k for k in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-k:])), 0)


class ThinkSplitter:
    """Splits one reply into (reasoning, answer) text as it streams. ``opened``: the prompt
    already opened the block (it ends with ``<think>``)."""

    def __init__(self, opened: bool = False) -> None:
        self.state = "thinking" if opened else "start"  # start | thinking | answer
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text safe to send now."""
        self.held += text
        reasoning = answer = ""
        while self.held:
            if self.state == "start":  # a block may open only before any answer text
                stripped = self.held.lstrip()
                if stripped.startswith(OPEN):
                    self.held, self.state = stripped[len(OPEN):].lstrip("\n"), "thinking"
                elif OPEN.startswith(stripped):
                    break  # may still become the tag
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                at = self.held.find(CLOSE)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held, self.state = self.held[at + len(CLOSE):].lstrip(), "answer"
                    if not self.held:
                        self.state = "after"
                else:
                    keep = _partial(self.held, CLOSE)
                    reasoning += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep:]
                    break
            elif self.state == "after":  # whitespace between the block and the answer is dropped
                self.held = self.held.lstrip()
                if self.held:
                    self.state = "answer"
            else:
                answer, self.held = answer + self.held, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is left once the reply ended (an unclosed block stays reasoning)."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        return "", held if self.state != "after" else held.lstrip()


def split_thinking(text: str, *, opened: bool = False) -> tuple[str, str]:
    """(thinking, answer) of a whole reply; a ``</think>`` with no ``<think>`` before it closes
    a block the template opened. ``opened``: the prompt opened the block, so a reply cut before
    it closed is all thinking. A harmony reply: its analysis and its final channel."""
    harmony = split_rendered(text)
    if harmony is not None:
        return harmony
    close = text.find(CLOSE)
    splitter = ThinkSplitter(opened=opened or (close >= 0 and OPEN not in text[:close]))
    thought, answer = splitter.feed(text)
    more, rest = splitter.finish()
    return thought + more, answer + rest
