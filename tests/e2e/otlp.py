"""A tiny OTLP/HTTP trace receiver in the test process: what a collector would get."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def value(v: AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def attributes(pairs: Any) -> dict[str, Any]:
    """OTLP key-value pairs as a dict."""
    return {kv.key: value(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


@dataclass
class Received:
    """One span as exported, with its resource's attributes."""

    span: Span
    resource: dict[str, Any]

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attributes(self) -> dict[str, Any]:
        return attributes(self.span.attributes)


@dataclass
class Receiver:
    """Collects every span POSTed to ``url``/v1/traces (protobuf, optionally gzipped)."""

    spans: list[Received] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    def __enter__(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.add(self.path, body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, path: str, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        self.paths.append(path)
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(Received(s, resource) for s in scope_spans.spans)
