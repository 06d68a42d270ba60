"""Schema 3: the reply being generated is saved while it streams.

Such a row has ``finish_reason = 'partial'`` and is rewritten at least every second
(``saved_at``); the finished reply replaces it in one transaction. A row still partial when
the store opens was left by a crash: it becomes ``'interrupted'``. ``replaces`` holds the
reply a regeneration will replace, which survives until the new one is whole or interrupted.
"""

from __future__ import annotations

import sqlite3


def upgrade(conn: sqlite3.Connection) -> None:
    conn.execute("ALTER TABLE messages ADD COLUMN saved_at REAL")  # last write of a partial reply
    conn.execute("ALTER TABLE messages ADD COLUMN replaces INTEGER")  # a regenerated reply's predecessor
    # Opening the store looks for partial rows: keep that cheap on a long history.
    conn.execute("CREATE INDEX messages_partial ON messages (finish_reason) WHERE finish_reason = 'partial'")
