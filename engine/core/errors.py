"""Errors the user can act on. Their message is one line: the problem and what to do."""

from __future__ import annotations


class PotluckError(Exception):
    """A problem with the user's input or environment, shown as one line (exit code 2)."""


class ModelError(PotluckError):
    """A model file that is missing, not GGUF, truncated or otherwise unusable."""


class ContextFullError(PotluckError):
    """The prompt (or conversation) does not fit in the context window."""


class DecodeError(PotluckError):
    """llama.cpp refused a batch (out of KV cells, bad positions, ...)."""


class GrammarError(PotluckError):
    """A grammar or JSON schema that cannot constrain a reply (it does not parse, or is too big)."""
