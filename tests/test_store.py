"""History store: versioned migrations (each tested from the old schema) and message writes."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from potluck.app.store import Store
from potluck.app.store.migrations import SCHEMA_VERSION, v1_initial
from potluck.engine.errors import PotluckError


def test_fresh_database_gets_the_latest_schema(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "h.sqlite3")
    assert store.version == SCHEMA_VERSION == 2
    store.close()


def test_schema_1_database_is_upgraded_keeping_its_messages(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    v1_initial.upgrade(conn)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO conversations VALUES (1, 'old chat', NULL, 1.0, 1.0)")
    conn.execute("INSERT INTO messages VALUES (1, 1, 'user', 'hello', 1.0)")
    conn.execute("INSERT INTO messages VALUES (2, 1, 'assistant', 'hi!', 2.0)")
    conn.commit()
    conn.close()

    store = Store.open(path)
    assert store.version == 2
    msgs = store.messages(1)
    assert [(m.role, m.content, m.finish_reason) for m in msgs] == [
        ("user", "hello", None),
        ("assistant", "hi!", None),
    ]
    new = store.add_message(1, "assistant", "again", finish_reason="cancelled", n_tokens=3)
    assert store.messages(1)[-1] == new and new.stopped
    store.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(PotluckError, match="newer than this potluck"):
        Store.open(path)


def test_not_a_database_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.sqlite3"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(PotluckError, match="cannot open the history database"):
        Store.open(path)


def test_conversations_messages_rename_delete(tmp_path: Path) -> None:
    ticks = iter(range(100))
    store = Store.open(tmp_path / "h.sqlite3", clock=lambda: float(next(ticks)))
    a = store.new_conversation("a", system="be brief")
    b = store.new_conversation("b")
    assert [c.id for c in store.conversations()] == [b.id, a.id]  # most recent first
    store.add_message(a.id, "user", "q")
    r1 = store.add_message(a.id, "assistant", "first", finish_reason="stop", tokens_per_s=9.5)
    assert [c.id for c in store.conversations()] == [a.id, b.id]
    r2 = store.add_message(a.id, "assistant", "second", replaces=r1.id)  # regenerate
    assert [m.content for m in store.messages(a.id)] == ["q", "second"]
    assert store.messages(a.id)[-1].id == r2.id
    store.rename(a.id, "renamed")
    store.set_system(a.id, "")
    conv = store.conversation(a.id)
    assert conv is not None and conv.title == "renamed" and conv.system is None
    store.delete(a.id)
    assert store.conversation(a.id) is None and store.messages(a.id) == []
    store.close()


def test_every_message_is_on_disk_when_written(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = Store.open(path)
    conv = store.new_conversation()
    store.add_message(conv.id, "user", "kept")
    other = Store.open(path)  # another connection sees it at once: nothing waits for close
    assert [m.content for m in other.messages(conv.id)] == ["kept"]
    other.close()
    store.close()
