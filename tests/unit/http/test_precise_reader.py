"""The precise JSON reader for large bodies: parsed in a child process with the same answers and
errors as in place, never in the serving process, and within the memory it is charged."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.http import precise, validation
from rnnserve.service.http.validation import FlatNumbers, SmoothRequest
from rnnserve.service.interface import Limits, RequestError

ROOT = Path(__file__).resolve().parents[3]
CODEC = CodecPool(0, 0)  # all in place: the child is the reader's own doing
LIMITS = Limits(max_sequences=256, max_sequence_length=10**6, max_timesteps=10**7)


@pytest.fixture
def reader() -> Iterator[precise.PreciseReader]:
    reader = precise.PreciseReader()
    yield reader
    reader.close()


def _escaped_body(steps: int, width: int = 4) -> bytes:
    """Valid JSON the compiled reader declines: its key is written with an escape."""
    rows = ",".join("[" + ",".join(f"{0.001 * (t + f):.6f}" for f in range(width)) + "]"
                    for t in range(steps))  # fmt: skip
    return b'{"s\\u0065quences": [[' + rows.encode() + b'], [[1,2,3,4]]], "model": "m"}'


def test_a_large_body_is_parsed_in_the_child_with_the_same_numbers(
    reader: precise.PreciseReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = _escaped_body(20_000)
    assert len(body) >= precise.CHILD_MIN_BYTES
    here = precise.parse_flat(body, SmoothRequest, "sequences")

    def not_here(*_: object) -> None:
        raise AssertionError("parsed in the serving process")

    monkeypatch.setattr(precise, "parse_body", not_here)  # the child has its own, untouched
    name, flat = asyncio.run(reader.read(body, SmoothRequest, "sequences", CODEC))
    assert name == here[0] == "m"
    np.testing.assert_array_equal(flat.numbers, here[1].numbers)
    np.testing.assert_array_equal(flat.steps, [20_000, 1])
    np.testing.assert_array_equal(flat.widths, here[1].widths)
    arrays = validation.to_arrays(flat, "sequences", 4, LIMITS, "m")
    assert [a.shape for a in arrays] == [(20_000, 4), (1, 4)]
    assert arrays[0][7, 2] == np.float32(0.009)


def test_a_small_body_is_parsed_in_place(
    reader: precise.PreciseReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    parse = precise.parse_body

    def counted(*args: object) -> object:
        calls.append(1)
        return parse(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(precise, "parse_body", counted)
    name, flat = asyncio.run(reader.read(_escaped_body(3), SmoothRequest, "sequences", CODEC))
    assert (name, calls, flat.steps.tolist()) == ("m", [1], [3, 1])
    assert reader._pool is None  # no child for it


@pytest.mark.parametrize(
    "tail",
    [b', "extra": 1}', b', "model": 5}', b",]}"],  # unknown key, wrong type, invalid JSON
)
def test_a_large_bad_body_gets_the_same_error_from_the_child(
    reader: precise.PreciseReader, tail: bytes
) -> None:
    body = _escaped_body(20_000)[:-1] + tail
    with pytest.raises(RequestError) as here:
        validation.parse_body(body, SmoothRequest, "sequences")
    with pytest.raises(RequestError) as there:
        asyncio.run(reader.read(body, SmoothRequest, "sequences", CODEC))
    got, want = there.value, here.value
    assert (got.type, got.message, got.loc) == (want.type, want.message, want.loc)


def test_a_child_that_dies_is_replaced(reader: precise.PreciseReader) -> None:
    body = _escaped_body(20_000)
    asyncio.run(reader.read(body, SmoothRequest, "sequences", CODEC))
    pool = reader._pool
    assert pool is not None
    for process in list(pool._processes.values()):
        process.kill()
        process.join()
    with pytest.raises(Exception):  # noqa: B017, PT011 (BrokenProcessPool, however it is raised)
        asyncio.run(reader.read(body, SmoothRequest, "sequences", CODEC))
    assert asyncio.run(reader.read(body, SmoothRequest, "sequences", CODEC))[1].steps.tolist() == [
        20_000,
        1,
    ]


# the worst shapes for the parser's memory: one-digit numbers, one-number steps, one-step
# sequences; and a usual body
_SHAPES = {
    "one-number steps": "b'{\"sequences\": [[' + b','.join([b'[0]'] * n) + b']]}'",
    "one-step sequences": "b'{\"sequences\": [' + b','.join([b'[[0]]'] * (n // 4)) + b']}'",
    "wide steps": "b'{\"sequences\": [[' + b','.join([b'[' + b','.join([b'0'] * 16) + b']'] * "
    "(n // 16)) + b']]}'",
    "usual numbers": "b'{\"sequences\": [[' + b','.join([b'[' + b','.join([b'-0.123456'] * 16)"
    " + b']'] * (n // 16)) + b']]}'",
}

# the peak from /proc (VmHWM, this process's own), not getrusage's ru_maxrss, which a process
# started by a large one (pytest) inherits across fork and exec
_MEASURE = """
import gc
from rnnserve.service.http.precise import parse_flat, precise_cost
from rnnserve.service.http.validation import SmoothRequest

def peak():
    status = open("/proc/self/status").read().split("VmHWM:")[1]
    return int(status.split()[0]) * 1024

n = 1_000_000
body = {shape}
gc.collect()
before = peak()
parse_flat(body, SmoothRequest, "sequences")
print(peak() - before, precise_cost(body))
"""


@pytest.mark.slow
@pytest.mark.parametrize("shape", _SHAPES)
def test_the_charged_cost_bounds_the_parsers_peak_memory(shape: str) -> None:
    code = _MEASURE.format(shape=_SHAPES[shape])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True)
    grew, cost = map(int, out.stdout.split())
    assert grew > 0
    assert grew <= cost, (shape, grew, cost)
    assert cost <= 3 * grew  # a bound, not a refusal of bodies that would fit


def test_flat_numbers_keep_every_number_in_order() -> None:
    flat = FlatNumbers.of([[[1.0, 2.0], [3.0]], [[4.0, 5.0, 6.0]]])
    assert flat.numbers.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert (flat.steps.tolist(), flat.widths.tolist()) == ([2, 1], [2, 1, 3])


# a process that starts the reader's child, says the child's pid, and waits to be killed
_PARENT = """
import asyncio, sys, time
from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.http import precise
from rnnserve.service.http.validation import SmoothRequest
from tests.unit.http.test_precise_reader import _escaped_body

reader = precise.PreciseReader()
asyncio.run(reader.read(_escaped_body(20_000), SmoothRequest, "sequences", CodecPool(0, 0)))
print(*reader._pool._processes, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_child_dies_with_its_parent_however_that_ends() -> None:
    """kill -9 of the serving process (an HTTP worker the supervisor restarts, or the server)
    leaves no parser child behind: it holds both ends of its own queue, so nothing else would
    tell it."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30  # bounded; the kernel signals it at once
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for whoever adopted it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
