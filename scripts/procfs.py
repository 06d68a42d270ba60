"""Process trees from Linux /proc, for the scripts that watch worker processes."""

from __future__ import annotations

from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (a worker and its llama.cpp child); [] once gone."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = [int(c) for task in Path(f"/proc/{p}/task").iterdir()
                        for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        out.append(p)
        todo += children
    return out
