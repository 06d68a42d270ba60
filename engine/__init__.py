"""potluck's inference engine: usable and testable without the app (it never imports it).

Public API: build a :class:`Session` with :func:`open_session` from an :class:`EngineSpec`,
call ``session.generate(text, sampling, max_tokens)`` and render the events it yields
(every event carries its reply's ``run_id``); ``session.cancel()`` stops a reply.
"""

from .chat import Message
from .errors import ContextFullError, DecodeError, ModelError, PotluckError
from .events import Event, Finished, NodeStatus, PlanChanged, ReplyStarted, RoundStats, TokenText
from .loader import EngineSpec, open_session
from .sampling import SamplingParams
from .session import Session

__all__ = [
    "ContextFullError",
    "DecodeError",
    "EngineSpec",
    "Event",
    "Finished",
    "Message",
    "ModelError",
    "NodeStatus",
    "PlanChanged",
    "PotluckError",
    "ReplyStarted",
    "RoundStats",
    "SamplingParams",
    "Session",
    "TokenText",
    "open_session",
]
