"""History store: versioned migrations (each tested from the old schema) and message writes."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from potluck.app.store import ConversationParams, Store
from potluck.app.store.migrations import SCHEMA_VERSION, v1_initial, v2_reply_stats, v3_partial_replies, v5_search
from potluck.engine.core.errors import PotluckError


def test_fresh_database_gets_the_latest_schema(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "h.sqlite3")
    assert store.version == SCHEMA_VERSION == 5
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
    assert store.version == SCHEMA_VERSION
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
    r2 = store.add_message(a.id, "assistant", "second", variant_of=r1.id)  # regenerate
    assert [m.content for m in store.messages(a.id)] == ["q", "second"]
    assert store.messages(a.id)[-1].id == r2.id
    assert (store.messages(a.id)[-1].variant, store.messages(a.id)[-1].variants) == (2, 2)
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


def test_schema_2_database_is_upgraded_and_a_reply_streams_into_it(tmp_path: Path) -> None:
    path = tmp_path / "v2.sqlite3"
    conn = sqlite3.connect(path)
    v1_initial.upgrade(conn)
    v2_reply_stats.upgrade(conn)
    conn.execute("PRAGMA user_version = 2")
    conn.execute("INSERT INTO conversations VALUES (1, 'old chat', NULL, 1.0, 1.0)")
    conn.execute("INSERT INTO messages VALUES (1, 1, 'user', 'hello', 1.0, NULL, NULL, NULL, NULL, NULL)")
    conn.execute("INSERT INTO messages VALUES (2, 1, 'assistant', 'hi!', 2.0, 'stop', 'autoregressive', 2, 9.0, NULL)")
    conn.commit()
    conn.close()

    store = Store.open(path)
    assert store.version == SCHEMA_VERSION
    assert [(m.content, m.finish_reason) for m in store.messages(1)] == [("hello", None), ("hi!", "stop")]
    draft = store.begin_reply(1, "Once")
    store.save_partial(draft, "Once upon")
    assert store.messages(1)[-1].content == "Once upon" and store.messages(1)[-1].finish_reason == "partial"
    store.close()


def test_a_finished_reply_takes_the_partial_ones_place(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "h.sqlite3")
    conv = store.new_conversation()
    store.add_message(conv.id, "user", "q")
    draft = store.begin_reply(conv.id, "par")
    store.save_partial(draft, "partial text")
    done = store.add_message(conv.id, "assistant", "partial text, finished", finish_reason="stop")
    assert [(m.content, m.finish_reason) for m in store.messages(conv.id)] == [
        ("q", None), ("partial text, finished", "stop")
    ]
    store.save_partial(draft, "late")  # a save after the finish changes nothing
    assert store.messages(conv.id)[-1] == done
    store.close()
    assert Store.open(tmp_path / "h.sqlite3").mark_interrupted() == 0


def test_a_reply_left_partial_by_a_crash_reopens_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = Store.open(path)
    conv = store.new_conversation()
    store.add_message(conv.id, "user", "tell me a story")
    draft = store.begin_reply(conv.id, "Once")
    store.save_partial(draft, "Once upon a time")
    # no finish: the app died here (the connection is simply dropped)
    del store

    reopened = Store.open(path)
    last = reopened.messages(conv.id)[-1]
    assert (last.role, last.content, last.finish_reason) == ("assistant", "Once upon a time", "interrupted")
    assert last.interrupted and not last.stopped
    assert reopened.mark_interrupted() == 0  # marked once
    reopened.close()


def test_an_interrupted_regeneration_is_kept_beside_the_old_reply_if_it_saved_text(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = Store.open(path)
    a, b = store.new_conversation("a"), store.new_conversation("b")
    for conv in (a, b):
        store.add_message(conv.id, "user", "q")
    old_a = store.add_message(a.id, "assistant", "old a", finish_reason="stop")
    old_b = store.add_message(b.id, "assistant", "old b", finish_reason="stop")
    store.begin_reply(a.id, "new a so far", variant_of=old_a.id)
    store.begin_reply(b.id, "", variant_of=old_b.id)  # crashed before any text was saved
    assert store.mark_interrupted() == 1
    assert [(m.content, m.finish_reason) for m in store.messages(a.id)] == [
        ("q", None), ("new a so far", "interrupted")
    ]
    assert len(store.variants(old_a.id)) == 2  # the old answer is kept, one step back
    assert [(m.content, m.finish_reason) for m in store.messages(b.id)] == [("q", None), ("old b", "stop")]
    store.close()


def _schema_3(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    for upgrade in (v1_initial.upgrade, v2_reply_stats.upgrade, v3_partial_replies.upgrade):
        upgrade(conn)
    conn.execute("PRAGMA user_version = 3")
    return conn


def test_schema_3_database_becomes_a_tree_of_chained_messages(tmp_path: Path) -> None:
    path = tmp_path / "v3.sqlite3"
    conn = _schema_3(path)
    conn.execute("INSERT INTO conversations VALUES (1, 'old chat', NULL, 1.0, 1.0)")
    conn.execute("INSERT INTO conversations VALUES (2, 'other', NULL, 1.0, 1.0)")
    for i, (cid, role, text) in enumerate(
        [(1, "user", "one"), (2, "user", "elsewhere"), (1, "assistant", "two"), (1, "user", "three")], 1
    ):
        conn.execute(
            "INSERT INTO messages (id, conversation_id, role, content, created_at) VALUES (?, ?, ?, ?, ?)",
            (i, cid, role, text, float(i)),
        )
    conn.commit()
    conn.close()

    store = Store.open(path)
    path1 = store.messages(1)
    assert [(m.content, m.parent_id) for m in path1] == [("one", None), ("two", 1), ("three", 3)]
    assert [(m.content, m.parent_id) for m in store.messages(2)] == [("elsewhere", None)]
    # An edited prompt is a sibling: the old one and what followed it are kept.
    edited = store.add_message(1, "user", "two, edited", variant_of=path1[1].id)
    assert [m.content for m in store.messages(1)] == ["one", "two, edited"]
    store.select(path1[2].id)  # back to the old branch, down to its end
    assert [m.content for m in store.messages(1)] == ["one", "two", "three"]
    assert store.variants(edited.id) == [path1[1].id, edited.id]
    store.close()


def test_conversation_params_round_trip_and_bad_json_is_ignored(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "h.sqlite3")
    conv = store.new_conversation()
    assert store.conversation(conv.id).params == ConversationParams()  # type: ignore[union-attr]
    params = ConversationParams(temperature=0.0, top_k=5, seed=7, strategy="anpd")
    store.set_params(conv.id, params)
    assert store.conversation(conv.id).params == params  # type: ignore[union-attr]
    assert ConversationParams.from_json('{"temperature": "hot", "top_k": 3, "nope": 1}') == ConversationParams(top_k=3)
    assert ConversationParams.from_json("not json") == ConversationParams()
    store.close()


def test_search_finds_words_in_every_conversation(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "h.sqlite3")
    a, b = store.new_conversation("pasta"), store.new_conversation("bikes")
    store.add_message(a.id, "user", "How long do I boil spaghetti?")
    store.add_message(a.id, "assistant", "Boil the spaghetti for nine minutes.")
    store.add_message(b.id, "user", "How do I fix a flat tyre?")
    hits = store.search("spaghetti boil")
    assert {(h.conversation_id, h.title) for h in hits} == {(a.id, "pasta")} and len(hits) == 2
    assert [h.title for h in store.search("tyre")] == ["bikes"]
    assert store.search("spag")  # a prefix finds the word
    assert store.search("%") == [] and store.search("zebra") == []
    store.close()


def test_search_without_fts5_falls_back_to_like(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(v5_search, "fts5_available", lambda conn: False)
    store = Store.open(tmp_path / "h.sqlite3")
    assert not store._has_fts()
    conv = store.new_conversation("t")
    store.add_message(conv.id, "user", "100% of the snake_case names")
    assert [h.snippet for h in store.search("snake_case")] == ["100% of the snake_case names"]
    assert store.search("case names") and not store.search("camel")
    store.close()
