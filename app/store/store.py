"""The history store (after oterm's): one SQLite file, schema version in ``user_version``.

A conversation is a tree: a regenerated reply or an edited prompt is a sibling of the message
it redoes, and the siblings chosen last make the active path (:meth:`Store.messages`), so
every earlier answer is kept and can be stepped back to (:meth:`Store.select`).

Every message is written in its own transaction the moment it is complete. The reply being
generated is saved as it streams (:meth:`Store.begin_reply`, :meth:`Store.save_partial`;
the app saves at least every second) and the finished reply replaces it atomically, so a
killed app loses at most the last second of a reply; opening the store again marks what a
crash left half-written as interrupted. WAL journal: a kill never corrupts the file. All
calls come from the UI thread.
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ...engine import PotluckError
from .migrations import MIGRATIONS, SCHEMA_VERSION

log = logging.getLogger(__name__)

PARTIAL = "partial"  # finish_reason of the reply being generated
INTERRUPTED = "interrupted"  # a partial reply found when the store opens: the app died mid-reply


_LAST = -1  # add_message's default parent: the end of the active path


@dataclass(frozen=True)
class ConversationParams:
    """One conversation's own decoding parameters; None takes config.toml's value."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    strategy: str | None = None

    def to_json(self) -> str | None:
        values = {k: v for k, v in asdict(self).items() if v is not None}
        return json.dumps(values, sort_keys=True) if values else None

    @classmethod
    def from_json(cls, text: str | None) -> ConversationParams:
        """Unknown or mistyped keys (a newer potluck's, a hand edit) are dropped, never fatal."""
        try:
            raw = json.loads(text) if text else {}
        except ValueError:
            raw = {}
        kinds = {f.name: f.type for f in fields(cls)}
        out: dict[str, object] = {}
        for key, value in (raw.items() if isinstance(raw, dict) else ()):
            kind = kinds.get(key, "")
            if isinstance(value, bool) or value is None:
                continue
            if ("float" in kind and isinstance(value, (int, float))) or ("int" in kind and isinstance(value, int)):
                out[key] = float(value) if "float" in kind else value
            elif "str" in kind and isinstance(value, str):
                out[key] = value
        return cls(**out)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system: str | None
    created_at: float
    updated_at: float
    params: ConversationParams = ConversationParams()


@dataclass(frozen=True)
class SearchHit:
    conversation_id: int
    message_id: int
    title: str
    role: str
    snippet: str  # the matching text around the match, on one line


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
    parent_id: int | None = None
    context_from: int | None = None  # a reply sent without the oldest turns: the first one sent
    variant: int = 1  # this message's place among its siblings (answers to the same message)
    variants: int = 1

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
    "finish_reason, strategy, n_tokens, tokens_per_s, acceptance_rate, parent_id, context_from"
)
_CONVERSATION_COLUMNS = "id, title, system, created_at, updated_at, params"


def _conversation(row: tuple) -> Conversation:
    return Conversation(*row[:5], params=ConversationParams.from_json(row[5]))


def _fts_query(text: str) -> str:
    """The user's words as an FTS5 query: each a quoted prefix term, all required."""
    words = re.findall(r"\w+", text)
    return " ".join(f'"{w}"*' for w in words)


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
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations ORDER BY updated_at DESC, id DESC"
        ).fetchall()
        return [_conversation(r) for r in rows]

    def conversation(self, conversation_id: int) -> Conversation | None:
        row = self._conn.execute(
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        return _conversation(row) if row else None

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

    def set_params(self, conversation_id: int, params: ConversationParams) -> None:
        with self._tx() as c:
            c.execute("UPDATE conversations SET params = ? WHERE id = ?", (params.to_json(), conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- messages
    def _rows(self, conversation_id: int) -> list[tuple]:
        return self._conn.execute(
            f"SELECT {_MESSAGE_COLUMNS}, chosen_at FROM messages WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        ).fetchall()

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        """The active path: from the first message, each time the child chosen last."""
        children: dict[int | None, list[tuple]] = {}
        for row in self._rows(conversation_id):
            children.setdefault(row[10], []).append(row)
        path: list[StoredMessage] = []
        parent: int | None = None
        while children.get(parent):
            siblings = children[parent]
            row = max(siblings, key=lambda r: (r[12] or 0.0, r[0]))
            path.append(StoredMessage(*row[:12], variant=siblings.index(row) + 1, variants=len(siblings)))
            parent = row[0]
        return path

    def variants(self, message_id: int) -> list[int]:
        """The ids of a message and its siblings (other answers to the same message), oldest first."""
        row = self._conn.execute(
            "SELECT conversation_id, parent_id FROM messages WHERE id = ?", (message_id,)
        ).fetchone()
        if row is None:
            return []
        conversation_id, parent = row
        return [
            r[0] for r in self._conn.execute(
                "SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id",
                (conversation_id, parent),
            )
        ]

    def select(self, message_id: int) -> None:
        """Put a message (and the messages it follows) on its conversation's active path; below
        it the path takes whatever was chosen last there."""
        now = self._clock()
        with self._tx() as c:
            c.execute(
                """WITH RECURSIVE up(id, parent_id) AS (
                    SELECT id, parent_id FROM messages WHERE id = ?
                    UNION ALL SELECT m.id, m.parent_id FROM messages m JOIN up ON m.id = up.parent_id
                ) UPDATE messages SET chosen_at = ? WHERE id IN (SELECT id FROM up)""",
                (message_id, now),
            )

    def _parent(self, conversation_id: int, parent: int | None) -> int | None:
        if parent != _LAST:
            return parent
        path = [m for m in self.messages(conversation_id) if m.finish_reason != PARTIAL]
        return path[-1].id if path else None

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
        parent: int | None = _LAST,
        variant_of: int | None = None,
        context_from: int | None = None,
    ) -> StoredMessage:
        """Write one complete message at the end of the active path, or after ``parent``, or
        beside ``variant_of`` (a regenerated reply, an edited prompt: the old one is kept). It
        becomes the chosen one. A complete reply also takes the place of the conversation's
        partial one (:meth:`begin_reply`)."""
        if variant_of is not None:
            row = self._conn.execute("SELECT parent_id FROM messages WHERE id = ?", (variant_of,)).fetchone()
            parent = row[0] if row else _LAST
        parent = self._parent(conversation_id, parent)
        now = self._clock()
        values = (finish_reason, strategy, n_tokens, tokens_per_s, acceptance_rate)
        with self._tx() as c:
            if role == "assistant":
                c.execute(
                    "DELETE FROM messages WHERE conversation_id = ? AND finish_reason = ?",
                    (conversation_id, PARTIAL),
                )
            cur = c.execute(
                "INSERT INTO messages (conversation_id, role, content, created_at, finish_reason, "
                "strategy, n_tokens, tokens_per_s, acceptance_rate, parent_id, context_from, chosen_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, now, *values, parent, context_from, now),
            )
            c.execute(
                "UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id)
            )
        message_id = int(cur.lastrowid or 0)
        n = len(self.variants(message_id))
        return StoredMessage(
            message_id, conversation_id, role, content, now, *values, parent, context_from, variant=n, variants=n
        )

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Messages of every conversation that contain all the words of ``text``, best first
        (FTS5), or most recent first where SQLite lacks FTS5 (``LIKE``)."""
        words = re.findall(r"\w+", text)
        if not words:
            return []
        if self._has_fts():
            rows = self._conn.execute(
                "SELECT m.conversation_id, m.id, c.title, m.role, "
                "snippet(messages_fts, 0, '', '', '…', 12) "
                "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
                "JOIN conversations c ON c.id = m.conversation_id "
                "WHERE messages_fts MATCH ? AND m.finish_reason IS NOT 'partial' ORDER BY rank LIMIT ?",
                (_fts_query(text), limit),
            ).fetchall()
        else:
            where = " AND ".join("m.content LIKE ? ESCAPE '\\'" for _ in words)
            likes = ["%" + w.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%" for w in words]
            rows = self._conn.execute(
                "SELECT m.conversation_id, m.id, c.title, m.role, m.content FROM messages m "
                f"JOIN conversations c ON c.id = m.conversation_id WHERE {where} "
                "AND m.finish_reason IS NOT 'partial' ORDER BY m.id DESC LIMIT ?",
                (*likes, limit),
            ).fetchall()
            rows = [(*r[:4], _around(r[4], words[0])) for r in rows]
        return [SearchHit(cid, mid, title, role, " ".join(snip.split())) for cid, mid, title, role, snip in rows]

    def _has_fts(self) -> bool:
        return self._conn.execute(
            "SELECT 1 FROM sqlite_master WHERE name = 'messages_fts'"
        ).fetchone() is not None

    def recent_prompts(self, limit: int = 100) -> list[str]:
        """What the user sent lately, in every conversation, newest first, without repeats."""
        rows = self._conn.execute(
            "SELECT content FROM messages WHERE role = 'user' ORDER BY id DESC LIMIT ?", (limit * 2,)
        ).fetchall()
        return list(dict.fromkeys(r[0] for r in rows))[:limit]

    def delete_message(self, message_id: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    # -- the reply being generated
    def begin_reply(
        self, conversation_id: int, content: str, *, parent: int | None = _LAST, variant_of: int | None = None
    ) -> int:
        """Save the start of a reply that is still streaming; returns its message id."""
        if variant_of is not None:
            row = self._conn.execute("SELECT parent_id FROM messages WHERE id = ?", (variant_of,)).fetchone()
            parent = row[0] if row else _LAST
        parent = self._parent(conversation_id, parent)
        now = self._clock()
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO messages (conversation_id, role, content, created_at, finish_reason, saved_at, "
                "parent_id, chosen_at) VALUES (?, 'assistant', ?, ?, ?, ?, ?, ?)",
                (conversation_id, content, now, PARTIAL, now, parent, now),
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

        One with no text is dropped (the answer chosen before it is shown again); one with
        text stays beside the earlier answers, chosen."""
        with self._tx() as c:
            rows = c.execute(
                "SELECT id, content FROM messages WHERE finish_reason = ?", (PARTIAL,)
            ).fetchall()
            for message_id, content in rows:
                if not content:
                    c.execute("DELETE FROM messages WHERE id = ?", (message_id,))
                    continue
                c.execute("UPDATE messages SET finish_reason = ? WHERE id = ?", (INTERRUPTED, message_id))
        marked = sum(1 for _, content in rows if content)
        if marked:
            log.warning("history: %d reply(ies) interrupted by a crash kept up to their last save", marked)
        return marked


def _around(content: str, word: str, width: int = 60) -> str:
    """A LIKE hit's text around its first word (FTS5's snippet() where it is missing)."""
    at = content.lower().find(word.lower())
    start = max(0, at - width // 2)
    return ("…" if start else "") + content[start : start + width] + ("…" if start + width < len(content) else "")
