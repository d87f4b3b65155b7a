"""The one reading of the ``Accept`` header: media ranges, their ``q``, and which answer a
request gets (JSON unless it names a binary or streamed answer it prefers)."""

from __future__ import annotations

import pytest

from rnnserve.service.http import negotiation
from rnnserve.service.http.negotiation import MediaRange

JSON = "application/json"
ST = "application/x-safetensors"
NDJSON = "application/x-ndjson"


def test_ranges_are_ordered_by_q_and_equal_qs_keep_their_order() -> None:
    got = negotiation.parse_accept("text/a;q=0.2, text/b, text/c;q=0.5, text/d")
    assert got == [
        MediaRange("text", "b", 1.0), MediaRange("text", "d", 1.0),
        MediaRange("text", "c", 0.5), MediaRange("text", "a", 0.2),
    ]  # fmt: skip


def test_types_and_the_q_parameter_are_case_insensitive() -> None:
    got = negotiation.parse_accept("APPLICATION/X-NDJSON; Q=0.7")
    assert got == [MediaRange("application", "x-ndjson", 0.7)]


@pytest.mark.parametrize(
    "header",
    [
        "", " , ,", "json", "application/", "/json", "a/b/c", "*/json", "a b/c", ";q=1",
        "\x00/\x01",
    ],
)  # fmt: skip
def test_malformed_ranges_are_left_out_without_an_error(header: str) -> None:
    assert negotiation.parse_accept(header) == []
    assert negotiation.parse_accept(f"{header}, text/plain;q=0.3") == [
        MediaRange("text", "plain", 0.3)
    ]


@pytest.mark.parametrize(
    ("given", "q"),
    [
        ("q=0", 0.0), ("q=0.5", 0.5), ("q=1", 1.0), ("q = 0.25", 0.25), ("level=1;q=0.4", 0.4),
        ("q=0.4;ext=1", 0.4), ("level=1", 1.0), ("q=0.3;q=0.9", 0.3),
        # a q that is not a weight from 0 to 1 makes the range not acceptable
        ("q=bad", 0.0), ("q=1=0", 0.0), ("q=", 0.0), ("q=2", 0.0), ("q=-1", 0.0), ("q=nan", 0.0),
        ("q=inf", 0.0),
        # a parameter that is none is ignored
        ("=", 1.0), ("junk", 1.0), ("=;q=0.5", 0.5),
    ],
)  # fmt: skip
def test_the_q_parameter(given: str, q: float) -> None:
    assert negotiation.parse_accept(f"text/plain;{given}") == [MediaRange("text", "plain", q)]


@pytest.mark.parametrize(
    ("header", "q"),
    [
        (None, 1.0), ("", 1.0), ("text/nonsense-only", 0.0), ("*/*", 1.0), ("*/*;q=0.3", 0.3),
        ("application/*;q=0.4, */*;q=0.3", 0.4),
        # the most specific range decides, whatever the others say
        ("application/json;q=0.2, application/*;q=0.9, */*", 0.2),
        ("application/json;q=0, */*", 0.0), ("application/*;q=0, */*", 0.0),
        ("APPLICATION/JSON;q=0.6", 0.6),
    ],
)  # fmt: skip
def test_the_quality_of_a_type_is_its_most_specific_ranges(header: str | None, q: float) -> None:
    assert negotiation.quality(negotiation.parse_accept(header), JSON) == q


OFFERS = (NDJSON, ST)


@pytest.mark.parametrize(
    ("accept", "answer"),
    [
        (None, JSON), ("", JSON), ("*/*", JSON), (JSON, JSON), ("application/*", JSON),
        (NDJSON, NDJSON), ("APPLICATION/X-NDJSON", NDJSON), (ST, ST),
        ("Application/X-Safetensors", ST),
        # q=0: not acceptable, whatever else the header says
        (f"{NDJSON};q=0, {JSON}", JSON), (f"{NDJSON};q=0", JSON), (f"{ST};q=0, {JSON}", JSON),
        (f"{NDJSON};q=0, {ST}", ST),
        # the higher q wins; a named answer wins a tie (the client asked for it), in offer order
        (f"{JSON}, {NDJSON}", NDJSON), (f"{JSON};q=1, {NDJSON};q=0.5", JSON),
        (f"{ST}, {NDJSON}", NDJSON), (f"{ST}, {NDJSON};q=0.9", ST),
        (f"{ST};q=0.5, */*;q=0.4", ST), (f"{ST};q=0.5, */*", JSON),
        (f"{ST};q=0.5, application/*", JSON), (f"{ST};q=0.5, {JSON};level=1", JSON),
        # a wildcard stands for JSON: it never asks for a binary or streamed answer
        ("application/*, */*", JSON), ("*/*;q=0, application/json;q=0", JSON),
        (f"{JSON};q=0, {ST};q=0.1", ST),
        # malformed parts are left out
        (f"json, {ST};q=bad, ,;", JSON), (f"{ST};q=1=0", JSON), (f"a/b/c, {NDJSON}", NDJSON),
    ],
)  # fmt: skip
def test_the_answer_chosen(accept: str | None, answer: str) -> None:
    assert negotiation.choose(accept, OFFERS, JSON) == answer


def test_an_answer_not_offered_is_never_chosen() -> None:
    assert negotiation.choose(NDJSON, (ST,), JSON) == JSON
    assert negotiation.choose(f"{NDJSON}, {ST};q=0.1", (ST,), JSON) == ST


@pytest.mark.parametrize(
    ("accept", "binary"),
    [
        (None, False), ("", False), ("*/*", False), ("application/json", False),
        ("application/x-safetensors", True), ("application/x-safetensors, */*", True),
        ("application/json, application/x-safetensors", True),
        ("application/json;q=1, application/x-safetensors;q=0.5", False),
        ("application/x-safetensors;q=0", False), ("application/X-Safetensors; q=0.9", True),
        ("application/x-safetensors;q=bad", False),
        # q defaults to 1 on either side; a q that is not a number counts as 0; wildcards
        # stand for JSON
        ("application/x-safetensors;q=1, application/json;level=1", True),
        ("application/x-safetensors;q=0.5, application/json;level=1", False),
        ("application/x-safetensors;q=1=0", False),
        ("application/x-safetensors;q=0.5, application/*", False),
        ("application/x-safetensors;q=0.5, */*", False),
        ("application/x-safetensors;q=0.5, */*;q=0.4", True),
        # JSON refused: the binary answer at any q above 0
        ("application/json;q=0, application/x-safetensors;q=0.1", True),
        ("*/*;q=0, application/x-safetensors;q=0.1", True),
    ],
)  # fmt: skip
def test_the_binary_answer_of_a_model_endpoint(accept: str | None, binary: bool) -> None:
    assert (negotiation.choose(accept, (ST,), JSON) == ST) is binary
