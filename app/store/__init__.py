"""Chat history in SQLite: conversations and their messages, with a versioned schema."""

from .store import Conversation, Store, StoredMessage

__all__ = ["Conversation", "Store", "StoredMessage"]
