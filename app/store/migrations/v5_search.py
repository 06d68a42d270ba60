"""Schema 5: full-text search over every message (SQLite FTS5).

An external-content FTS5 index over ``messages.content``, kept in step by triggers. Python's
sqlite3 usually ships FTS5; where it does not, nothing is created and :meth:`Store.search`
falls back to ``LIKE`` (slower, no ranking, same results for plain words).
"""

from __future__ import annotations

import sqlite3


def fts5_available(conn: sqlite3.Connection) -> bool:
    try:
        conn.execute("CREATE VIRTUAL TABLE temp.fts5_probe USING fts5(x)")
        conn.execute("DROP TABLE temp.fts5_probe")
    except sqlite3.OperationalError:
        return False
    return True


def upgrade(conn: sqlite3.Connection) -> None:
    if not fts5_available(conn):
        return
    conn.execute(
        "CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='id', "
        "tokenize='unicode61 remove_diacritics 2')"
    )
    conn.execute(
        """CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts (rowid, content) VALUES (new.id, new.content);
        END"""
    )
    conn.execute(
        """CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        END"""
    )
    conn.execute(
        """CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
            INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
            INSERT INTO messages_fts (rowid, content) VALUES (new.id, new.content);
        END"""
    )
    conn.execute("INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')")
