"""Schema migrations, one small module per schema version, applied in order.

The database records its version in ``PRAGMA user_version``. To change the schema, add
``vN_<what>.py`` with an ``upgrade(conn)`` and append it here; never edit a released one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from . import v1_initial, v2_reply_stats, v3_partial_replies, v4_variants_and_params, v5_search

MIGRATIONS: list[tuple[int, Callable[[sqlite3.Connection], None]]] = [
    (1, v1_initial.upgrade),
    (2, v2_reply_stats.upgrade),
    (3, v3_partial_replies.upgrade),
    (4, v4_variants_and_params.upgrade),
    (5, v5_search.upgrade),
]

SCHEMA_VERSION = MIGRATIONS[-1][0]
