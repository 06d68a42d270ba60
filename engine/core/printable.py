"""Text from other parties made safe to show: control characters escaped, never interpreted.

A zeroconf record, a worker's refusal, an HTTP path or a client's name is written by someone
else. Printed raw, its ``ESC ]52;`` writes the user's clipboard and ``ESC [2J`` clears the
screen. Everything a remote party says goes through :func:`printable` before it reaches a
terminal, the chat app, a log or ``/health``; :class:`PrintableFormatter` does it for logs.
"""

from __future__ import annotations

import logging
import re

# C0 controls but tab and newline, DEL, C1 controls, and the Unicode line/paragraph separators
# and bidirectional overrides that reorder what a terminal shows.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_UNSAFE_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, *, one_line: bool = True, limit: int | None = None) -> str:
    """``text`` with every control character shown as an escape (``ESC`` -> ``\\x1b``).

    ``one_line`` escapes newlines and tabs too (a record or an error that should stay on its
    line); ``limit`` cuts the result to that many characters, marked with an ellipsis.
    """
    s = text if isinstance(text, str) else str(text)
    s = (_UNSAFE_ONE_LINE if one_line else _UNSAFE).sub(_escape, s)
    if limit is not None and len(s) > limit:
        s = s[: max(0, limit - 1)] + "…"
    return s


class PrintableFormatter(logging.Formatter):
    """A log formatter whose output is printable: messages and their arguments come from peers.

    A message stays on one line (a newline in it cannot forge a record); tracebacks keep theirs.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:  # noqa: ANN001, N802 - logging's signature
        return printable(super().formatException(ei), one_line=False)

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's name
        return printable(super().formatStack(stack_info), one_line=False)
