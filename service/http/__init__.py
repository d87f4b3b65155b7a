"""Runs in each HTTP worker (the only process with --workers 1): app, routes, docs; no torch."""
