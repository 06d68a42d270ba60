"""gpt-oss's harmony format: a reply is messages on channels, opened and closed by control
tokens, so it is read from the reply's tokens with those tokens marked (:func:`harmony_bytes`):
text that merely spells a control token's name ("<|end|>" in an answer about harmony) stays text.

After the prompt's ``<|start|>assistant``, each message is a header, ``<|message|>``, a body
and an end: ``<|end|>`` (another message follows, from ``<|start|>assistant``), or the reply's
end (``<|return|>`` or ``<|call|>``, end-of-generation tokens the text leaves out). The header
names the channel: ``analysis`` is the model's thinking (``reasoning_content``), ``final`` the
answer, and ``commentary`` with a recipient (``to=functions.NAME``) a tool call whose body is
its arguments' JSON; commentary to no one is text for the user, as OpenAI's preambles are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .chat import ToolCall
from .runtime import RENDERED_MARKERS
from .tools import HARMONY, CallPart, Tool, new_call_id, tool_format

MARK = "\ue000"  # before a control token's text (a private-use character: no model's text has it)
MESSAGE, END, START, CHANNEL = (MARK + m for m in ("<|message|>", "<|end|>", "<|start|>", "<|channel|>"))
_ENDS = (END, MARK + "<|return|>", MARK + "<|call|>")
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_-]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class _Vocab(Protocol):
    def token_bytes(self, token: int, *, special: bool = False) -> bytes: ...

    def control_ids(self) -> frozenset[int]: ...


def harmony_bytes(model: _Vocab, tokens: Iterable[int]) -> Iterator[bytes]:
    """The bytes of ``tokens`` for :class:`HarmonyScanner`: a control token's name after
    :data:`MARK`, other tokens' text as it is (any MARK in it dropped)."""
    mark, control = MARK.encode(), model.control_ids()
    for t in tokens:
        if t in control:
            yield mark + model.token_bytes(t, special=True)
        else:
            yield model.token_bytes(t).replace(mark, b"")


# the markers llama.cpp renders as text (the end-of-generation ones never reach a reply's text)
_RENDERED = re.compile("|".join(map(re.escape, sorted(RENDERED_MARKERS))))


def split_rendered(text: str) -> tuple[str, str] | None:
    """(thinking, answer) of a harmony reply as llama.cpp's text shows it, markers written out
    (the chat app's and ``generate``'s text); None if ``text`` is not in channels."""
    if "<|channel|>" not in text:
        return None
    reader = RenderedReader()
    (thought, answer), (more, rest) = reader.feed(text), reader.finish()
    return thought + more, answer + rest


class RenderedReader:
    """A harmony reply read from llama.cpp's text as it streams, markers written out. Each marker
    is one token, so it never arrives cut between two pieces. Unlike :func:`harmony_bytes`, text
    cannot tell a marker from its name spelled out: for display and for the history sent back,
    never for calls. Reads as :class:`~.reasoning.ThinkSplitter` does: (thinking, answer) pieces."""

    def __init__(self) -> None:
        self._scanner = HarmonyScanner()

    def feed(self, text: str) -> tuple[str, str]:
        read = self._scanner.feed(_RENDERED.sub(lambda m: MARK + m.group(0), text))
        return read.reasoning, read.content

    def finish(self) -> tuple[str, str]:
        read = self._scanner.finish()
        return read.reasoning, read.content


def is_harmony(template: str) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss's)."""
    return tool_format(template) == HARMONY


@dataclass
class Read:
    """What one piece of a reply gave: answer text, thinking, pieces of calls."""

    content: str = ""
    reasoning: str = ""
    parts: list[CallPart] = field(default_factory=list)


def _partial_marker(text: str) -> int:
    """How many characters at the end of ``text`` may be a control token's marked name, cut."""
    at = text.rfind(MARK)
    return len(text) - at if at >= 0 and "|>" not in text[at:] else 0


class HarmonyScanner:
    """Splits a harmony reply, streamed, into answer text, thinking and tool calls.

    ``stream_calls``: a call's pieces come as they are written (a forced call, whose grammar
    makes it well-formed); else a call comes whole at the end, and one that is not a call to
    one of ``tools`` with a JSON object for its arguments comes back as text.
    """

    def __init__(self, tools: Sequence[Tool] = (), stream_calls: bool = False, reasoning: bool = True) -> None:
        self.names = {t.name for t in tools}
        self.stream_calls = stream_calls
        self.reasoning = reasoning  # the analysis channel as thinking (else as answer text)
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet read
        self._channel: str | None = None  # the open message's channel (None: in a header)
        self._to = ""  # the open message's recipient function
        self._body = ""  # the open call's arguments so far
        self._call_id = ""
        self._plain = False  # the reply is not in harmony form: all of it is answer text

    def feed(self, text: str) -> Read:
        self._buf += text
        out = Read()
        while self._buf:
            if self._plain:
                out.content += self._buf
                self._buf = ""
            elif self._channel is None:
                if not self._header(out):
                    break
            elif not self._body_piece(out):
                break
        return out

    def finish(self) -> Read:
        """The rest, once the reply ended (its last message needs no ``<|end|>``)."""
        out = Read()
        if self._channel is None:
            out.content += self._buf  # a header never finished: shown as it was written
        else:
            self._emit(self._buf, out)
            self._close(out)
        self._buf = ""
        return out

    def _header(self, out: Read) -> bool:
        at = self._buf.find(MESSAGE)
        if at < 0:
            head = self._buf.lstrip()
            if head and not any(m.startswith(head[: len(m)]) for m in (CHANNEL, START, "to=")):
                self._plain = True  # not harmony (a model that ignores its format)
                return True
            return False
        header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE):]
        channel = _CHANNEL.search(header)
        to = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._to = to.group(1) if to else ""
        if self._is_call():
            self._body, self._call_id = "", new_call_id()
            if self.stream_calls:
                out.parts.append(CallPart(len(self.calls), "", self._call_id, self._to))
        return True

    def _is_call(self) -> bool:
        return self._channel == "commentary" and bool(self._to)

    def _body_piece(self, out: Read) -> bool:
        ends = [(self._buf.find(m), m) for m in _ENDS if m in self._buf]
        if ends:
            at, marker = min(ends)
            self._emit(self._buf[:at], out)
            self._buf = self._buf[at + len(marker):]
            self._close(out)
            return True
        keep = _partial_marker(self._buf)
        self._emit(self._buf[: len(self._buf) - keep], out)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _emit(self, text: str, out: Read) -> None:
        if not text:
            return
        if self._is_call():
            self._body += text
            if self.stream_calls:
                out.parts.append(CallPart(len(self.calls), text))
        elif self._channel == "analysis" and self.reasoning:
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: Read) -> None:
        """The open message ended: a call is checked, and the next header is read."""
        if self._is_call():
            call = self._call()
            if call is not None:
                self.calls.append(call)
            elif not self.stream_calls:  # not a call to a given tool: its text, shown as written
                out.content += self._body
        self._channel, self._to, self._body = None, "", ""

    def _call(self) -> ToolCall | None:
        try:
            arguments = json.loads(self._body)
        except ValueError:
            return None
        if self._to not in self.names or not isinstance(arguments, dict):
            return None
        return ToolCall(self._call_id, self._to, json.dumps(arguments, ensure_ascii=False))
