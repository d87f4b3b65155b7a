"""What the clients share and what does no I/O: errors, inputs and outputs, the wire formats,
deadlines and retry decisions. :mod:`rnnserve._async_client` (and the synchronous client generated
from it) does the I/O; :mod:`rnnserve.client` is the public face.
"""

from __future__ import annotations

import math
import random
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from email.utils import parsedate_to_datetime
from typing import Any, Literal
from urllib.parse import quote

import anyio
import httpx
import numpy as np
import orjson
import websockets.asyncio.client
import websockets.sync.client
from websockets.exceptions import ConnectionClosed

from rnnserve.service.endpoints import INFER, STREAM

SAFETENSORS = "application/x-safetensors"
JSON = "application/json"
NDJSON = "application/x-ndjson"
BinaryMode = Literal["auto", "always", "never"]
#: Statuses that mean "try again later": the server did not run the request.
RETRY_STATUSES = frozenset({429, 503})
#: The request header that tells the server the call's remaining deadline, in seconds.
TIMEOUT_HEADER = "X-Request-Timeout"
#: In ``binary="auto"``, these answers to a binary request mean "this server takes JSON only".
FALLBACK_STATUSES = frozenset({400, 415})
_FIRST_BACKOFF_S = 0.1  # without Retry-After: 0.1, 0.2, 0.4 ... s (capped), plus jitter
_JITTER = 0.2  # each wait is stretched by up to 20 %, so clients that were refused together spread

# (sequence index, first step, positions [k, 2]) as the server streams them
Chunk = tuple[int, int, Any]


# -- errors -----------------------------------------------------------------------------------


class RnnserveError(Exception):
    """Base of every error this client raises.

    ``status`` (HTTP status, ``None`` when there was no answer), ``type`` (the server's error
    type, e.g. ``wrong_feature_count``), ``loc`` (where in the request, e.g.
    ``("sequences", 1, 3)``) and ``detail`` (the server's message) come from the server's JSON
    error body ``{"detail", "type", "loc"}`` where there was one.
    """

    def __init__(
        self,
        detail: str,
        *,
        status: int | None = None,
        type: str | None = None,
        loc: Sequence[str | int] = (),
        retry_after: float | None = None,
    ) -> None:
        self.detail = detail
        self.status = status
        self.type = type
        self.loc: tuple[str | int, ...] = tuple(loc)
        self.retry_after = retry_after
        super().__init__(detail)

    def __str__(self) -> str:
        head = " ".join(p for p in (str(self.status or ""), self.type or "") if p)
        where = f" (at {'.'.join(str(p) for p in self.loc)})" if self.loc else ""
        return f"{head}: {self.detail}{where}" if head else f"{self.detail}{where}"


class BadRequest(RnnserveError):
    """A 4xx: the request is wrong (shape, values, limits, unknown field); retrying won't help."""


class ModelNotFound(BadRequest):
    """404 ``unknown_model``: no served model has that name (see :meth:`Client.models`)."""


class Overloaded(RnnserveError):
    """503 (queue full, not ready, shutting down) or 429, still so after every retry."""


class ServerError(RnnserveError):
    """A 5xx other than 503: the model failed on a batch (the server logged it), or a proxy."""


class DeadlineExceeded(RnnserveError, TimeoutError):
    """The call's deadline passed (retries and waits included); also a :class:`TimeoutError`."""


class ConnectionFailed(RnnserveError, ConnectionError):
    """No answer: the connection failed or broke (after the retries allowed for it)."""


class ProtocolError(RnnserveError):
    """An answer this client cannot read: a malformed body, or a stream that ended early."""


def _error_from(status: int, body: bytes, headers: httpx.Headers) -> RnnserveError:
    detail, kind, loc = "", None, []
    try:
        data = orjson.loads(body)
        detail = str(data["detail"])
        kind = data.get("type")
        loc = list(data.get("loc") or [])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        detail = body[:300].decode("utf-8", "replace").strip()
    detail = detail or f"HTTP {status}"
    retry_after = _parse_retry_after(headers.get("retry-after"))
    cls: type[RnnserveError]
    if status in RETRY_STATUSES:
        cls = Overloaded
    elif status == 504 and kind == "deadline_exceeded":
        cls = DeadlineExceeded  # the server's side of the deadline the call sent it
    elif status == 404 and (kind == "unknown_model" or loc == ["model"]):
        cls = ModelNotFound
    elif 400 <= status < 500:
        cls = BadRequest
    else:
        cls = ServerError
    return cls(detail, status=status, type=kind, loc=loc, retry_after=retry_after)


def _parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), or ``None``."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


# -- inputs and outputs -----------------------------------------------------------------------


def _torch() -> Any:
    """The torch module if it is imported (a tensor can only exist then), else ``None``."""
    return sys.modules.get("torch")


@dataclass
class _Batch:
    """A call's sequences as float32 ``[T_i, F]`` arrays, and how to give the answer back."""

    arrays: list[np.ndarray]
    devices: list[Any]  # per sequence: None (numpy out) or the torch device of its input
    form: Literal["one", "list", "stacked"]

    def convert(self, i: int, out: np.ndarray) -> Any:
        device = self.devices[i]
        if device is None:
            return out
        torch = _torch()
        tensor = torch.from_numpy(out)
        return tensor if device.type == "cpu" else tensor.to(device)

    def outputs(self, outs: list[np.ndarray]) -> Any:
        if len(outs) != len(self.arrays):
            raise ProtocolError(f"the server answered {len(outs)} sequences for {len(self.arrays)}")
        for i, (o, a) in enumerate(zip(outs, self.arrays, strict=True)):
            if o.ndim != 2 or o.shape[0] != a.shape[0]:
                raise ProtocolError(f"sequence {i}: {a.shape[0]} steps in, shape {o.shape} out")
        converted = [self.convert(i, o) for i, o in enumerate(outs)]
        if self.form == "one":
            return converted[0]
        if self.form == "stacked":
            if self.devices[0] is None:
                return np.stack(converted)
            return _torch().stack(converted)
        return converted


def _sequence(x: Any, i: int) -> tuple[np.ndarray, Any]:
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        device = x.device
        arr = x.detach().to("cpu", torch.float32).numpy()
    else:
        device = None
        try:
            arr = np.asarray(x, dtype="<f4")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"sequence {i}: not a [T, F] array of numbers ({exc})") from None
    if arr.ndim != 2:
        raise ValueError(f"sequence {i} has shape {list(arr.shape)}; each must be [T, F]")
    return np.ascontiguousarray(arr, dtype="<f4"), device


def _as_batch(inputs: Any) -> _Batch:
    torch = _torch()
    is_tensor = torch is not None and isinstance(inputs, torch.Tensor)
    if is_tensor or isinstance(inputs, np.ndarray):
        if inputs.ndim == 2:
            arr, device = _sequence(inputs, 0)
            return _Batch([arr], [device], "one")
        if inputs.ndim == 3:
            if inputs.shape[0] == 0:
                raise ValueError("no sequences: the [N, T, F] input has N = 0")
            pairs = [_sequence(x, i) for i, x in enumerate(inputs)]
            return _Batch([a for a, _ in pairs], [d for _, d in pairs], "stacked")
        raise ValueError(
            f"input of shape {list(inputs.shape)}: give one [T, F] sequence, a list of them, "
            "or an [N, T, F] array"
        )
    if isinstance(inputs, list | tuple):
        if not inputs:
            raise ValueError("no sequences")
        first = inputs[0]
        if isinstance(first, list | tuple) and not (
            first and (isinstance(first[0], list | tuple | np.ndarray) or _is_tensor(first[0]))
        ):
            arr, device = _sequence(inputs, 0)  # a nested list [[f, ...], ...]: one sequence
            return _Batch([arr], [device], "one")
        pairs = [_sequence(x, i) for i, x in enumerate(inputs)]
        return _Batch([a for a, _ in pairs], [d for _, d in pairs], "list")
    raise TypeError(
        f"cannot send a {type(inputs).__name__}: give a [T, F] numpy array, torch tensor or "
        "nested list, or a list of them"
    )


def _is_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _encode_safetensors(field: str, arrays: list[np.ndarray], model: str | None) -> bytes:
    """The request body in rnnserve's binary format (docs/WIRE.md), without a dependency."""
    data = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    lengths = np.array([a.shape[0] for a in arrays], dtype="<i8")
    header: dict[str, Any] = {}
    if model is not None:
        header["__metadata__"] = {"model": model}
    header[field] = {"dtype": "F32", "shape": list(data.shape), "data_offsets": [0, data.nbytes]}
    end = data.nbytes + lengths.nbytes
    header["lengths"] = {"dtype": "I64", "shape": [len(arrays)], "data_offsets": [data.nbytes, end]}
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, data.tobytes(), lengths.tobytes()])


def _decode_safetensors(body: bytes, field: str) -> list[np.ndarray]:
    try:
        (size,) = struct.unpack_from("<Q", body)
        header = orjson.loads(body[8 : 8 + size])
        base = 8 + size

        def tensor(name: str, dtype: str, ndim: int) -> np.ndarray:
            entry = header[name]
            start, end = entry["data_offsets"]
            shape = [int(d) for d in entry["shape"]]
            item = np.dtype(dtype).itemsize
            if len(shape) != ndim or base + end > len(body) or end - start != item * np.prod(shape):
                raise ValueError(f"tensor {name!r} has a bad shape or offsets")
            arr = np.frombuffer(body, dtype=dtype, count=(end - start) // item, offset=base + start)
            return arr.reshape(shape)

        data = tensor(field, "<f4", 2)  # a view of the body
        lengths = tensor("lengths", "<i8", 1)
        if lengths.sum() != data.shape[0] or (lengths < 0).any():
            raise ValueError("lengths do not add up to the rows")
    except (struct.error, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"unreadable safetensors answer: {exc}") from None
    # each its own copy: writable, and holding neither the body nor the other sequences
    return [part.copy() for part in np.split(data, np.cumsum(lengths)[:-1])]


def _decode_json(body: bytes, field: str) -> list[np.ndarray]:
    try:
        seqs = orjson.loads(body)[field]
        return [np.asarray(s, dtype=np.float32) for s in seqs]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"unreadable JSON answer: {exc}") from None


def _decode_line(line: str, batch: _Batch) -> Chunk | str:
    """One NDJSON line: a chunk, or the model name from the closing line; raises on an error."""
    try:
        msg = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"unreadable stream line: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("error", {}), dict):
        raise ProtocolError(f"unreadable stream line: {line[:64]!r}")
    if "error" in msg:
        err = msg["error"]
        expired = err.get("type") == "deadline_exceeded"  # the deadline the call sent
        raise (DeadlineExceeded if expired else ServerError)(
            str(err.get("detail", "the rollout failed")),
            status=504 if expired else 500,  # what the server records for it (the stream
            type=err.get("type"),  # itself began with 200)
            loc=err.get("loc") or [],
        )
    if msg.get("done"):
        return str(msg.get("model", ""))
    try:
        i, start = int(msg["sequence"]), int(msg["start"])
        positions = np.asarray(msg["positions"], dtype=np.float32)
        return i, start, batch.convert(i, positions)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ProtocolError(f"unreadable stream line: {exc}") from None


@dataclass(frozen=True)
class ModelInfo:
    """One served model, as ``GET /models`` describes it (everything it said is in ``info``)."""

    name: str
    kind: str
    input_dim: int | None
    output_dim: int | None
    config: dict[str, Any] = dataclass_field(default_factory=dict)
    info: dict[str, Any] = dataclass_field(default_factory=dict)

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> ModelInfo:
        shapes = entry.get("shapes") or {}

        def width(key: str) -> int | None:
            shape = shapes.get(key)
            return int(shape[-1]) if shape and isinstance(shape[-1], int) else None

        return cls(
            name=str(entry["name"]),
            kind=str(entry.get("kind", "")),
            input_dim=width("input"),
            output_dim=width("output"),
            config=dict(entry.get("config") or {}),
            info=dict(entry),
        )


# -- deadlines and retries --------------------------------------------------------------------


class _UseDefault:
    def __repr__(self) -> str:
        return "USE_DEFAULT"


#: A per-call ``timeout`` left at this takes the client's.
USE_DEFAULT = _UseDefault()
Timeout = float | None | _UseDefault


class _Deadline:
    def __init__(self, seconds: float | None) -> None:
        if seconds is not None and math.isnan(seconds):
            raise ValueError("timeout must be a number of seconds or None, not NaN")
        if seconds == math.inf:  # as None: no deadline (a socket cannot wait for ever by number)
            seconds = None
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def httpx_timeout(self) -> httpx.Timeout:
        left = self.remaining()
        return httpx.Timeout(None if left is None else max(left, 0.001))

    def exceeded(self, what: str, last: RnnserveError | None = None) -> DeadlineExceeded:
        limit = "no" if self.seconds is None else f"the call's {self.seconds:g} s"
        detail = f"{what} after {limit} deadline"
        if last is not None:
            detail += f"; last answer: {last}"
            return DeadlineExceeded(detail, status=last.status, type=last.type, loc=last.loc)
        return DeadlineExceeded(detail)

    def header(self) -> dict[str, str]:
        """``X-Request-Timeout: <seconds left>`` for a request sent now (none without a
        deadline), so the server drops the work once nobody waits for it."""
        left = self.remaining()
        if left is None:
            return {}
        return {TIMEOUT_HEADER: f"{max(left, 0.001):.3f}"}

    def probe(self) -> float:
        """The timeout of one readiness probe: a second at most, never past the deadline."""
        left = self.remaining()
        return 1.0 if left is None else min(1.0, max(left, 0.001))

    def check(self, what: str) -> None:
        left = self.remaining()
        if left is not None and left <= 0:
            raise self.exceeded(what)


@dataclass
class _Attempt:
    """The retry state of one call (shared by the sync and async loops)."""

    deadline: _Deadline
    retry_connection_errors: bool
    number: int = 0


class _Core:
    """Settings and every decision that does not do I/O; the two clients share it."""

    def __init__(
        self,
        *,
        timeout: float | None,
        retries: int,
        binary: BinaryMode,
        retry_posts: bool,
        max_retry_wait: float,
    ) -> None:
        if binary not in ("auto", "always", "never"):
            raise ValueError(f"binary must be 'auto', 'always' or 'never', not {binary!r}")
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.timeout = timeout
        self.retries = retries
        self.binary: BinaryMode = binary
        self.retry_posts = retry_posts
        self.max_retry_wait = max_retry_wait
        # whether the server takes the binary format: None until a binary request tells
        self.binary_ok: bool | None = {"always": True, "never": False}.get(binary)

    def deadline(self, timeout: Timeout) -> _Deadline:
        return _Deadline(self.timeout if isinstance(timeout, _UseDefault) else timeout)

    def use_binary(self, batch: _Batch) -> bool:
        if self.binary_ok is False:
            return False
        # one [sum T_i, F] tensor cannot hold sequences of different widths; JSON can, and the
        # server then says which sequence is wrong
        return len({a.shape[1] for a in batch.arrays}) == 1

    def falls_back(self, binary: bool, status: int) -> bool:
        """After a binary request: whether to resend it as JSON (and remember to). Every binary
        request refused so falls back, also one sent before another's refusal was learnt."""
        if not binary or self.binary != "auto":
            return False
        if status in FALLBACK_STATUSES:
            self.binary_ok = False
            return True
        if status < 400 and self.binary_ok is None:
            self.binary_ok = True
        return False

    def wait(self, attempt: _Attempt, error: RnnserveError) -> float:
        """Seconds to wait before retrying after ``error``; raises if no retry is left or fits."""
        if attempt.number >= self.retries:
            raise error
        if error.retry_after is not None:
            base = error.retry_after
        else:
            base = _FIRST_BACKOFF_S * 2**attempt.number
        delay = min(base, self.max_retry_wait) * (1 + random.uniform(0, _JITTER))
        left = attempt.deadline.remaining()
        if left is not None and delay >= left:
            raise attempt.deadline.exceeded(f"no time left to retry in {delay:.2f} s", error)
        attempt.number += 1
        return delay

    def transport_error(self, attempt: _Attempt, exc: httpx.TransportError) -> float:
        """Seconds to wait before retrying after a connection error; raises if not to retry."""
        if isinstance(exc, httpx.TimeoutException) and attempt.deadline.at is not None:
            raise attempt.deadline.exceeded("no answer") from exc  # httpx waited what was left
        error = ConnectionFailed(f"{type(exc).__name__}: {exc}".rstrip(": "))
        if not attempt.retry_connection_errors:
            raise error from exc
        try:
            return self.wait(attempt, error)
        except RnnserveError as final:
            raise final from exc


def _infer_headers(binary: bool, stream: bool) -> dict[str, str]:
    accept = NDJSON if stream else (f"{SAFETENSORS}, {JSON};q=0.5" if binary else JSON)
    return {"content-type": SAFETENSORS if binary else JSON, "accept": accept}


def _infer_body(field: str, batch: _Batch, model: str | None, binary: bool) -> bytes:
    if binary:
        return _encode_safetensors(field, batch.arrays, model)
    body: dict[str, Any] = {field: batch.arrays}
    if model is not None:
        body["model"] = model
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _read_answer(response: httpx.Response, out_field: str) -> list[np.ndarray]:
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == SAFETENSORS:
        return _decode_safetensors(response.content, out_field)
    return _decode_json(response.content, out_field)


def model_path(name: str) -> str:
    """The path of ``POST /models/{name}/infer``: any served model by name."""
    if not name:
        raise ValueError("infer needs a model name")
    return INFER.path.replace("{name}", quote(name, safe=""))


def read_models(response: httpx.Response) -> list[ModelInfo]:
    """The models of a ``GET /models`` answer."""
    try:
        return [ModelInfo.from_json(m) for m in orjson.loads(response.content)["models"]]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ProtocolError(f"unreadable /models answer: {exc}") from None


def stream_error(exc: httpx.TransportError, deadline: _Deadline) -> RnnserveError:
    """What a stream that broke while being read raises."""
    if isinstance(exc, httpx.TimeoutException):
        return deadline.exceeded("the stream was not done")
    return ConnectionFailed(f"the stream broke: {type(exc).__name__}: {exc}")


# -- streaming sessions (docs/SESSIONS.md) -----------------------------------------------------

#: The control message that asks a session for its state.
GET_STATE = '{"get_state": true}'
# the sessions' WebSocket client: the async source uses one, the generated client the other
AsyncWebSockets = websockets.asyncio.client
SyncWebSockets = websockets.sync.client
# close codes that name no error: the session ended normally, or the server went away
_PLAIN_CLOSES = frozenset({1000, 1001, 1012, 4408})  # 4408: idle for session_idle_timeout_s
# close codes of the protocol, as the HTTP status of the same refusal
_CLOSE_STATUSES = {1008: 401, 1009: 413, 1013: 503}


def session_url(base_url: str, name: str) -> str:
    """The WebSocket URL of model ``name``'s sessions on the server at ``base_url``."""
    if not name:
        raise ValueError("a session needs a model name")
    scheme, rest = base_url.rstrip("/").split("://", 1)
    ws = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    return f"{ws}://{rest}" + STREAM.path.replace("{name}", quote(name, safe=""))


def session_chunk(batch: _Batch, state: dict[str, Any] | None) -> str:
    """A chunk's text frame: the next piece of each sequence, and the state to continue."""
    body: dict[str, Any] = {"inputs": batch.arrays}
    if state is not None:
        body["state"] = state
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def session_answer(frame: str | bytes) -> dict[str, Any]:
    """A session's answer as JSON, or the error it says (as the HTTP call would raise)."""
    try:
        answer = orjson.loads(frame)
    except orjson.JSONDecodeError:
        raise ProtocolError("a session answer that is not JSON") from None
    if not isinstance(answer, dict):
        raise ProtocolError("a session answer that is not a JSON object")
    if "error" in answer:
        error = orjson.dumps(answer["error"])
        raise _error_from(int(answer.get("status") or 500), error, httpx.Headers())
    return answer


def session_outputs(frame: str | bytes, batch: _Batch) -> Any:
    """A chunk's outputs, in the form of its inputs."""
    answer = session_answer(frame)
    try:
        outs = [np.asarray(o, dtype=np.float32) for o in answer["outputs"]]
    except (KeyError, TypeError, ValueError):
        raise ProtocolError("a session answer without outputs") from None
    return batch.outputs(outs)


def session_state(frame: str | bytes) -> dict[str, Any] | None:
    state = session_answer(frame).get("state")
    if state is not None and not isinstance(state, dict):
        raise ProtocolError("a session state that is not a JSON object")
    return state


def session_closed(exc: ConnectionClosed) -> RnnserveError:
    """What a call on a session the server closed raises: the error its close code and reason
    say (``Overloaded`` for too many sessions, ``BadRequest`` for a missing token or too large
    a chunk, ``ModelNotFound``...), else ``ConnectionFailed``."""
    closed = exc.rcvd
    if closed is None or closed.code in _PLAIN_CLOSES:
        return ConnectionFailed(f"the session was closed: {exc}")
    status = _CLOSE_STATUSES.get(closed.code)
    if status is None:
        status = closed.code - 4000 if 4000 <= closed.code < 5000 else 500
    return _error_from(status, closed.reason.encode(), httpx.Headers())


# the clients' two ways to wait: the async source calls sleep_async, the generated client sleep


async def sleep_async(seconds: float) -> None:
    await anyio.sleep(seconds)


def sleep(seconds: float) -> None:
    time.sleep(seconds)
