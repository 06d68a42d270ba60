"""The Textual chat app. Build it with :func:`build_app` (the CLI and the tests do)."""

from .app import ChatSession, PotluckApp, SessionFactory, build_app

__all__ = ["ChatSession", "PotluckApp", "SessionFactory", "build_app"]
