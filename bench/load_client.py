"""The load generator's HTTP client: kept-alive connections that write each request whole
and read the answer with httptools, so the client costs little CPU beside the server it
measures; aiohttp only for ``/metrics`` and the binary probe."""

from __future__ import annotations

import asyncio
import ipaddress
from urllib.parse import urlsplit

import aiohttp
import httptools

from bench.load_workloads import Body


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash, if it is ``http://`` to a loopback host; else ValueError.

    The generator is for benchmarking one's own machine: it refuses to load anything else.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "http":
        raise ValueError(f"{url!r}: only http:// URLs are supported")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"{url!r}: refusing to load a non-loopback host ({host!r})")
    return url.rstrip("/")


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection: sends a request and reads its answer (llhttp parses
    it; its status is kept, its body's bytes are read and dropped)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[int] | None = None
        self.reusable = True

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"not an HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(ConnectionError("the server closed the connection"))

    # httptools' callback (no on_body: llhttp then skips the body's bytes, by its length)
    def on_message_complete(self) -> None:
        self.reusable = self.reusable and self.parser.should_keep_alive()
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(self.parser.get_status_code())
        self.answer = None

    def _fail(self, exc: Exception) -> None:
        self.reusable = False
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)
        self.answer = None
        if self.transport is not None:
            self.transport.close()

    def send(self, request: bytes) -> asyncio.Future[int]:
        """Write one request; the future is its answer's status."""
        assert self.transport is not None
        assert self.answer is None
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.answer

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class _Client:
    """The connections of one load run: an idle one is reused, else a new one opened (the loops
    bound how many requests are in flight, so how many connections there are)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(loopback_url(url))
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._host_header = f"{self.host}:{self.port}"
        self._idle: list[_Connection] = []
        self._requests: dict[tuple[str, int], tuple[Body, bytes]] = {}

    def request(self, path: str, body: Body) -> bytes:
        """The whole request, head and body, built once per path and body (one write, nothing
        joined per request)."""
        key = (path, id(body))
        built = self._requests.get(key)
        if built is None or built[0] is not body:
            lines = [f"POST {path} HTTP/1.1", f"Host: {self._host_header}"]
            lines += [f"{k}: {v}" for k, v in body.headers.items()]
            lines.append(f"Content-Length: {len(body.data)}")
            head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            built = self._requests[key] = (body, head + body.data)
        return built[1]

    async def post(self, path: str, body: Body, timeout_s: float) -> str:
        """POST ``body``; the answer's status ("200", "503"...), "timeout" or "connection"."""
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(timeout_s):
                conn = self._idle_connection()
                if conn is None:
                    _, conn = await asyncio.get_running_loop().create_connection(
                        _Connection, self.host, self.port
                    )
                status = await conn.send(self.request(path, body))
        except TimeoutError:
            if conn is not None:
                conn.close()  # its answer may still come: the connection cannot be reused
            return "timeout"
        except (OSError, ConnectionError):
            return "connection"
        if conn.reusable:
            self._idle.append(conn)
        else:
            conn.close()
        return str(status)

    def _idle_connection(self) -> _Connection | None:
        """The most recently used idle connection that the server has not closed meanwhile
        (a server closes a connection left idle past its keep-alive time)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable:
                return conn
        return None

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def _session(url: str, timeout_s: float) -> aiohttp.ClientSession:
    """aiohttp for /metrics and the binary probe (the load itself goes through _Client)."""
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    return aiohttp.ClientSession(loopback_url(url), connector=connector, timeout=timeout)
