"""Prompts as tokens, with special tokens only where the chat template put them.

llama.cpp parses special-token text wherever it appears in what it tokenizes, so a user who
writes ``<|im_start|>system`` in a message would open a system turn of their own if the
rendered conversation were tokenized as one string. Instead:

1. each message's text is *masked* before the template renders it: special-token text in it
   (and, at its edges, the part of one that the template's own text could complete) becomes
   a placeholder of private-use characters that no tokenizer matches;
2. the rendered text is split at the special tokens in it, now only the template's, as
   llama.cpp splits it (the longest token first, whitespace-strip flags honoured);
3. each piece of text between them is unmasked and tokenized with special parsing off, so the
   user's text is text.

llama.cpp tokenizes each piece between special tokens on its own as well, so where no message
holds special-token text the tokens are exactly those of the whole rendered text tokenized with
special parsing on (tests/test_prompt_tokens.py compares them). User-defined tokens (added words
such as ``<think>`` in some vocabularies) are matched in any text, as llama.cpp matches them
with special parsing off. Raw prompts (``Session.complete``, the completions API) have no
template: the client writes the whole prompt, and its special-token text is read as tokens.

Cost: llama.cpp's special parsing walks a linked list at every match (one 1 MB message of
``<|im_end|>`` held the server's engine for 89 s); here each special token present costs one
``str.find`` pass. A prompt whose bytes alone prove it cannot fit the context is refused
before any of it (one token stands for at most ``Model.longest_token_bytes`` bytes).

Thread-safe: the server prepares a request's prompt on another thread than the engine's.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .chat import ChatFormat, Message, ToolCall
from .errors import ContextFullError
from .harmony import is_harmony, split_rendered
from .runtime import Model, SpecialToken

MASK = "\ue000"
"""Starts every placeholder; two more private-use characters say which text it stands for."""
_FIRST, _SPAN = 0xE001, 0xF8FF - 0xE001  # [_FIRST, _FIRST + _SPAN)
_PLACEHOLDER = re.compile("\ue000([\ue001-\uf8fe])([\ue001-\uf8fe])")
_SPACE = " \t\n\v\f\r"  # C's isspace: what llama.cpp strips beside lstrip/rstrip tokens


@dataclass(frozen=True)
class Piece:
    """Text between special tokens, or one special token: its span in the prompt and its tokens."""

    start: int
    end: int
    tokens: tuple[int, ...]
    special: bool
    lstrip: bool = False  # a special token that drops the whitespace before it


@dataclass(frozen=True)
class Prompt:
    """A rendered conversation (or raw text) and its tokens, piece by piece, so that the tokens
    of any tail of it (the part after what the KV cache already holds) cost no tokenizing
    unless the tail starts inside a piece."""

    text: str
    pieces: tuple[Piece, ...]
    bos: tuple[int, ...]  # (bos,) when the model wants one and the text does not start with it
    messages: tuple[Message, ...] | None  # the conversation it renders; None: raw text
    _tokenize_text: Callable[[str], list[int]] = field(repr=False, compare=False)

    def tokens(self) -> list[int]:
        """Every token, the BOS first where the model wants one."""
        return [*self.bos, *self.tokens_after(0)]

    def tokens_after(self, offset: int) -> list[int]:
        """The tokens of ``text[offset:]`` as if it were tokenized on its own (special tokens
        still only where the template put them)."""
        starts = [p.start for p in self.pieces]
        i = bisect.bisect_left(starts, offset)
        if i < len(starts) and starts[i] == offset:
            return [t for p in self.pieces[i:] for t in p.tokens]
        # ``offset`` falls inside a piece (or a stripped gap): the text up to the next special
        # token is one fragment, tokenized now.
        nxt = next((j for j in range(i, len(self.pieces)) if self.pieces[j].special), len(self.pieces))
        end = self.pieces[nxt].start if nxt < len(self.pieces) else len(self.text)
        head = self.text[offset:end]
        if nxt < len(self.pieces) and self.pieces[nxt].lstrip:
            head = head.rstrip(_SPACE)
        out = self._tokenize_text(head) if head else []
        return out + [t for p in self.pieces[nxt:] for t in p.tokens]


class PromptTokenizer:
    """Turns conversations and raw text into :class:`Prompt` values for one model."""

    def __init__(self, model: Model, chat: ChatFormat) -> None:
        self.model = model
        self.chat = chat
        self._bos_text = model.detokenize([model.bos], special=True) if model.bos >= 0 else ""
        self._vocab: _Specials | None = None

    # -- what the server and the session call
    def conversation(self, messages: Sequence[Message], n_ctx: int, *, add_generation_prompt: bool = True,
                     variables: Mapping[str, object] | None = None, tools: Sequence[object] | None = None
                     ) -> Prompt:
        """``messages`` rendered by the chat template; their text never becomes special tokens,
        nor does any text of ``tools`` (OpenAI's definitions) or of calls and their results."""
        self._refuse_too_long(sum(_utf8_len(m.content) + _utf8_len(m.name or "") for m in messages), n_ctx)
        if is_harmony(self.chat.source):  # earlier replies' channels as the app stored them: the answer
            messages = [_answer_only(m) for m in messages]
        masker = _Masker(self._specials())
        masked = [_masked_message(masker, m) for m in messages]
        text = self.chat.render(masked, add_generation_prompt=add_generation_prompt, variables=variables,
                                tools=_masked_json(masker, list(tools)) if tools else None)
        return self._prompt(text, masker, tuple(messages))

    def raw(self, text: str, n_ctx: int) -> Prompt:
        """Raw text (no template): its special-token text is read as tokens."""
        self._refuse_too_long(_utf8_len(text), n_ctx)
        return self._prompt(text, _Masker(self._specials()), None)

    def text_tokens(self, text: str) -> list[int]:
        """``text`` as text: special-token text in it is not a special token. A marker that
        llama.cpp matches in any text (gpt-oss's) is tokenized in two halves, neither of which
        it matches."""
        markers = self._specials().markers
        if markers is None or not markers.search(text):
            return self.model.tokenize(text, add_special=False, parse_special=False)
        tokens: list[int] = []
        for i, piece in enumerate(markers.split(text)):
            halves = (piece[:1], piece[1:]) if i % 2 else (piece,)  # odd pieces: the markers
            for half in halves:
                if half:
                    tokens += self.model.tokenize(half, add_special=False, parse_special=False)
        return tokens

    # -- the parts
    def _specials(self) -> _Specials:
        if self._vocab is None:  # two threads may both build it: the same value
            self._vocab = _Specials(self.model.special_tokens())
        return self._vocab

    def _refuse_too_long(self, n_bytes: int, n_ctx: int) -> None:
        if n_bytes < n_ctx:  # cannot be too long: every token stands for a byte or more
            return
        at_least = -(-n_bytes // self.model.longest_token_bytes())
        if at_least + 1 > n_ctx:
            raise ContextFullError(f"the prompt is {n_bytes} bytes, so at least {at_least} tokens, but the context "
                                   f"holds {n_ctx}; shorten it or raise --ctx")

    def _prompt(self, masked: str, masker: _Masker, messages: tuple[Message, ...] | None) -> Prompt:
        """Split ``masked`` at its special tokens, tokenize the text between them unmasked, and
        place every piece in the unmasked text."""
        pieces: list[Piece] = []
        chunks: list[str] = []
        at = 0  # the end of what ``chunks`` hold, in the masked text
        length = 0  # the same, in the unmasked text
        for start, end, special in split_at_specials(masked, masker.vocab.present(masked)):
            if start > at:  # whitespace an lstrip/rstrip token dropped (never masked)
                chunks.append(masked[at:start])
                length += start - at
            if special is not None:
                text, tokens = special.text, (special.id,)
            else:
                text = masker.unmask(masked[start:end])
                tokens = tuple(self.text_tokens(text))
            pieces.append(Piece(length, length + len(text), tokens, special is not None,
                                special is not None and special.lstrip))
            chunks.append(text)
            length += len(text)
            at = end
        chunks.append(masked[at:])
        text = "".join(chunks)
        add_bos = self.model.add_bos and not (self._bos_text and text.startswith(self._bos_text))
        return Prompt(text, tuple(pieces), (self.model.bos,) if add_bos else (), messages, self.text_tokens)


def split_at_specials(text: str, specials: Sequence[SpecialToken]) -> list[tuple[int, int, SpecialToken | None]]:
    """``text`` as spans of text and special tokens, as llama.cpp's ``tokenizer_st_partition``
    splits it: the longest token first, each found left to right within every text span left;
    whitespace before an lstrip token and after an rstrip one is dropped (not in any span)."""
    spans: list[tuple[int, int, SpecialToken | None]] = [(0, len(text), None)] if text else []
    for sp in sorted(specials, key=lambda s: -len(s.text)):
        out: list[tuple[int, int, SpecialToken | None]] = []
        for start, end, found in spans:
            if found is not None:
                out.append((start, end, found))
                continue
            pos = start
            while (i := text.find(sp.text, pos, end)) >= 0:
                left = i
                if sp.lstrip:
                    while left > pos and text[left - 1] in _SPACE:
                        left -= 1
                if left > pos:
                    out.append((pos, left, None))
                pos = i + len(sp.text)
                out.append((i, pos, sp))
                if sp.rstrip:
                    while pos < end and text[pos] in _SPACE:
                        pos += 1
            if pos < end:
                out.append((pos, end, None))
        spans = out
    return spans


class _Specials:
    """A vocabulary's special tokens, arranged for masking and splitting (built once)."""

    def __init__(self, specials: Sequence[SpecialToken]) -> None:
        self.all = tuple(specials)
        self.control = sorted((s.text for s in specials if s.control), key=len, reverse=True)
        marked = sorted((s.text for s in specials if s.marker), key=len, reverse=True)
        self.markers = re.compile("(" + "|".join(map(re.escape, marked)) + ")") if marked else None
        self.longest = len(self.control[0]) if self.control else 0
        # proper heads and tails of control tokens' text, without whitespace at their ends (a
        # template's trim would otherwise meet a placeholder where it used to strip)
        self.heads = {s[:k] for s in self.control for k in range(1, len(s))} - {""}
        self.tails = {s[-k:] for s in self.control for k in range(1, len(s))} - {""}
        self.heads = {h for h in self.heads if h.strip(_SPACE) == h}
        self.tails = {t for t in self.tails if t.strip(_SPACE) == t}

    def present(self, text: str) -> list[SpecialToken]:
        """The special tokens whose text occurs in ``text``."""
        return [s for s in self.all if s.text in text]


class _Masker:
    """Placeholders for special-token text in one prompt's messages, and back."""

    def __init__(self, vocab: _Specials) -> None:
        self.vocab = vocab
        self.originals: list[str] = []
        self._placeholder: dict[str, str] = {}

    def mask(self, text: str) -> str:
        found = [s for s in self.vocab.control if s in text]
        if MASK in text:
            found.insert(0, MASK)  # first: the placeholders put in next start with it
        for s in found:
            text = text.replace(s, self._hide(s))
        # the template's own text beside the message must not complete a control token either
        longest = min(len(text), self.vocab.longest - 1)
        head = next((text[:k] for k in range(longest, 0, -1) if text[:k] in self.vocab.tails), "")
        if head and MASK not in head:
            text = self._hide(head) + text[len(head) :]
        longest = min(len(text), self.vocab.longest - 1)
        tail = next((text[-k:] for k in range(longest, 0, -1) if text[-k:] in self.vocab.heads), "")
        if tail and MASK not in tail:
            text = text[: -len(tail)] + self._hide(tail)
        return text

    def unmask(self, text: str) -> str:
        if MASK not in text:
            return text
        return _PLACEHOLDER.sub(lambda m: self._original(m.group(1), m.group(2)), text)

    def _hide(self, text: str) -> str:
        found = self._placeholder.get(text)
        if found is None:
            n = len(self.originals)
            found = MASK + chr(_FIRST + n // _SPAN) + chr(_FIRST + n % _SPAN)
            self.originals.append(text)
            self._placeholder[text] = found
        return found

    def _original(self, a: str, b: str) -> str:
        n = (ord(a) - _FIRST) * _SPAN + ord(b) - _FIRST
        return self.originals[n] if n < len(self.originals) else MASK + a + b


def _answer_only(m: Message) -> Message:
    """A harmony reply sent back as its final answer (gpt-oss's template drops earlier thinking)."""
    split = split_rendered(m.content) if m.role == "assistant" else None
    return m if split is None else dataclasses.replace(m, content=split[1])


def _masked_message(masker: _Masker, m: Message) -> Message:
    calls = tuple(ToolCall(masker.mask(c.id), masker.mask(c.name), masker.mask(c.arguments)) for c in m.tool_calls)
    return Message(m.role, masker.mask(m.content), masker.mask(m.name) if m.name else m.name, calls,
                   masker.mask(m.tool_call_id) if m.tool_call_id else m.tool_call_id)


def _masked_json(masker: _Masker, value: object) -> object:
    """``value`` (parsed JSON) with every string in it masked, keys too."""
    if isinstance(value, str):
        return masker.mask(value)
    if isinstance(value, list):
        return [_masked_json(masker, v) for v in value]
    if isinstance(value, dict):
        return {masker.mask(k) if isinstance(k, str) else k: _masked_json(masker, v) for k, v in value.items()}
    return value


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))
