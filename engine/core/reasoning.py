"""A reasoning model's thinking, told apart from its answer as a reply streams.

Templates that think (Qwen3, DeepSeek R1, SmolLM3 and others) have the model write
``<think>...</think>`` before its answer, or open the block themselves at the end of the
prompt; Gemma 4 writes a thought channel, ``<|channel>thought ... <channel|>`` (llama.cpp's
``common/parsers/gemma4.cpp``). :class:`ThinkSplitter` sends text inside the block to the
reasoning side and the rest to the answer, holding back only what may be the start of a tag
(as llama.cpp's server separates ``reasoning_content``). A gpt-oss reply's channels, as
llama.cpp's text shows them, are split by :mod:`.harmony`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .harmony import split_rendered


@dataclass(frozen=True)
class ThinkTags:
    """How one family of models opens and closes its thinking. ``repeats``: a block may come
    again after answer text (Gemma 4 may end a reply with an empty thought channel, or a lone
    closing tag, which llama.cpp's parser takes out of the answer)."""

    open: str
    close: str
    repeats: bool = False


THINK = ThinkTags("<think>", "</think>")
GEMMA4_THOUGHT = ThinkTags("<|channel>thought", "<channel|>", repeats=True)  # not gpt-oss's "<|channel|>"
FAMILIES = (THINK, GEMMA4_THOUGHT)
OPEN, CLOSE = THINK.open, THINK.close


def template_tags(template: str) -> ThinkTags | None:
    """The tags a chat template has its model think in, or None."""
    if OPEN in template or CLOSE in template:
        return THINK
    if "<|channel>" in template or GEMMA4_THOUGHT.close in template:
        return GEMMA4_THOUGHT
    return None


def thinks(template: str) -> bool:
    """Whether a chat template has its model think (a ``<think>`` block, Gemma 4's thought channel)."""
    return template_tags(template) is not None


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt opened the reply's ``<think>`` block itself (DeepSeek R1's and
    Qwen3's thinking templates): the reply starts inside it (``ThinkSplitter(opened=...)``)."""
    return prompt_text.rstrip().endswith(OPEN)


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may start ``tag``."""
    return next((k for k in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-k:])), 0)


class ThinkSplitter:
    """Splits one reply into (reasoning, answer) text as it streams. ``opened``: the prompt
    already opened the block (it ends with ``<think>``). ``families``: the tags the reply may
    open its block with (the template's, or every family where it is not known); the first
    one when ``opened``."""

    def __init__(self, opened: bool = False, families: tuple[ThinkTags, ...] = (THINK,)) -> None:
        self.state = "thinking" if opened else "start"  # start | thinking | answer
        self.held = ""
        self.families = families
        self.tags = families[0]  # the block's, once it opened
        self.fresh = True  # no thinking text yet: newlines after the opening tag are dropped

    @classmethod
    def for_template(cls, template: str, opened: bool = False) -> ThinkSplitter:
        """The splitter of a reply to a prompt rendered by ``template`` (its family's tags)."""
        return cls(opened, (template_tags(template) or THINK,))

    @classmethod
    def of_any_family(cls, opened: bool = False) -> ThinkSplitter:
        """A splitter for a reply whose template is not at hand (a reply already streaming)."""
        return cls(opened, FAMILIES)

    @staticmethod
    def may_open(start: str) -> bool:
        """Whether a reply beginning with ``start`` (stripped) opens, or may yet open, a block:
        Gemma 4's first token is ``<|channel>``, its tag's first part."""
        return bool(start) and any(start.startswith(t.open) or t.open.startswith(start) for t in FAMILIES)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text safe to send now."""
        self.held += text
        reasoning = answer = ""
        while self.held:
            if self.state == "start":  # a block may open only before any answer text
                stripped = self.held.lstrip()
                opened = next((t for t in self.families if stripped.startswith(t.open)), None)
                if opened is not None:
                    self.tags = opened
                    self.held, self.state = stripped[len(opened.open):], "thinking"
                elif any(t.open.startswith(stripped) for t in self.families):
                    break  # may still become a tag
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                if self.fresh:  # the newline after the tag may come as a token of its own
                    self.held = self.held.lstrip("\n")
                    if not self.held:
                        break
                    self.fresh = False
                close = self.tags.close
                at = self.held.find(close)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held, self.state = self.held[at + len(close):].lstrip(), "answer"
                    if not self.held:
                        self.state = "after"
                else:
                    keep = _partial(self.held, close)
                    reasoning += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep:]
                    break
            elif self.state == "after":  # whitespace between the block and the answer is dropped
                self.held = self.held.lstrip()
                if self.held:
                    self.state = "answer"
            elif not self.tags.repeats:
                answer, self.held = answer + self.held, ""
            else:  # another block may open, or a lone closing tag come (dropped)
                tags = (self.tags.open, self.tags.close)
                hits = [(at, tag) for tag in tags if (at := self.held.find(tag)) >= 0]
                if hits:
                    at, tag = min(hits)
                    answer += self.held[:at]
                    self.held = self.held[at + len(tag):]
                    if tag == self.tags.open:
                        self.state, self.fresh = "thinking", True
                    continue
                keep = max(_partial(self.held, tag) for tag in tags)
                answer += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
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
    tags = next((t for t in FAMILIES if t.open in text or t.close in text), THINK)
    close = text.find(tags.close)
    splitter = ThinkSplitter(opened=opened or (close >= 0 and tags.open not in text[:close]), families=(tags,))
    thought, answer = splitter.feed(text)
    more, rest = splitter.finish()
    return thought + more, answer + rest
