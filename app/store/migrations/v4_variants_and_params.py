"""Schema 4: a conversation is a tree of messages, and carries its own parameters.

- ``parent_id``: the message a message answers or follows (NULL: the conversation's first).
  A regenerated reply and an edited prompt are new siblings: every earlier answer is kept.
- ``chosen_at``: among siblings, the one chosen last is on the conversation's active path
  (what is shown and sent); stepping between answers or opening a search hit re-chooses.
- ``context_from``: on a reply, the first message the model was sent with it when the
  context was full and the oldest turns were left out (NULL: the whole conversation).
- ``conversations.params``: the conversation's sampling and strategy, JSON (NULL: defaults).

Existing conversations become chains: each message's parent is the one before it.
"""

from __future__ import annotations

import sqlite3


def upgrade(conn: sqlite3.Connection) -> None:
    conn.execute("ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE")
    conn.execute("ALTER TABLE messages ADD COLUMN chosen_at REAL")
    conn.execute("ALTER TABLE messages ADD COLUMN context_from INTEGER")
    conn.execute("ALTER TABLE conversations ADD COLUMN params TEXT")
    conn.execute(
        """UPDATE messages SET chosen_at = created_at, parent_id = (
            SELECT MAX(p.id) FROM messages p
            WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id
        )"""
    )
    conn.execute("CREATE INDEX messages_by_parent ON messages (parent_id)")
