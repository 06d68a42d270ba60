"""Copying text: OSC 52 through the terminal, plus a local fallback.

OSC 52 works over SSH but many terminals ignore it silently, and the app cannot tell.
So the text also goes to a system clipboard tool when one exists, and otherwise to a file
the notification names, so a copy is never lost.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

_TOOLS = (
    ("wl-copy",),
    ("xclip", "-selection", "clipboard"),
    ("xsel", "--clipboard", "--input"),
    ("pbcopy",),
    ("clip.exe",),
)


def system_clipboard(text: str, fallback_file: Path) -> str:
    """Copy with the first clipboard tool found, else write ``fallback_file``; say where."""
    for cmd in _TOOLS:
        exe = shutil.which(cmd[0])
        if exe is None:
            continue
        try:
            subprocess.run([exe, *cmd[1:]], input=text.encode(), timeout=2, check=True)
            return cmd[0]
        except (OSError, subprocess.SubprocessError):
            continue
    fallback_file.write_text(text, encoding="utf-8")
    return str(fallback_file)
