"""Runs beside the models (the single process, or the engine process of --workers N)."""
