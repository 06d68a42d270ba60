"""A conversation as a Markdown document (what "export" writes)."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from ..store import Conversation, StoredMessage

_ROLE_HEADING = {"user": "You", "assistant": "Assistant"}


def conversation_markdown(
    conv: Conversation, messages: list[StoredMessage], *, model: str, sampling: str, exported_at: datetime
) -> str:
    """The conversation as shown (its active path), with what produced it: the model and its
    decoding, when it was exported, and the system prompt (or that there was none)."""
    parts = [
        f"# {conv.title}\n",
        f"*Exported {exported_at:%Y-%m-%d %H:%M} · started {datetime.fromtimestamp(conv.created_at):%Y-%m-%d %H:%M}"
        f" · model {model} · {sampling}*\n",
    ]
    if conv.system:
        quoted = "\n".join(f"> {line}" if line else ">" for line in conv.system.splitlines())
        parts.append(f"**System prompt**\n\n{quoted}\n")
    else:
        parts.append("**System prompt:** none\n")
    for m in messages:
        body = m.content.rstrip()
        if m.stopped:
            body += "\n\n*(stopped)*"
        parts.append(f"## {_ROLE_HEADING.get(m.role, m.role)}\n\n{body}\n")
    return "\n".join(parts)


def export_path(folder: Path, conv: Conversation) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", conv.title.lower()).strip("-")[:40] or "conversation"
    return folder / f"{slug}-{conv.id}.md"


_FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)(?:^\1[ \t]*$|\Z)", re.MULTILINE | re.DOTALL)


def code_blocks(markdown: str) -> list[str]:
    """Contents of the fenced code blocks, in order (an unclosed last fence counts)."""
    return [m.group(2).rstrip("\n") for m in _FENCE.finditer(markdown)]
