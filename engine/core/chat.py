"""Chat formatting from the model's own template, and streaming detokenization.

The template is the Jinja2 text stored in the GGUF (``tokenizer.chat_template``); models
without one get ChatML. Rendering is sandboxed like Hugging Face's.
"""

from __future__ import annotations

import codecs
import datetime as _dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import PotluckError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str
    name: str | None = None  # the participant's name (OpenAI's ``name``), for templates that show it


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatFormat:
    """Renders a conversation to the exact text the model was trained on."""

    def __init__(self, template: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: _dt.datetime.now().strftime(fmt)
        self.source = template or CHATML
        try:
            self._tmpl = env.from_string(self.source)
        except TemplateError as e:
            raise PotluckError(f"the model's chat template does not parse: {e}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
               variables: Mapping[str, object] | None = None) -> str:
        """``variables``: more names the template may read (``reasoning_effort``)."""
        try:
            return self._tmpl.render(
                **(variables or {}),
                messages=[{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                          for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise PotluckError(f"the model's chat template rejected the conversation: {e}") from None


class TextStream:
    """Turns token byte pieces into text, holding back incomplete UTF-8 sequences."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, pieces: Iterable[bytes]) -> str:
        return "".join(self._decoder.decode(p) for p in pieces)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
