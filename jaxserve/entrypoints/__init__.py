"""User-facing entry points: the command line (the HTTP server comes later)."""
