"""Runnable examples: a client session, and your own model served (a GRU encoder)."""
