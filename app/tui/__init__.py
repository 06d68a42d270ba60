"""The Textual chat app. Build it with :func:`build_app` (the CLI and the tests do)."""

from .app import PotluckApp, build_app
from .replies import ChatSession, SessionFactory

__all__ = ["ChatSession", "PotluckApp", "SessionFactory", "build_app"]
