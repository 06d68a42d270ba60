"""The KV caches of several recent conversations, kept in memory so that any of them continues
without processing its history again (an HTTP server's clients resend the whole history every
turn, and several clients take turns).

A :class:`Session` reuses the KV cache of the conversation it holds; with a :class:`PromptCache`
it also keeps the conversations it leaves and, for each request, continues whichever kept
conversation shares the longest token prefix with it, as llama.cpp's server does with its slots.
Only that common token prefix is reused: a resent assistant message may tokenize differently
from the tokens that were generated. Each kept conversation has an owner (the server's API key):
a request only ever continues its own owner's, so neither the reuse nor its timing tells one
client what another's prompt held.

The cells themselves stay where they were computed: each stage saves sequence 0's cells under a
slot number (``KvOp.save``, llama.cpp's sequence state), so in cluster mode every worker keeps its
own layers' share and nothing crosses the network. This cache holds what the head needs to pick
one: tokens, text, slot, and the bytes it takes over every layer (an upper bound, within
``max_bytes``); an evicted conversation's slot is dropped on every stage.

Exactness (docs/facts.md §3): a restored state is sequence 0's cells byte for byte, put back in
the same cells (0..n-1 of an empty cache), so a conversation continued from the cache computes
exactly what it would have computed had it never left the context.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .memory import free_memory_bytes

log = logging.getLogger(__name__)

# At most this share of the memory free when the cache is made holds kept conversations.
FREE_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class KeptConversation:
    """One conversation the context held: its tokens, the rendered text they stand for, and the
    slot holding the KV cells of the first ``n_kv`` of them (the last token of a reply is not
    in the cache yet)."""

    tokens: tuple[int, ...]
    covered: str
    n_kv: int
    slot: int  # where the stages keep its cells (KvOp.save)
    kv_bytes: int  # those cells over every layer (validate.kv_bytes: an upper bound)
    owner: str = ""  # whose it is (the server's API key name): only its owner's requests reuse it

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + 8 * len(self.tokens) + len(self.covered)


@dataclass(frozen=True)
class PromptCacheStats:
    """Counters since the cache was made (what the server's /health shows)."""

    conversations: int
    bytes_used: int
    max_bytes: int
    restored: int  # conversations brought back into the context
    kept: int  # conversations saved on leaving the context
    evicted: int  # dropped, least recently used first, to stay within max_bytes
    lost: int  # found gone when wanted (a cluster rebuilt its chain since they were kept)


class PromptCache:
    """Least-recently-used kept conversations within ``max_bytes`` (and ``max_conversations``).

    The session calls it from its own thread; :meth:`stats` may be read from any thread.
    """

    MAX_CONVERSATIONS = 64  # what a stage keeps at most (core/stage.py): more would be refused there

    def __init__(self, max_bytes: int, max_conversations: int = 16) -> None:
        if max_bytes < 0 or not 1 <= max_conversations <= self.MAX_CONVERSATIONS:
            raise ValueError(f"a prompt cache needs max_bytes >= 0 and 1..{self.MAX_CONVERSATIONS} conversations")
        self.max_bytes = max_bytes
        self.max_conversations = max_conversations
        self._kept: OrderedDict[int, KeptConversation] = OrderedDict()  # by slot, oldest first
        self._ids = 0
        self._lock = threading.Lock()
        # held by a session from keeping its conversation to restoring the one it chose
        self.choosing = threading.Lock()
        self._restored = self._saved = self._evicted = self._lost = 0

    @classmethod
    def within_free_memory(cls, max_bytes: int, max_conversations: int = 16) -> PromptCache:
        """``max_bytes``, but never more than :data:`FREE_MEMORY_SHARE` of the free memory now."""
        free = free_memory_bytes()
        budget = max_bytes if free is None else min(max_bytes, int(free * FREE_MEMORY_SHARE))
        if budget < max_bytes:
            log.info("prompt cache capped at %.0f MB (a share of the free memory)", budget / 1e6)
        return cls(budget, max_conversations)

    def closest(self, shared: Callable[[KeptConversation], int], owner: str = ""
                ) -> tuple[KeptConversation | None, int]:
        """``owner``'s kept conversation with the most ``shared`` tokens (the newest on a tie) and
        that count. Another owner's are never looked at: what a request reuses (and the time it
        saves, and ``cached_tokens``) would tell its sender what someone else's prompt held."""
        with self._lock:
            kept = [c for c in self._kept.values() if c.owner == owner]
        best, best_n = None, 0
        for conv in reversed(kept):
            n = shared(conv)
            if n > best_n:
                best, best_n = conv, n
        return best, best_n

    def restored(self, conv: KeptConversation) -> None:
        """``conv`` went back into the context: it becomes the most recently used."""
        with self._lock:
            if conv.slot in self._kept:
                self._kept.move_to_end(conv.slot)
            self._restored += 1

    def fits(self, kv_bytes: int) -> bool:
        return kv_bytes <= self.max_bytes

    def new_slot(self) -> int:
        """A slot number no kept conversation uses."""
        with self._lock:
            self._ids += 1
            return self._ids

    def keep(self, conv: KeptConversation) -> list[KeptConversation]:
        """Keep ``conv``, replacing kept conversations it extends; evict the least recent past the
        budget. Returns the conversations let go (``conv`` itself if it does not fit): their
        slots are to be dropped."""
        if conv.n_kv == 0 or conv.nbytes > self.max_bytes:
            return [conv]
        gone: list[KeptConversation] = []
        with self._lock:
            for key, old in list(self._kept.items()):
                same = old.owner == conv.owner and old.n_kv <= conv.n_kv
                if same and old.tokens[: old.n_kv] == conv.tokens[: old.n_kv]:
                    gone.append(self._kept.pop(key))  # conv holds all of it
            self._kept[conv.slot] = conv
            self._saved += 1
            while len(self._kept) > self.max_conversations or self._used() > self.max_bytes:
                gone.append(self._kept.popitem(last=False)[1])
                self._evicted += 1
        return gone

    def slots(self) -> list[int]:
        """The slots of the kept conversations, oldest first."""
        with self._lock:
            return list(self._kept)

    def discard(self, conv: KeptConversation) -> None:
        """``conv``'s cells are gone (a cluster rebuilt its chain since): forget it."""
        with self._lock:
            if self._kept.pop(conv.slot, None) is not None:
                self._lost += 1

    def limit(self, max_bytes: int) -> None:
        """Lower the budget (a cluster's workers hold less than the head would)."""
        with self._lock:
            self.max_bytes = min(self.max_bytes, max_bytes)

    def _used(self) -> int:
        return sum(c.nbytes for c in self._kept.values())

    def stats(self) -> PromptCacheStats:
        with self._lock:
            return PromptCacheStats(
                conversations=len(self._kept), bytes_used=self._used(), max_bytes=self.max_bytes,
                restored=self._restored, kept=self._saved, evicted=self._evicted, lost=self._lost,
            )
