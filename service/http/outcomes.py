"""How a request can end without an answer anyone reads: the client left, or its deadline
passed. Raised by the steps of a request (reading its body, awaiting its model) and answered
by :func:`rnnserve.service.http.inference.serve_request`."""

from __future__ import annotations


class ClientGone(Exception):
    """The client closed the connection before its answer was ready (also while its body was
    still arriving: a hang-up, or a chunked body that broke off)."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its answer was ready."""
