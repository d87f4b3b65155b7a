# Generated from rnnserve/_async_client.py by `python scripts/unasync.py`; edit that file and rerun.
# `python scripts/unasync.py --check` fails while this file is out of date.
"""The client's I/O, written once with async/await in ``rnnserve/_async_client.py``
(:class:`AsyncClient`, :class:`AsyncRolloutStream`); ``scripts/unasync.py`` takes the
``async``/``await`` out to make ``rnnserve/_sync_client.py`` (:class:`Client`,
:class:`RolloutStream`). Everything without I/O lives in :mod:`rnnserve._core`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from types import TracebackType
from typing import Any

import httpx
from websockets.exceptions import ConnectionClosed

from rnnserve._core import (
    GET_STATE,
    RETRY_STATUSES,
    USE_DEFAULT,
    BinaryMode,
    Chunk,
    ConnectionFailed,
    ModelInfo,
    ProtocolError,
    Timeout,
    _as_batch,
    _Attempt,
    _Batch,
    _Core,
    _Deadline,
    _decode_line,
    _error_from,
    _infer_body,
    _infer_headers,
    _read_answer,
    model_path,
    read_models,
    session_chunk,
    session_closed,
    session_outputs,
    session_state,
    session_url,
    sleep,
    stream_error,
)
from rnnserve._core import SyncWebSockets as websocket_client
from rnnserve.service.endpoints import INFER, ROLLOUT, SMOOTH, Endpoint


class Client:
    """An rnnserve client (:class:`AsyncClient`: its methods are coroutines; :class:`Client`: the
    same methods, blocking).

    ``timeout``: the default deadline of each call in seconds, retries and waits included
    (``None``: none); every method takes its own ``timeout=``. ``retries``: how many times a
    429/503 answer (and a failed connection, for GETs or with ``retry_posts=True``) is retried,
    after ``Retry-After`` (capped at ``max_retry_wait``, plus up to 20 % jitter).
    ``binary``: ``"auto"`` sends the safetensors format and falls back to JSON for good if the
    server refuses it (400/415); ``"always"``/``"never"`` force it. ``transport``: an
    ``httpx.BaseTransport`` for the Client, an ``httpx.AsyncBaseTransport`` (e.g.
    ``httpx.ASGITransport(app)``) for the AsyncClient. ``http_client`` replaces the httpx client
    the client would make (an ``httpx.Client``, or ``httpx.AsyncClient``; its own base URL,
    transport and settings then apply).
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float | None = 30.0,
        retries: int = 3,
        binary: BinaryMode = "auto",
        retry_posts: bool = False,
        max_retry_wait: float = 10.0,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        self._core = _Core(
            timeout=timeout,
            retries=retries,
            binary=binary,
            retry_posts=retry_posts,
            max_retry_wait=max_retry_wait,
        )
        self._http = http_client or httpx.Client(
            base_url=base_url, headers=headers, transport=transport, timeout=None
        )

    @property
    def base_url(self) -> str:
        return str(self._http.base_url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r}, binary={self._core.binary!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections (the client cannot be used afterwards)."""
        self._http.close()

    # the endpoints

    def smooth(
        self,
        sequences: Any,
        model: str | None = None,
        *,
        timeout: Timeout = USE_DEFAULT,
    ) -> Any:
        """Smooth one ``[T, F]`` sequence or several; the outputs mirror the input (module doc)."""
        return self._infer(SMOOTH, SMOOTH.path, sequences, model, timeout)

    def rollout(
        self,
        inputs: Any,
        model: str | None = None,
        *,
        timeout: Timeout = USE_DEFAULT,
    ) -> Any:
        """Roll the Traveller out over one ``[T, num_inputs]`` sequence or several: ``[T, 2]``."""
        return self._infer(ROLLOUT, ROLLOUT.path, inputs, model, timeout)

    def infer(
        self,
        name: str,
        inputs: Any,
        *,
        timeout: Timeout = USE_DEFAULT,
    ) -> Any:
        """Run model ``name`` (any kind: your own ``recurrent`` or ``torchscript`` model too) over
        one ``[T, F_in]`` sequence or several (``POST /models/{name}/infer``); ``[T, F_out]``."""
        return self._infer(INFER, model_path(name), inputs, None, timeout)

    def stream_rollout(
        self,
        inputs: Any,
        model: str | None = None,
        *,
        timeout: Timeout = USE_DEFAULT,
    ) -> RolloutStream:
        """The rollout as the server streams it: ``(sequence, start_step, positions)`` chunks
        (``async for`` them from the AsyncClient, ``for`` from the Client).

        The request is sent when iteration starts. Close the stream (``with`` block, ``close()``;
        ``async with``, ``aclose()``) to stop early: the connection closes and the server drops
        the rollout. ``timeout`` covers the whole stream.
        """
        return RolloutStream(self, _as_batch(inputs), model, timeout)

    def session(self, name: str, *, state: dict[str, Any] | None = None) -> Session:
        """A streaming session to model ``name`` (docs/SESSIONS.md), to use as a context
        manager: each ``send`` of the next piece of each sequence answers its outputs, the
        server carrying the state between pieces; ``get_state()`` gives that state, which
        ``state=`` continues in a new session (on any server). The client's bearer token is
        sent at the handshake; ``timeout`` bounds the opening."""
        token = self._http.headers.get("authorization")
        headers = {"Authorization": token} if token else {}
        return Session(session_url(self.base_url, name), headers, state, self._core.timeout)

    def models(self, *, timeout: Timeout = USE_DEFAULT) -> list[ModelInfo]:
        """The served models (``GET /models``)."""
        response = self._send("GET", "/models", None, {}, self._attempt(timeout, get=True))
        self._raise_for(response)
        return read_models(response)

    def ready(self, *, timeout: Timeout = USE_DEFAULT) -> bool:
        """Whether the server is ready for traffic: one ``GET /readyz``, no retries."""
        deadline = self._core.deadline(timeout)
        try:
            response = self._http.get("/readyz", timeout=deadline.httpx_timeout())
        except httpx.TransportError:
            return False
        return response.status_code == 200

    def wait_ready(self, timeout: float | None = 60.0, interval: float = 0.1) -> None:
        """Poll ``/readyz`` until the server is ready; else :class:`DeadlineExceeded`."""
        deadline = _Deadline(timeout)
        while not self.ready(timeout=deadline.probe()):
            left = deadline.remaining()
            if left is not None and left <= interval:
                raise deadline.exceeded(f"{self.base_url} not ready")
            sleep(interval)

    # plumbing

    def _attempt(self, timeout: Timeout, *, get: bool) -> _Attempt:
        return _Attempt(self._core.deadline(timeout), get or self._core.retry_posts)

    def _infer(
        self,
        endpoint: Endpoint,
        path: str,
        inputs: Any,
        model: str | None,
        timeout: Timeout,
    ) -> Any:
        batch = _as_batch(inputs)
        attempt = self._attempt(timeout, get=False)
        while True:
            binary = self._core.use_binary(batch)
            body = _infer_body(endpoint.input_field, batch, model, binary)
            headers = _infer_headers(binary, stream=False)
            response = self._send("POST", path, body, headers, attempt)
            if self._core.falls_back(binary, response.status_code):
                continue
            self._raise_for(response)
            return batch.outputs(_read_answer(response, endpoint.output_field))

    def _send(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        attempt: _Attempt,
        stream: bool = False,
    ) -> httpx.Response:
        """One request with the retries its answers allow; any answer but 429/503 returns."""
        while True:
            attempt.deadline.check("no answer")
            timeout = attempt.deadline.httpx_timeout()
            sent = {**headers, **attempt.deadline.header()}  # what is left now, at each retry
            request = self._http.build_request(
                method, path, content=body, headers=sent, timeout=timeout
            )
            try:
                response = self._http.send(request, stream=True)
                if not stream:
                    response = _read_within(response, attempt.deadline)
            except httpx.TransportError as exc:
                sleep(self._core.transport_error(attempt, exc))
                continue
            if response.status_code not in RETRY_STATUSES:
                return response
            response.read()
            response.close()
            error = _error_from(response.status_code, response.content, response.headers)
            sleep(self._core.wait(attempt, error))

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.status_code >= 400:
            response.read()
            response.close()
            raise _error_from(response.status_code, response.content, response.headers)


def _read_within(response: httpx.Response, deadline: _Deadline) -> httpx.Response:
    """``response`` read whole, its deadline checked as each piece arrives: httpx's timeout
    bounds each read, not their sum, so an answer sent a few bytes at a time would outlast it."""
    if response.is_stream_consumed:  # a transport that hands its answers over read
        return response
    pieces = []
    try:
        for piece in response.iter_raw():
            pieces.append(piece)
            deadline.check("the answer did not arrive whole")
    finally:
        response.close()
    # the raw bytes, decoded by the new response as the old one would have (Content-Encoding)
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        content=b"".join(pieces),
        request=response.request,
    )


class RolloutStream:
    """Iterator of ``(sequence, start_step, positions)`` chunks of a streamed rollout (an async
    iterator for the AsyncClient).

    A context manager; ``close()`` (``aclose()`` for the AsyncClient's), or leaving the ``with``
    block, before the end closes the connection and the server drops the rollout. ``model`` is
    the model's name once done.
    """

    def __init__(
        self,
        client: Client,
        batch: _Batch,
        model: str | None,
        timeout: Timeout,
    ) -> None:
        self._client, self._batch, self._name = client, batch, model
        # the deadline counts from the request, sent when iteration starts
        self._timeout = timeout
        self._deadline = _Deadline(None)
        self.model: str | None = None
        self._chunks = self._generate()

    def __iter__(self) -> RolloutStream:
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def __enter__(self) -> RolloutStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop: closes the connection if the stream is still open."""
        self._chunks.close()

    def _open(self) -> httpx.Response:
        """The streamed answer, resent as JSON if the server refuses the binary format."""
        client, core = self._client, self._client._core
        self._deadline = core.deadline(self._timeout)
        attempt = _Attempt(self._deadline, core.retry_posts)
        while True:
            binary = core.use_binary(self._batch)
            body = _infer_body(ROLLOUT.input_field, self._batch, self._name, binary)
            headers = _infer_headers(binary, stream=True)
            response = client._send("POST", ROLLOUT.path, body, headers, attempt, stream=True)
            if response.status_code >= 400:
                response.read()
                response.close()
            if not core.falls_back(binary, response.status_code):
                return response

    def _generate(self) -> Generator[Chunk, None]:
        response = self._open()
        try:
            self._client._raise_for(response)
            for line in response.iter_lines():
                if not line.strip():
                    continue
                item = _decode_line(line, self._batch)
                if isinstance(item, str):
                    self.model = item
                    return
                self._deadline.check("the stream was not done")
                yield item
            raise ProtocolError("the stream ended before its closing line")
        except httpx.TransportError as exc:
            raise stream_error(exc, self._deadline) from exc
        finally:
            response.close()


class Session:
    """A streaming session (:meth:`AsyncClient.session`); one WebSocket, opened on entry.

    Every ``send`` holds one piece of each of the session's sequences (their count is fixed by
    the first), in the forms the other calls take, and answers the outputs in the same form.
    An error answer raises as the HTTP call would (``BadRequest``...) and leaves the session
    open and its state as before; a session the server closed raises the error its close code
    says (``Overloaded`` when the server has ``max_sessions`` open)."""

    def __init__(
        self, url: str, headers: dict[str, str], state: dict[str, Any] | None, timeout: float | None
    ) -> None:
        self.url = url
        self._headers, self._timeout = headers, timeout
        self._opener: Any = None  # the connection is opened on entry, not before
        self._ws: websocket_client.ClientConnection | None = None
        self._state = state  # sent with the first chunk, until one is answered
        # an exchange was interrupted (cancelled, a timeout around it) before its answer came:
        # that answer would be read as the next one's, so the session cannot go on
        self._interrupted = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __enter__(self) -> Session:
        try:
            self._opener = websocket_client.connect(
                self.url, additional_headers=self._headers, open_timeout=self._timeout,
                max_size=None,
            )  # fmt: skip
            self._ws = self._opener.__enter__()
        except (OSError, TimeoutError) as exc:
            raise ConnectionFailed(f"cannot open a session at {self.url}: {exc}") from None
        except Exception as exc:  # websockets' handshake errors: an HTTP answer, not a session
            raise ConnectionFailed(f"the server refused a session at {self.url}: {exc}") from None
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the session (its state is gone with it: ask ``get_state()`` first)."""
        if self._ws is not None:
            self._ws = None
            self._opener.__exit__(None, None, None)

    def send(self, inputs: Any) -> Any:
        """The outputs of the next piece of each sequence (one ``[T, F]`` array for a session
        of one sequence, a list of them, or an ``[N, T, F]`` array)."""
        batch = _as_batch(inputs)
        answer = self._exchange(session_chunk(batch, self._state))
        outputs = session_outputs(answer, batch)
        self._state = None
        return outputs

    def get_state(self) -> dict[str, Any] | None:
        """The state after the last piece (``None`` before the first), as ``state=`` takes it."""
        if self._state is not None:  # not sent yet: it is still the state
            return self._state
        return session_state(self._exchange(GET_STATE))

    def _exchange(self, message: str) -> str | bytes:
        if self._ws is None:
            raise RuntimeError("the session is not open: use it as a context manager")
        if self._interrupted:
            raise ConnectionFailed(
                "an earlier call on this session was interrupted before its answer came; its "
                "answer would be taken for this one's: open a new session"
            )
        self._interrupted = True  # until the answer is read
        try:
            self._ws.send(message)
            answer = self._ws.recv()
        except ConnectionClosed as exc:
            raise session_closed(exc) from None
        self._interrupted = False
        return answer
