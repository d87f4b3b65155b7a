"""The engine process of ``rnnserve --workers N``: the models, served to the HTTP workers.

It runs the same :class:`~rnnserve.service.engine.runtime.ModelRuntime` a single-process server runs
(batchers, continuous scheduler, one worker thread per model), so requests from every HTTP worker
meet in the same batches; :class:`~rnnserve.service.ipc.engine_side.EngineServer` serves it on a
Unix domain socket in a private folder. Its batch and queue metrics go to the shared Prometheus
multiprocess folder, where any worker's ``/metrics`` reads them.

It traces its batches as a single-process server does, from the same ``OTEL_*`` variables the
workers read: a request frame carries the worker's span as a W3C ``traceparent``, which the
request's task continues, so each ``batch <model>`` span links to its requests' spans in the
workers (:mod:`rnnserve.service.engine.tracing`).

Shutdown: the ``rnnserve`` parent sends SIGTERM once the HTTP workers have finished their
requests and gone. On SIGTERM the engine waits for the workers still connected (up to
``drain_timeout_s``), then drains its batchers and exits. SIGINT (Ctrl-C reaches the whole
process group) is left to the parent. If the parent dies, the engine gets SIGTERM from the kernel
(Linux) and also sees it in its own poll of the parent's pid, and stops the same way.

SIGHUP (the parent passes its own on) reloads the model directory
(:meth:`~rnnserve.service.engine.runtime.ModelRuntime.reload`); the workers learn the new model
list from the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from rnnserve.service import tracing
from rnnserve.service.config import Settings, package_version
from rnnserve.service.engine.runtime import ModelRuntime
from rnnserve.service.ipc.engine_side import EngineServer
from rnnserve.service.lifeline import parent_death_signal, parent_pid
from rnnserve.service.logs import configure_logging, log_models
from rnnserve.service.memory import settle_garbage_collector
from rnnserve.service.metrics import Metrics

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("rnnserve.engine")

PARENT_POLL_S = 1.0


def run(settings: Settings, socket_path: str, ready: Connection) -> None:
    """Process entry point: load and warm the models, serve them, send our pid on ``ready``."""
    configure_logging(settings)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload, once serving; never the end
    parent_death_signal(signal.SIGTERM)  # at once when the parent dies; serve() also polls it
    try:
        import uvloop  # with uvicorn[standard]; the workers run on it too

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(settings, socket_path, ready))
    except Exception:
        log.exception("the engine failed")
        sys.exit(1)


async def serve(settings: Settings, socket_path: str, ready: Connection | None = None) -> None:
    """Serve until SIGTERM (or the parent's death), then drain and return."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    provider = start_tracing()
    try:
        await _serve(settings, socket_path, ready, stop)
    finally:
        if provider is not None:
            provider.shutdown()  # sends the spans it still holds
            tracing.use(None)


def start_tracing() -> TracerProvider | None:
    """Trace the batches as the ``OTEL_*`` variables say (the HTTP workers read the same);
    the provider, to shut down at the end; ``None``: tracing is off."""
    provider = tracing.provider_from_environment(package_version())
    if provider is not None:
        tracing.use(provider.get_tracer(tracing.INSTRUMENTATION, package_version()))
    return provider


async def _serve(
    settings: Settings, socket_path: str, ready: Connection | None, stop: asyncio.Event
) -> None:
    loop = asyncio.get_running_loop()
    runtime = ModelRuntime(settings, Metrics(multiprocess=True))
    await runtime.start()
    log_models(runtime.models, log)
    server = EngineServer(runtime, socket_path, settings.models_ack_timeout_s)
    await server.start()
    runtime.on_models_changed(server.announce_models)
    loop.add_signal_handler(signal.SIGHUP, runtime.reload_soon, "SIGHUP")
    settle_garbage_collector()
    log.info("engine (pid %d) serving on %s", os.getpid(), socket_path)
    if ready is not None:
        ready.send(os.getpid())
        ready.close()
    orphaned = asyncio.ensure_future(_parent_gone(parent_pid()))
    orphaned.add_done_callback(lambda _: stop.set())
    try:
        await stop.wait()
    finally:
        orphaned.cancel()
        log.info("engine draining: %d worker connection(s) open", server.connections)
        if not await server.wait_idle(settings.drain_timeout_s):
            log.warning("workers still connected after %.0f s", settings.drain_timeout_s)
        await runtime.stop()
        await server.close()
        log.info("engine stopped")


async def _parent_gone(parent: int) -> None:
    while os.getppid() == parent:  # noqa: ASYNC110 (no event to wait on: poll the parent)
        await asyncio.sleep(PARENT_POLL_S)
    log.error("the rnnserve parent process is gone; stopping")
