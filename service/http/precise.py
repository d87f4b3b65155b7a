"""The precise JSON reader for large bodies, in a child process.

pydantic's parser (the precise path, for bodies the compiled reader declines: escaped keys,
duplicate keys, anything invalid) holds the GIL for the whole of one body, so on a codec thread a
large one still stalls the event loop and every other thread of the process. Bodies of at least
:data:`CHILD_MIN_BYTES` are parsed in one child process per HTTP process instead, started on the
first such body; it sends the numbers back flat (:class:`FlatNumbers`), a few arrays, never a
Python object per number. Smaller bodies are parsed in place, where the hand-off would cost more
than the parse.

Its memory is the caller's to count: :func:`precise_cost` bounds the bytes a precise parse of a
body may take (the nested lists pydantic builds, a Python float and a list slot per number, a
list per step), so the route holds that much of the byte budget while it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from fastapi import Request
from pydantic import BaseModel

from rnnserve.service.codec.bodies import Decoded, StateAsked
from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.http.auth import ByteBudget, Held, budget_of, overloaded
from rnnserve.service.http.validation import FlatNumbers, parse_body, parse_state, state_from_json
from rnnserve.service.interface import RequestError
from rnnserve.service.lifeline import die_with_parent

CHILD_MIN_BYTES = 256 * 1024

_T = TypeVar("_T")

# what one number or one list costs at most while it is parsed: pydantic's own tree of the JSON
# (Rust values), then a Python float (24 bytes) and its slot in a list, or a list (56 + slots);
# then its place in the flat arrays. Checked against the parser's peak memory for the worst
# shapes (one-digit numbers, one-number steps, one-step sequences) by the unit tests.
_BYTES_PER_ITEM = 128


def precise_cost(body: bytes) -> int:
    """At most how many bytes the precise parse of ``body`` takes, from its separators: every
    number and every list ends at a ``,`` or a ``]``. (Strings hold ``,`` and ``]`` too; they
    only make the bound larger.)"""
    raw = np.frombuffer(body, np.uint8)
    items = int(np.count_nonzero(raw == ord(","))) + int(np.count_nonzero(raw == ord("]")))
    return _BYTES_PER_ITEM * (items + 1) + 2 * len(body)


def parse_flat(body: bytes, schema: type[BaseModel], field: str) -> tuple[str | None, FlatNumbers]:
    """``parse_body``, with the sequences flattened (runs in the child)."""
    name, sequences = parse_body(body, schema, field)
    return name, FlatNumbers.of(sequences)


async def read_precisely(
    request: Request, body: bytes, schema: type[BaseModel], field: str, held: Held, codec: CodecPool
) -> tuple[str | None, FlatNumbers]:
    """The precise path for one request's body, its memory held in the byte budget (``held``
    grows by it; the route gives it back with the body's bytes)."""
    await hold_cost(body, budget_of(request), held, codec)
    return await READER.read(body, schema, field, codec)


async def hold_cost(body: bytes, budget: ByteBudget, held: Held, codec: CodecPool) -> None:
    """Hold in ``budget`` what the precise parse of ``body`` may take (``held`` grows by it);
    413 ``body_too_large`` if it could never fit, 503 ``overloaded`` if not now."""
    cost = await codec.run(len(body), precise_cost, body)
    if cost > budget.limit:
        raise RequestError(
            "body_too_large",
            f"this body goes to the precise JSON reader (json_reader is 'precise', or the body "
            f"has escapes, repeated keys or an error), which would take about {cost} bytes for "
            f"it, over max_inflight_bytes ({budget.limit}); send plain JSON or safetensors",
        )  # fmt: skip
    if not budget.take(cost):
        raise overloaded(budget)
    held.n += cost


async def read_state(
    decoded: Decoded, body: bytes, budget: ByteBudget, held: Held, codec: CodecPool
) -> StateAsked | None:
    """What a body the fast reader took asks of the carried state. The fast reader leaves a
    ``state`` object to this one (its memory held as for a whole body); ``None`` if the state
    has an error, which the precise read of the whole body then names where it is."""
    if decoded.state_span is None:
        return decoded.state
    begin, end = decoded.state_span
    part = b'{"state":' + body[begin:end] + b"}"
    await hold_cost(part, budget, held, codec)
    try:
        doc = await READER.run(codec, parse_state, part)
    except RequestError:
        return None
    return state_from_json(doc, decoded.state.return_state)


class PreciseReader:
    """The child process, started on first use and shut down with the app."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _child(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn: the child must not inherit this process's threads and event loop; it
                # dies with this process, however that ends (kill -9 too): nothing else would
                # tell it, since it holds both ends of its own queue's pipe
                context = multiprocessing.get_context("spawn")
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=context, initializer=die_with_parent
                )
            return self._pool

    async def read(
        self, body: bytes, schema: type[BaseModel], field: str, codec: CodecPool
    ) -> tuple[str | None, FlatNumbers]:
        """The body's model name and numbers, or the :class:`RequestError` that says what is
        wrong with it; parsed in the child when the body is large, else where ``codec`` puts
        work of its size."""
        return await self.run(codec, parse_flat, body, schema, field)

    async def run(self, codec: CodecPool, parse: Callable[..., _T], body: bytes, *args: Any) -> _T:
        """``parse(body, *args)``: in the child when the body is large, else where ``codec``
        puts work of its size."""
        if len(body) < CHILD_MIN_BYTES:
            return await codec.run(len(body), parse, body, *args)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._child(), parse, body, *args)
        except concurrent.futures.process.BrokenProcessPool:
            with self._lock:  # the child died (killed, out of memory): the next body starts one
                self._pool = None
            raise

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None


READER = PreciseReader()  # one child per HTTP process; the executor stops it at exit
