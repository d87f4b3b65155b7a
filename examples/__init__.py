"""Runnable examples: a client session, and your own model served (seed 003's GRU encoder)."""
