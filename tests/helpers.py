"""Small helpers shared by test modules."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

# one chunk's (joins, leaves, starts, keep_state), as ChunkedRollout.advance takes them
Chunk = tuple[list[tuple[int, list[np.ndarray]]], list[int], Mapping[int, Any], list[int]]


def refusal(exc: type[Exception], call: Callable[[], object]) -> str:
    """The message ``call`` is refused with (it must raise ``exc``)."""
    try:
        call()
    except exc as error:
        return str(error)
    raise AssertionError(f"not refused with {exc.__name__}")


def markdown_tables(text: str) -> list[list[str]]:
    """The Markdown tables in ``text``, each as its lines (header and rule included)."""
    tables: list[list[str]] = []
    current: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def serve_schedule(engine: Any, schedule: list[Chunk]) -> tuple[dict[int, Any], dict[int, Any]]:
    """Run a ``ChunkedRollout`` through ``schedule``, one entry a chunk, then until it holds
    nothing: every finished request's outputs and kept final state, by key."""
    finished: dict[int, Any] = {}
    states: dict[int, Any] = {}
    pending = list(schedule)
    while pending or engine.running_sequences:
        joins, leaves, starts, keep = pending.pop(0) if pending else ([], [], {}, [])
        done, _, _ = engine.advance(joins, leaves, starts, keep)
        finished.update(done)
        states.update(engine.finished_states)
    return finished, states
