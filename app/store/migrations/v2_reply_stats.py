"""Schema 2: how each reply ended and how fast it was (a stopped reply is shown as such)."""

from __future__ import annotations

import sqlite3


def upgrade(conn: sqlite3.Connection) -> None:
    for column in (
        "finish_reason TEXT",  # stop | length | cancelled | context_full; NULL for user messages
        "strategy TEXT",
        "n_tokens INTEGER",
        "tokens_per_s REAL",
        "acceptance_rate REAL",  # NULL when nothing was drafted
    ):
        conn.execute(f"ALTER TABLE messages ADD COLUMN {column}")
