"""How the routes read a body that arrives in pieces: assembled exactly, whatever the pieces."""

from __future__ import annotations

import asyncio
import itertools
import math
import struct
import time
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge
from starlette.requests import Request

from rnnserve.service import endpoints
from rnnserve.service.codec import bodies
from rnnserve.service.endpoints import Endpoint
from rnnserve.service.http import auth, inference, outcomes, streaming
from rnnserve.service.http.errors import status as status_of
from rnnserve.service.interface import Limits, RequestError


def _request(pieces: list[bytes], declared: int | None, limit: int = 1 << 30) -> Request:
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ] or [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    gauge = Gauge("inflight", "bytes", registry=CollectorRegistry())
    app = SimpleNamespace(state=SimpleNamespace(byte_budget=auth.ByteBudget(limit, gauge)))
    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers, "app": app}
    return Request(scope, receive)


def _read(pieces: list[bytes], declared: int | None, limit: int = 1 << 20) -> bytes:
    request = _request(pieces, declared)
    return asyncio.run(auth.read_body(request, limit, 5.0, auth.Held()))


BODY = bytes(range(256)) * 40  # 10,240 bytes


@pytest.mark.parametrize(
    "cuts",
    [[], [1], [5000], [1, 2, 3], [256, 512, 4096, 10_000], list(range(100, 10_240, 100))],
)
@pytest.mark.parametrize("declared", [True, False])
def test_pieces_are_assembled_into_the_body(cuts: list[int], declared: bool) -> None:
    edges = [0, *cuts, len(BODY)]
    pieces = [BODY[a:b] for a, b in itertools.pairwise(edges)]
    got = _read([*pieces[:1], b"", *pieces[1:]], len(BODY) if declared else None)
    assert got == BODY
    if len(pieces) == 1:
        assert got is pieces[0]  # one piece: no copy


@pytest.mark.parametrize("declared", [len(BODY) - 100, len(BODY) + 100])
def test_a_body_not_of_its_declared_length_is_kept_as_it_came(declared: int) -> None:
    # the HTTP parsers enforce Content-Length; the route keeps what came, never pads or cuts
    pieces = [BODY[:3000], BODY[3000:7000], BODY[7000:]]
    assert _read(pieces, declared) == BODY


def test_a_body_over_the_limit_is_refused_as_it_arrives() -> None:
    pieces = [BODY[:3000], BODY[3000:7000], BODY[7000:]]
    with pytest.raises(RequestError) as err:
        _read(pieces, None, limit=5000)
    assert (status_of(err.value.type), err.value.type) == (413, "body_too_large")


# -- the limits, the budget and the timeout, at their edges --


def _budgeted(
    pieces: list[bytes], declared: int | None, budget: int
) -> tuple[Request, auth.ByteBudget, list[int]]:
    """A request whose receive() counts its calls, and the byte budget it reads against."""
    request = _request(pieces, declared, limit=budget)
    calls = [0]
    inner = request.receive

    async def counted() -> Any:
        calls[0] += 1
        return await inner()

    request._receive = counted
    return request, request.app.state.byte_budget, calls


def test_a_declared_length_over_the_limit_is_refused_before_a_byte_is_read() -> None:
    request, budget, calls = _budgeted([b"x" * 10], declared=6000, budget=1 << 20)
    with pytest.raises(RequestError) as err:
        asyncio.run(auth.read_body(request, 5000, 5.0, auth.Held()))
    assert (status_of(err.value.type), err.value.type) == (413, "body_too_large")
    assert "over 5000 bytes" in err.value.message
    assert calls == [0]  # the client was refused before it sent its body
    assert budget.used == 0


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_of_exactly_the_limit_is_read(declared: bool) -> None:
    pieces = [BODY[:4000], BODY[4000:5000]]
    request, budget, _ = _budgeted(pieces, 5000 if declared else None, budget=1 << 20)
    held = auth.Held()
    assert asyncio.run(auth.read_body(request, 5000, 5.0, held)) == BODY[:5000]
    assert held.n == budget.used == 5000


def test_the_budget_holds_the_bytes_that_came_once_each() -> None:
    # no declared length: the budget grows by what each piece adds, not by the running total
    pieces = [BODY[:1000], BODY[1000:3000], BODY[3000:3500]]
    request, budget, _ = _budgeted(pieces, None, budget=3500)  # exactly enough
    held = auth.Held()
    assert asyncio.run(auth.read_body(request, 1 << 20, 5.0, held)) == BODY[:3500]
    assert held.n == budget.used == 3500


def test_a_body_past_the_budget_as_it_arrives_is_refused_as_overloaded() -> None:
    pieces = [BODY[:1000], BODY[1000:3000], BODY[3000:3500]]
    request, budget, calls = _budgeted(pieces, None, budget=2500)
    held = auth.Held()
    with pytest.raises(RequestError) as err:
        asyncio.run(auth.read_body(request, 1 << 20, 5.0, held))
    assert (status_of(err.value.type), err.value.type) == (503, "overloaded")
    assert err.value.message == (
        "the server holds 1000 bytes of requests (its budget is 2500); try again later"
    )
    assert calls == [2]  # refused on the piece that did not fit, the rest never read
    assert held.n == budget.used == 1000  # what it holds is given back by the caller


def test_a_declared_length_over_the_budgets_room_is_refused_before_a_byte_is_read() -> None:
    request, budget, calls = _budgeted([b"x" * 10], declared=3000, budget=5000)
    budget.take(2001)  # another request's bytes: 2999 left
    with pytest.raises(RequestError) as err:
        asyncio.run(auth.read_body(request, 1 << 20, 5.0, auth.Held()))
    assert (status_of(err.value.type), err.value.type) == (503, "overloaded")
    assert calls == [0]
    assert budget.used == 2001  # nothing of this request was taken


def test_a_declared_body_that_never_comes_holds_none_of_the_budget() -> None:
    # clients declaring large bodies and sending nothing must not shut the others out
    async def main() -> None:
        stalled, budget, _ = _budgeted([], declared=4000, budget=5000)

        async def never() -> Any:
            await asyncio.sleep(30)

        stalled._receive = never
        waiting = [
            asyncio.ensure_future(auth.read_body(stalled, 1 << 20, 5.0, auth.Held()))
            for _ in range(8)
        ]
        await asyncio.sleep(0.01)
        assert budget.used == 0
        other = _request([BODY[:2500], BODY[2500:5000]], 5000)
        other.app.state.byte_budget = budget
        held = auth.Held()
        assert await auth.read_body(other, 1 << 20, 5.0, held) == BODY[:5000]
        assert held.n == budget.used == 5000  # the whole budget, beside eight stalled bodies
        for task in waiting:
            task.cancel()

    asyncio.run(main())


def test_an_answer_held_while_it_is_sent_narrows_the_room_for_requests() -> None:
    gauge = Gauge("inflight", "bytes", registry=CollectorRegistry())
    budget = auth.ByteBudget(1000, gauge)
    budget.hold(1500)  # an answer is never refused: it exists already
    assert (budget.used, budget.room()) == (1500, 0)
    assert not budget.take(1)
    budget.give(1500)
    assert (budget.used, budget.room(), gauge._value.get()) == (0, 1000, 0)


def test_a_body_that_stops_arriving_times_out_with_408() -> None:
    request = _request([BODY[:700], BODY[700:]], None)
    first = request._receive

    async def stalls() -> Any:
        message = await first()
        if message["body"] == BODY[700:]:
            await asyncio.sleep(30)  # the rest never comes
        return message

    request._receive = stalls
    with pytest.raises(RequestError) as err:
        asyncio.run(asyncio.wait_for(auth.read_body(request, 1 << 20, 0.05, auth.Held()), 5))
    assert (status_of(err.value.type), err.value.type) == (408, "body_timeout")
    assert err.value.message == "the request body did not arrive within 0.05 s (700 bytes came)"


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_cut_short_by_the_client_raises_client_gone(declared: bool) -> None:
    # a hang-up mid-body, or a chunked body that broke off: uvicorn tells the app the
    # connection went, and the client's request ends as ClientGone (a 499), never a failure
    request = _request([BODY[:700], BODY[700:]], len(BODY) if declared else None)
    first = request._receive

    async def hangs_up() -> Any:
        message = await first()
        return {"type": "http.disconnect"} if message["body"] == BODY[700:] else message

    request._receive = hangs_up
    held = auth.Held()
    with pytest.raises(outcomes.ClientGone):
        asyncio.run(auth.read_body(request, 1 << 20, 5.0, held))
    assert held.n == request.app.state.byte_budget.used == 700  # what came, declared or not


def _headers_request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


@pytest.mark.parametrize(
    ("default_s", "header", "due"),
    [
        (0.0, None, math.inf),  # no server default, no header: never
        (-1.0, None, math.inf),
        (2.5, None, 102.5),
        (0.0, "0.25", 100.25),  # the client's own, with or without a server default
        (2.5, "0.25", 100.25),
    ],
)
def test_the_deadline(default_s: float, header: str | None, due: float) -> None:
    assert inference._deadline(header, 100.0, default_s) == due


def test_a_call_reads_the_headers_its_steps_need_the_first_of_a_repeated_one() -> None:
    request = _headers_request({})
    request.scope["headers"] = [
        (b"x-request-timeout", b"0.25"),
        (b"content-type", b"application/x-safetensors; charset=x"),
        (b"x-request-timeout", b"9"),
        (b"x-request-id", b"abc"),
    ]
    state = SimpleNamespace(metrics=None, settings=None)
    request.scope["app"] = SimpleNamespace(state=state)
    call = inference.Call(request, endpoints.SMOOTH, None, None)  # type: ignore[arg-type]
    assert (call.given_timeout, call.given_id, call.accept) == ("0.25", "abc", None)
    assert call.content_type == "application/x-safetensors; charset=x"
    assert call.safetensors


def _receiving(messages: list[dict[str, Any]]) -> tuple[Request, list[int]]:
    messages = list(messages)  # the caller's list (a test parameter) is left as it was
    calls = [0]

    async def receive() -> dict[str, Any]:
        calls[0] += 1
        if messages:
            return messages.pop(0)
        await asyncio.sleep(30)  # nothing more ever comes
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive), calls


def test_disconnected_returns_on_the_disconnect_and_only_then() -> None:
    more = {"type": "http.request", "body": b"", "more_body": False}
    request, calls = _receiving([more, more, {"type": "http.disconnect"}, more])
    asyncio.run(asyncio.wait_for(streaming.disconnected(request), 5))
    assert calls == [3]


async def _value_after(s: float, value: int) -> int:
    await asyncio.sleep(s)
    return value


def test_unless_disconnected_gives_the_result_with_no_deadline() -> None:
    request, _ = _receiving([])  # the client stays
    got = asyncio.run(inference.unless_disconnected(request, _value_after(0.01, 7), math.inf))
    assert got == 7


@pytest.mark.parametrize(
    ("messages", "due_in", "raised"),
    [
        ([{"type": "http.disconnect"}], 30.0, inference.ClientGone),  # the client goes first
        ([], 0.02, inference.DeadlineExceeded),  # the deadline passes first
    ],
)
def test_unless_disconnected_ends_the_work_that_lost(
    messages: list[dict[str, Any]], due_in: float, raised: type[Exception]
) -> None:
    async def main() -> asyncio.Task[int]:
        request, _ = _receiving(messages)
        work = asyncio.ensure_future(_value_after(30, 7))
        with pytest.raises(raised):
            await inference.unless_disconnected(request, work, time.perf_counter() + due_in)
        await asyncio.sleep(0)
        return work

    assert asyncio.run(asyncio.wait_for(main(), 5)).cancelled()


_LONG = "-" + "9" * 39  # a negative number, too long to quote whole


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("abc", "'abc'"),
        ("0", "'0'"),
        ("-1.5", "'-1.5'"),
        ("nan", "'nan'"),
        (_LONG, repr(_LONG[:32] + "…")),  # a short quote, never the whole header
    ],
)
def test_a_timeout_header_that_is_not_a_positive_number_is_refused(given: str, shown: str) -> None:
    with pytest.raises(RequestError) as err:
        inference._deadline(given, 100.0, 5.0)
    assert (status_of(err.value.type), err.value.type) == (400, "invalid_header")
    assert err.value.message == (
        f"{inference.TIMEOUT_HEADER} must be a positive number of seconds, not {shown}"
    )


def test_unless_disconnected_gives_up_at_the_deadline_not_later() -> None:
    # the work would end soon after the deadline: it is not waited for
    async def main() -> asyncio.Task[int]:
        request, _ = _receiving([])  # the client stays
        work = asyncio.ensure_future(_value_after(0.3, 7))
        with pytest.raises(inference.DeadlineExceeded):
            await inference.unless_disconnected(request, work, time.perf_counter() + 0.02)
        await asyncio.sleep(0)
        return work

    assert asyncio.run(asyncio.wait_for(main(), 5)).cancelled()


def test_a_server_default_under_a_second_is_a_deadline_too() -> None:
    assert inference._deadline(None, 100.0, 0.5) == 100.5


# -- a safetensors header length refused from the first 8 bytes --

ST_LIMITS = Limits(256, 100_000, 1_000_000)
OVER = bodies.MAX_SAFETENSORS_HEADER + 1


def _st_request(
    pieces: list[bytes], declared: int | None
) -> tuple[Request, auth.ByteBudget, list[int]]:
    """A safetensors POST, its receive() counting its calls, and the byte budget it reads
    against."""
    request, budget, calls = _budgeted(pieces, declared, budget=1 << 30)
    request.scope["headers"].append((b"content-type", bodies.SAFETENSORS.encode()))
    return request, budget, calls


def _declaring(header_length: int, body_size: int) -> bytes:
    """A body of ``body_size`` bytes whose first 8 declare a header of ``header_length``."""
    return struct.pack("<Q", header_length) + b" " * (body_size - 8)


def _decoder_error(body: bytes) -> RequestError:
    with pytest.raises(RequestError) as err:
        bodies.decode(body, bodies.SAFETENSORS, "sequences", ST_LIMITS)
    return err.value


@pytest.mark.parametrize(
    ("header_length", "body_size"),
    [
        (OVER, OVER + 8),  # fits its body, one byte over the limit
        (16 << 20, 32 << 20),  # the hostile client's, in a 32 MiB body
        (4000, 3000),  # within the limit, past the body's end
        (2**64 - 1, 4096),
    ],
)
@pytest.mark.parametrize("first_piece", [8, 1000])
def test_a_header_the_decoder_would_refuse_is_refused_on_its_first_8_bytes(
    header_length: int, body_size: int, first_piece: int
) -> None:
    body = _declaring(header_length, body_size)
    pieces = [body[:first_piece], body[first_piece : body_size // 2], body[body_size // 2 :]]
    request, budget, calls = _st_request(pieces, body_size)
    held = auth.Held()
    with pytest.raises(RequestError) as err:
        asyncio.run(auth.read_body(request, 64 << 20, 5.0, held, safetensors=True))
    # the decoder's own error, type and message, as if the whole body had been read
    assert err.value == _decoder_error(body)
    assert status_of(err.value.type) == 400
    assert calls == [1]  # the rest was never read
    assert held.n == budget.used == 0  # nor taken from the budget


def test_a_header_length_split_over_pieces_is_read_whole_before_it_is_checked() -> None:
    body = _declaring(OVER, 2 * OVER)
    pieces = [body[:3], body[3:5], body[5:20], body[20:]]
    request, budget, calls = _st_request(pieces, len(body))
    held = auth.Held()
    with pytest.raises(RequestError) as err:
        asyncio.run(auth.read_body(request, 64 << 20, 5.0, held, safetensors=True))
    assert err.value == _decoder_error(body)
    assert calls == [3]  # refused on the piece that completed the 8 bytes
    assert held.n == budget.used == 5  # the two pieces before it; the caller gives them back


def test_without_a_declared_length_the_body_limit_bounds_the_header() -> None:
    # a chunked body: past the limit is past any body the route would take
    limit = 1 << 20
    body = _declaring(limit - 7, 4096)
    request, _, calls = _st_request([body[:100], body[100:]], None)
    with pytest.raises(RequestError) as err:
        asyncio.run(auth.read_body(request, limit, 5.0, auth.Held(), safetensors=True))
    assert err.value == _decoder_error(body)
    assert calls == [1]


def test_without_a_declared_length_a_header_over_its_limit_is_refused_with_the_limit() -> None:
    body = _declaring(OVER, 4 * OVER)
    request, _, calls = _st_request([body[:100], body[100:]], None)
    with pytest.raises(RequestError) as err:
        asyncio.run(auth.read_body(request, 64 << 20, 5.0, auth.Held(), safetensors=True))
    assert err.value == _decoder_error(body)
    assert calls == [1]


@pytest.mark.parametrize("header_length", [bodies.MAX_SAFETENSORS_HEADER, 100])
@pytest.mark.parametrize("declared", [True, False])
def test_a_header_within_the_limit_and_the_body_is_read_whole(
    header_length: int, declared: bool
) -> None:
    body = _declaring(header_length, header_length + 8)  # the header is the rest of the body
    pieces = [body[:4], body[4:9], body[9:]]
    request, budget, _ = _st_request(pieces, len(body) if declared else None)
    held = auth.Held()
    assert asyncio.run(auth.read_body(request, 64 << 20, 5.0, held, safetensors=True)) == body
    assert held.n == budget.used == len(body)


def _read_as(endpoint: Endpoint, request: Request) -> bytes:
    """The body as the inference steps read it for ``endpoint``."""
    state = request.scope["app"].state
    state.settings = SimpleNamespace(max_request_bytes=64 << 20, body_timeout_s=5.0)
    state.metrics = None  # read_request_body counts nothing
    gauge = Gauge("requests", "in flight", registry=CollectorRegistry())
    return asyncio.run(inference.read_request_body(inference.Call(request, endpoint, None, gauge)))


@pytest.mark.parametrize("endpoint", endpoints.INFERENCE, ids=lambda e: e.path)
def test_every_native_inference_endpoint_refuses_early(endpoint: Endpoint) -> None:
    body = _declaring(OVER, 4 * OVER)
    request, _, calls = _st_request([body[:100], body[100:]], len(body))
    with pytest.raises(RequestError) as err:
        _read_as(endpoint, request)
    assert err.value.type == "invalid_safetensors"
    assert calls == [1]


@pytest.mark.parametrize(
    ("endpoint", "content_type"),
    [
        # KServe's binary extension is its own format, whatever the content type says
        (endpoints.KSERVE_INFER, bodies.SAFETENSORS),
        (endpoints.SMOOTH, "application/json"),  # JSON: its first 8 bytes are no length
    ],
)
def test_bodies_not_read_as_safetensors_are_not_checked(
    endpoint: Endpoint, content_type: str
) -> None:
    body = _declaring(OVER, 4 * OVER)
    request, _, _ = _st_request([body[:100], body[100:]], len(body))
    request.scope["headers"] = [
        (k, content_type.encode() if k == b"content-type" else v)
        for k, v in request.scope["headers"]
    ]
    assert _read_as(endpoint, request) == body
