"""The history store (after oterm's): one SQLite file, schema version in ``user_version``.

Every message is written in its own transaction the moment it is complete. The reply being
generated is saved as it streams (:meth:`Store.begin_reply`, :meth:`Store.save_partial`;
the app saves at least every second) and the finished reply replaces it atomically, so a
killed app loses at most the last second of a reply; opening the store again marks what a
crash left half-written as interrupted. WAL journal: a kill never corrupts the file. All
calls come from the UI thread.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ...engine import PotluckError
from .migrations import MIGRATIONS, SCHEMA_VERSION

log = logging.getLogger(__name__)

PARTIAL = "partial"  # finish_reason of the reply being generated
INTERRUPTED = "interrupted"  # a partial reply found when the store opens: the app died mid-reply


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system: str | None
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class StoredMessage:
    id: int
    conversation_id: int
    role: str  # "user" | "assistant"
    content: str
    created_at: float
    finish_reason: str | None = None
    strategy: str | None = None
    n_tokens: int | None = None
    tokens_per_s: float | None = None
    acceptance_rate: float | None = None

    @property
    def stopped(self) -> bool:
        """The user cut this reply short (Esc): shown marked, kept in the conversation."""
        return self.finish_reason == "cancelled"

    @property
    def interrupted(self) -> bool:
        """The app was killed while this reply streamed: its text up to the last save."""
        return self.finish_reason == INTERRUPTED


_MESSAGE_COLUMNS = (
    "id, conversation_id, role, content, created_at, "
    "finish_reason, strategy, n_tokens, tokens_per_s, acceptance_rate"
)


def schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: sqlite3.Connection) -> int:
    """Apply the missing migrations in order, each in its own transaction; return the version."""
    version = schema_version(conn)
    if version > SCHEMA_VERSION:
        raise PotluckError(
            f"the history database has schema {version}, newer than this potluck knows "
            f"({SCHEMA_VERSION}); upgrade potluck"
        )
    for target, upgrade in MIGRATIONS:
        if target <= version:
            continue
        log.info("history: migrating schema %d -> %d", version, target)
        conn.execute("BEGIN")
        try:
            upgrade(conn)
            conn.execute(f"PRAGMA user_version = {int(target)}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        version = target
    return version


class Store:
    """Conversations and messages; open with :meth:`open`, close when done."""

    def __init__(self, conn: sqlite3.Connection, *, clock: Callable[[], float] = time.time) -> None:
        self._conn = conn
        self._clock = clock

    @classmethod
    def open(cls, path: Path | str, *, clock: Callable[[], float] = time.time) -> Store:
        try:
            conn = sqlite3.connect(str(path), isolation_level=None)  # explicit transactions
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA journal_mode = WAL")
            migrate(conn)
            store = cls(conn, clock=clock)
            store.mark_interrupted()
        except sqlite3.DatabaseError as e:
            raise PotluckError(f"cannot open the history database {path}: {e}") from None
        return store

    def close(self) -> None:
        self._conn.close()

    @property
    def version(self) -> int:
        return schema_version(self._conn)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN")
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise

    # -- conversations
    def conversations(self) -> list[Conversation]:
        """Most recently used first."""
        rows = self._conn.execute(
            "SELECT id, title, system, created_at, updated_at FROM conversations "
            "ORDER BY updated_at DESC, id DESC"
        ).fetchall()
        return [Conversation(*r) for r in rows]

    def conversation(self, conversation_id: int) -> Conversation | None:
        row = self._conn.execute(
            "SELECT id, title, system, created_at, updated_at FROM conversations WHERE id = ?",
            (conversation_id,),
        ).fetchone()
        return Conversation(*row) if row else None

    def new_conversation(self, title: str = "New chat", system: str | None = None) -> Conversation:
        now = self._clock()
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO conversations (title, system, created_at, updated_at) "
                "VALUES (?, ?, ?, ?)",
                (title, system, now, now),
            )
        return Conversation(int(cur.lastrowid or 0), title, system, now, now)

    def rename(self, conversation_id: int, title: str) -> None:
        with self._tx() as c:
            c.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def set_system(self, conversation_id: int, system: str | None) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE conversations SET system = ? WHERE id = ?",
                (system or None, conversation_id),
            )

    def delete(self, conversation_id: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- messages
    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self._conn.execute(
            f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        ).fetchall()
        return [StoredMessage(*r) for r in rows]

    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        *,
        finish_reason: str | None = None,
        strategy: str | None = None,
        n_tokens: int | None = None,
        tokens_per_s: float | None = None,
        acceptance_rate: float | None = None,
        replaces: int | None = None,
    ) -> StoredMessage:
        """Write one complete message; ``replaces`` deletes a regenerated reply in the same
        transaction, so the old reply survives until the new one is whole. A complete reply
        also takes the place of the conversation's partial one (:meth:`begin_reply`)."""
        now = self._clock()
        values = (finish_reason, strategy, n_tokens, tokens_per_s, acceptance_rate)
        with self._tx() as c:
            if replaces is not None:
                c.execute("DELETE FROM messages WHERE id = ?", (replaces,))
            if role == "assistant":
                c.execute(
                    "DELETE FROM messages WHERE conversation_id = ? AND finish_reason = ?",
                    (conversation_id, PARTIAL),
                )
            cur = c.execute(
                "INSERT INTO messages (conversation_id, role, content, created_at, finish_reason, "
                "strategy, n_tokens, tokens_per_s, acceptance_rate) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, now, *values),
            )
            c.execute(
                "UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id)
            )
        return StoredMessage(int(cur.lastrowid or 0), conversation_id, role, content, now, *values)

    def delete_message(self, message_id: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    # -- the reply being generated
    def begin_reply(self, conversation_id: int, content: str, *, replaces: int | None = None) -> int:
        """Save the start of a reply that is still streaming; returns its message id."""
        now = self._clock()
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO messages (conversation_id, role, content, created_at, finish_reason, saved_at, "
                "replaces) VALUES (?, 'assistant', ?, ?, ?, ?, ?)",
                (conversation_id, content, now, PARTIAL, now, replaces),
            )
        return int(cur.lastrowid or 0)

    def save_partial(self, message_id: int, content: str) -> None:
        """Rewrite a streaming reply's text so far (one small transaction)."""
        with self._tx() as c:
            c.execute(
                "UPDATE messages SET content = ?, saved_at = ? WHERE id = ? AND finish_reason = ?",
                (content, self._clock(), message_id, PARTIAL),
            )

    def mark_interrupted(self) -> int:
        """Mark replies a crash left partial as interrupted; returns how many.

        An interrupted regeneration replaces the reply it was regenerating if any of its text
        was saved; one with no text is dropped (the old reply, or nothing, stays)."""
        with self._tx() as c:
            rows = c.execute(
                "SELECT id, content, replaces FROM messages WHERE finish_reason = ?", (PARTIAL,)
            ).fetchall()
            for message_id, content, replaces in rows:
                if not content:
                    c.execute("DELETE FROM messages WHERE id = ?", (message_id,))
                    continue
                if replaces is not None:
                    c.execute("DELETE FROM messages WHERE id = ?", (replaces,))
                c.execute(
                    "UPDATE messages SET finish_reason = ?, replaces = NULL WHERE id = ?",
                    (INTERRUPTED, message_id),
                )
        marked = sum(1 for _, content, _ in rows if content)
        if marked:
            log.warning("history: %d reply(ies) interrupted by a crash kept up to their last save", marked)
        return marked
