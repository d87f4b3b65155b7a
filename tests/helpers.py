"""Small helpers shared by test modules."""

from __future__ import annotations

from collections.abc import Callable


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
