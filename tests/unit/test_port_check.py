"""``rnnserve`` says at once that its port is taken, before any model loads."""

from __future__ import annotations

import socket

import pytest

from rnnserve.service.cli import check_port
from rnnserve.service.interface import StartupError


def test_a_port_another_server_listens_on_is_refused_with_one_line() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(StartupError) as err:
            check_port("127.0.0.1", port)
    message = str(err.value)
    assert f"cannot listen on 127.0.0.1:{port}" in message
    assert "--port" in message
    assert "\n" not in message
    check_port("127.0.0.1", port)  # free again: the check leaves nothing bound


def test_any_free_port_and_a_free_one_pass() -> None:
    check_port("127.0.0.1", 0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_port("127.0.0.1", port)


def test_a_host_that_does_not_resolve_is_named() -> None:
    with pytest.raises(StartupError, match=r"host .no-such-host\.invalid. cannot be resolved"):
        check_port("no-such-host.invalid", 8000)
