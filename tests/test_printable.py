"""Text from other parties is shown with its control characters escaped, in logs too."""

import logging

from potluck.engine import PrintableFormatter, printable


def test_terminal_escapes_are_shown_not_interpreted():
    hostile = "node\x1b]0;owned\x07\x1b]52;c;Y2xpcA==\x07\x1b[2J\x9b31m\u202etxt"
    shown = printable(hostile)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c == "\u202e" for c in shown)
    assert shown.startswith("node\\x1b]0;owned\\x07\\x1b]52;c;")
    assert printable("plain text, accents é and 漢字") == "plain text, accents é and 漢字"


def test_one_line_and_limit():
    assert printable("a\nb\tc") == "a\\x0ab\\x09c"
    assert printable("a\nb\tc", one_line=False) == "a\nb\tc"
    assert printable("x" * 50, limit=10) == "x" * 9 + "…"


def test_a_log_record_stays_one_printable_line():
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Keep()
    handler.setFormatter(PrintableFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("potluck.test_printable")
    log.addHandler(handler)
    try:
        log.warning("GET %s", "/\x1b[2J\nWARNING forged line")
    finally:
        log.removeHandler(handler)
    assert records == ["WARNING GET /\\x1b[2J\\x0aWARNING forged line"]
