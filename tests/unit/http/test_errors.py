"""The error catalogue is the one list of error types: every type the service raises is in it,
and docs/API.md's errors table lists exactly its types with their statuses."""

from __future__ import annotations

import re
from pathlib import Path

from rnnserve.service.http import errors
from rnnserve.service.interface import RequestError

ROOT = Path(__file__).resolve().parents[3]
RAISED = re.compile(r'RequestError\(\s*"([a-z_]+)"')


def raised_types() -> set[str]:
    source = "".join(p.read_text() for p in sorted((ROOT / "service").rglob("*.py")))
    return set(RAISED.findall(source))


def doc_table() -> dict[str, set[int]]:
    """docs/API.md's errors table: each ``type`` and the statuses its row gives."""
    text = (ROOT / "docs" / "API.md").read_text()
    table = text.split("<!-- errors:begin -->", 1)[1].split("<!-- errors:end -->", 1)[0]
    listed: dict[str, set[int]] = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0][:1].isdigit():
            continue  # the header and its rule
        statuses = {int(s) for s in cells[0].split(",")}
        for kind in re.findall(r"`([a-z_]+)`", cells[1]):
            listed.setdefault(kind, set()).update(statuses)
    return listed


def test_every_raised_type_is_in_the_catalogue() -> None:
    raised = raised_types()
    assert {"unauthorized", "body_too_large", "non_finite", "invalid_body"} <= raised
    assert raised <= set(errors.CATALOGUE), raised - set(errors.CATALOGUE)


def test_no_layer_gives_a_status() -> None:
    source = "".join(p.read_text() for p in sorted((ROOT / "service").rglob("*.py")))
    assert not re.search(r"RequestError\(\s*\d", source)


def test_the_api_doc_lists_the_catalogue() -> None:
    listed = doc_table()
    assert set(listed) == set(errors.CATALOGUE)
    for kind, entry in errors.CATALOGUE.items():
        assert entry.status in listed[kind], (kind, listed[kind])


def test_status_comes_from_the_catalogue() -> None:
    assert errors.status("unauthorized") == 401
    assert errors.status("body_too_large") == 413
    assert errors.status("overloaded") == 503
    assert errors.status("deadline_exceeded") == 504
    assert errors.status("a_parsers_own_kind") == 422  # pydantic's own kinds are 422s
    assert errors.body(RequestError("a_parsers_own_kind", "m", ("x", 1))) == {
        "detail": "m", "type": "invalid_request", "loc": ["x", 1],
    }  # fmt: skip


def test_responses_name_the_types_of_each_status() -> None:
    responses = errors.openapi_responses((413, 503), object)
    assert set(responses) == {413, 503}
    for kind in ("body_too_large", "too_many_sequences", "sequence_too_long"):
        assert kind in responses[413]["description"]
    assert "overloaded" in responses[503]["description"]
    assert "overloaded" not in responses[413]["description"]
