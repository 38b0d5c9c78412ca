"""`jdspark serve`: an OpenAI-compatible HTTP server (protocol, chat encoding, scheduler, metrics, app)."""
