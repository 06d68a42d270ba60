"""potluck's inference engine: usable and testable without the app (it never imports it)."""
