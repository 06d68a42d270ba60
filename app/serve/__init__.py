"""`potluck serve`: an OpenAI-compatible HTTP server over one engine session."""
