"""Chat history in SQLite: conversations and their messages, with a versioned schema."""

from .store import Conversation, ConversationParams, SearchHit, Store, StoredMessage

__all__ = ["Conversation", "ConversationParams", "SearchHit", "Store", "StoredMessage"]
