"""potluck's inference engine: usable and testable without the app (it never imports it).

Public API: build a :class:`Session` with :func:`open_session` from an :class:`EngineSpec`,
call ``session.generate(text, sampling, max_tokens)`` and render the events it yields.
"""

from .chat import Message
from .errors import ContextFullError, DecodeError, ModelError, PotluckError
from .events import Event, Finished, NodeStatus, RoundStats, TokenText
from .loader import EngineSpec, open_session
from .sampling import SamplingParams
from .session import LiveStats, Session

__all__ = [
    "ContextFullError",
    "DecodeError",
    "EngineSpec",
    "Event",
    "Finished",
    "LiveStats",
    "Message",
    "ModelError",
    "NodeStatus",
    "PotluckError",
    "RoundStats",
    "SamplingParams",
    "Session",
    "TokenText",
    "open_session",
]
