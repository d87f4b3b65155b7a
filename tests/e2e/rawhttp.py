"""HTTP/1.1 by hand over a socket, for what clients libraries will not do: trickle header bytes,
send a body in pieces, hold a connection half-sent."""

from __future__ import annotations

import socket
import weakref
from urllib.parse import urlsplit

# bytes read from a socket past the end of the response asked for: the start of the next one,
# when the server's answers to pipelined requests arrive in one read
_unread: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def connect(url: str, timeout_s: float = 30.0) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The next response on ``sock`` (status, lower-case headers, body by Content-Length).
    Raises ``ConnectionError`` if the server closes the connection before a whole response."""
    data = _unread.pop(sock, b"")
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError(f"closed after {len(data)} bytes of a response")
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, val = line.partition(":")
        headers[name.strip().lower()] = val.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("closed inside a response body")
        body += got
    if len(body) > length:
        _unread[sock] = body[length:]
    return status, headers, body[:length]


def get(sock: socket.socket, path: str) -> tuple[int, dict[str, str], bytes]:
    sock.sendall(f"GET {path} HTTP/1.1\r\nhost: test\r\n\r\n".encode())
    return read_response(sock)


def post_head(path: str, length: int, extra: str = "") -> bytes:
    """The request line and headers of a JSON POST whose body has ``length`` bytes."""
    return (
        f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n{extra}\r\n"
    ).encode()


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (reads whatever it sent first, e.g. a 408)."""
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True
