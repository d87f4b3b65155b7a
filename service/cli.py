"""The ``rnnserve`` command: settings from flags and ``RNNSERVE_*``, then uvicorn.

With ``--workers 1`` (the default) one process serves HTTP and runs the models. With
``--workers N`` (N >= 2) this process supervises: it starts the engine process (the models,
:mod:`rnnserve.service.engine.process`), waits until the models are warm, then runs N uvicorn HTTP
workers (:func:`rnnserve.service.http.app.create_worker_app`) that reach the engine over a Unix
socket; the socket and the Prometheus multiprocess folder live in a private temporary folder (mode
0700), removed at exit. SIGTERM: uvicorn stops the workers, which finish their requests first; then
the engine drains and exits. If the engine dies, the workers answer 503 and the server shuts down
with exit status 1, for the orchestrator to restart it. If this process dies (``kill -9``), the
engine and the workers get SIGTERM and stop as on a shutdown, so the port is free for the next
server (:mod:`rnnserve.service.lifeline`).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import math
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

import uvicorn
from pydantic import SecretStr, ValidationError
from pydantic_settings import CliSettingsSource
from uvicorn.supervisors import Multiprocess

from rnnserve.service import tracing
from rnnserve.service.config import Settings, package_version, unknown_environment
from rnnserve.service.http.app import ENGINE_SOCKET_ENV, create_app, create_worker_app
from rnnserve.service.http.protocol import HeaderTimeoutProtocol
from rnnserve.service.http.ws_protocol import SessionWebSocketProtocol
from rnnserve.service.interface import StartupError
from rnnserve.service.lifeline import die_with_parent
from rnnserve.service.logs import configure_logging, settings_line, uvicorn_log_config

log = logging.getLogger("rnnserve")


# ``rnnserve <command> ...``: the user's tools, as subcommands so that they run from any folder
# (``python -m models.export`` would find the user's own ``models`` package first)
COMMANDS = {
    "export": "export your own LSTM/GRU or TorchScript model for rnnserve",
    "train": "train a smoother or traveller on synthetic data into a folder rnnserve serves",
}


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        sys.exit(run_command(args[0], args[1:]))
    try:
        settings = parse_settings(args)
    except ValidationError as exc:
        sys.exit(f"rnnserve: {_setting_error(exc)}")
    configure_logging(settings)
    for warning in unknown_environment(os.environ):
        log.warning("%s", warning)
    try:
        check_port(settings.host, settings.port)
        tracing.check_environment()  # the OTEL_* variables ask for what rnnserve ships
        names = _preflight(settings)  # fail closed, with one line, before the port opens
        check_defaults(settings, names)
    except StartupError as exc:
        log.debug("start-up check failed", exc_info=True)
        sys.exit(f"rnnserve: {exc}")
    log.info("rnnserve %s; %s", package_version(), settings_line(settings))
    if settings.workers > 1:
        sys.exit(serve_with_workers(settings))
    app = create_app(settings)
    reload_on_hangup(app.state.runtime.reload_soon)
    uvicorn.run(app, **uvicorn_options(settings))


def reload_on_hangup(reload_soon: Callable[[str], None]) -> None:
    """SIGHUP reloads the model directory instead of ending the server (uvicorn handles only
    SIGINT and SIGTERM in a single process)."""
    signal.signal(signal.SIGHUP, lambda *_: reload_soon("SIGHUP"))


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What uvicorn is told in both process modes: where to listen, logs, the drain, and
    rnnserve's protocol with its limits."""
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "log_config": uvicorn_log_config(settings),
        "access_log": settings.access_log,
        "timeout_graceful_shutdown": math.ceil(settings.drain_timeout_s),
        "http": HeaderTimeoutProtocol,
        "limit_concurrency": settings.limit_concurrency,
        "h11_max_incomplete_event_size": settings.max_request_head_bytes,
        # a session's frame is held to its limit, refused from its header with the session's
        # own close reason (ws_protocol)
        "ws": SessionWebSocketProtocol,
        "ws_max_size": settings.max_chunk_bytes,
    }


def check_port(host: str, port: int) -> None:
    """Fail at once, with one line, when the port cannot be bound: uvicorn would find out only
    after every model has loaded and warmed up."""
    if port == 0:  # any free port: nothing to check
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(
            f"host {host!r} cannot be resolved ({exc.strerror}); see --host"
        ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            raise StartupError(
                f"cannot listen on {host}:{port}: {exc.strerror}; is another server running "
                "there? choose another port with --port"
            ) from None


def run_command(name: str, args: list[str]) -> int:
    """Run the subcommand ``name`` (a key of :data:`COMMANDS`); its exit status."""
    if name == "export":
        from rnnserve.models import export

        return export.main(args)
    if name == "train":
        from rnnserve.models import train

        return train.main(args, prog="rnnserve train")
    raise KeyError(name)


# The supervisor imports torch and the models only in these functions, never at the top: uvicorn
# spawns each HTTP worker by re-importing the console script's module, which imports this one.
def _preflight(settings: Settings) -> list[str]:
    from rnnserve.service.engine.runtime import preflight

    return preflight(settings)


def _engine_main() -> Any:
    from rnnserve.service.engine import process

    return process.run


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Unset options' help says what unset means; pydantic-settings' "(default: null)" goes."""

    def _expand_help(self, action: argparse.Action) -> str:
        return super()._expand_help(action).replace(" (default: null)", "")


def parse_settings(args: Sequence[str]) -> Settings:
    """Settings from ``RNNSERVE_*`` and the flags in ``args`` (``--help``, ``--version`` exit)."""
    parser = argparse.ArgumentParser(
        prog="rnnserve",
        description=inspect.cleandoc(Settings.__doc__ or ""),
        epilog="commands (rnnserve COMMAND --help):\n"
        + "\n".join(f"  {name:<10}{what}" for name, what in COMMANDS.items()),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rnnserve {package_version()}")
    source: CliSettingsSource[Settings] = CliSettingsSource(Settings, root_parser=parser)
    return Settings(_cli_settings_source=source(args=list(args)))


def check_defaults(settings: Settings, names: Sequence[str]) -> None:
    """A configured default model must be served and of its endpoint's kind."""
    from rnnserve import models

    for kind, name in (
        ("smoother", settings.default_smoother),
        ("traveller", settings.default_traveller),
    ):
        if name is None:
            continue
        flag = f"--default-{kind}"
        if name not in names:
            raise StartupError(f"{flag} {name}: no such model (served: {', '.join(names)})")
        try:
            module = models.read(
                name, settings.model_dir, trust_torchscript=settings.trust_torchscript
            )
            found = models.kind_of(module)
        except (models.ModelLoadError, models.ModelNotFound) as exc:
            raise StartupError(str(exc)) from exc
        if found != kind:
            raise StartupError(f"{flag} {name}: '{name}' is a {found} model, not a {kind}")


def serve_with_workers(settings: Settings) -> int:
    """Run the engine process and ``settings.workers`` HTTP workers; the exit status."""
    private = tempfile.mkdtemp(prefix="rnnserve-")  # mode 0700: only this user reaches in
    try:
        socket_path = os.path.join(private, "engine.sock")
        metrics_dir = os.path.join(private, "metrics")
        os.mkdir(metrics_dir, 0o700)  # new, so empty: no stale values from an earlier run
        # inherited by the engine and the workers (spawned, so they import prometheus_client
        # after this is set: it picks multiprocess mode at import)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        os.environ[ENGINE_SOCKET_ENV] = socket_path
        os.environ.update(settings_environment(settings))
        for name in Settings.model_fields:
            if getattr(settings, name) is None:
                os.environ.pop(f"RNNSERVE_{name.upper()}", None)
        return _supervise(settings, socket_path)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def settings_environment(settings: Settings) -> dict[str, str]:
    """``RNNSERVE_*`` variables that rebuild ``settings`` in another process."""
    env = {}
    for name, value in settings.model_dump().items():
        if isinstance(value, SecretStr):
            env[f"RNNSERVE_{name.upper()}"] = value.get_secret_value()
        elif value is not None:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            env[f"RNNSERVE_{name.upper()}"] = text
    return env


def _supervise(settings: Settings, socket_path: str) -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the models are loading: the files as they are
    spawn = multiprocessing.get_context("spawn")
    ready_recv, ready_send = spawn.Pipe(duplex=False)
    proc = spawn.Process(
        target=_engine_main(), args=(settings, socket_path, ready_send), name="rnnserve-engine"
    )
    proc.start()
    ready_send.close()
    # loading and warming the models (the engine's exit while doing so ends the wait too)
    wait([ready_recv, proc.sentinel])
    try:
        pid = ready_recv.recv()
    except EOFError:
        proc.join()
        log.error("the engine process failed to start (exit status %s)", proc.exitcode)
        return 1
    log.info("engine process %d ready; starting %d HTTP workers", pid, settings.workers)
    stopping = threading.Event()
    died = threading.Event()

    def watch_engine() -> None:
        wait([proc.sentinel])
        if not stopping.is_set():
            died.set()
            log.error("the engine process died (exit status %s); shutting down", proc.exitcode)
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's supervisor stops the workers

    threading.Thread(target=watch_engine, name="rnnserve-engine-watch", daemon=True).start()
    try:
        _run_workers(settings, pid)
    finally:
        # the workers have finished their requests and gone: now the engine drains
        stopping.set()
        if proc.is_alive():
            proc.terminate()
        proc.join(settings.drain_timeout_s + 10)
        if proc.is_alive():
            log.error("the engine did not stop in time; killing it")
            proc.kill()
            proc.join()
    return 1 if died.is_set() or proc.exitcode else 0


class _Supervisor(Multiprocess):
    """uvicorn's supervisor of the HTTP workers, except that SIGHUP goes to the engine, which
    reloads the model directory and tells the workers the new model list (uvicorn's own SIGHUP
    would restart the workers and leave the models as they are)."""

    engine_pid = 0

    def handle_hup(self) -> None:
        log.info("SIGHUP: the engine process %d reloads the model directory", self.engine_pid)
        os.kill(self.engine_pid, signal.SIGHUP)


def _run_workers(settings: Settings, engine_pid: int) -> None:
    """What ``uvicorn.run(..., workers=N)`` does, with :class:`_Supervisor` as the supervisor."""
    config = uvicorn.Config(
        "rnnserve.service.cli:worker_app",
        factory=True,
        workers=settings.workers,
        **uvicorn_options(settings),
        **_worker_healthcheck(),
    )
    sockets = [config.bind_socket()]
    if "target" in inspect.signature(Multiprocess.__init__).parameters:  # older uvicorn
        supervisor = _Supervisor(config, target=uvicorn.Server(config).run, sockets=sockets)  # type: ignore[call-arg]
    else:
        supervisor = _Supervisor(config, sockets=sockets)
    supervisor.engine_pid = engine_pid
    with contextlib.suppress(KeyboardInterrupt):
        supervisor.run()


def worker_app() -> Any:
    """uvicorn's app factory in each HTTP worker: the worker's app, in a process that stops when
    this supervisor dies, even by ``kill -9`` (:mod:`rnnserve.service.lifeline`)."""
    die_with_parent()
    return create_worker_app()


# uvicorn's supervisor pings each worker and kills one that does not answer in time (5 s by
# default). Workers starting up (importing torch and the app) on a busy host went unanswered
# for longer than that (the e2e tests saw it while other jobs shared the cores), and were
# killed and restarted until the start gave up. Long enough for that; a hung worker is still
# replaced.
WORKER_HEALTHCHECK_S = 60


def _worker_healthcheck() -> dict[str, Any]:
    """``timeout_worker_healthcheck`` where uvicorn has it (0.37 and later)."""
    if "timeout_worker_healthcheck" in inspect.signature(uvicorn.run).parameters:
        return {"timeout_worker_healthcheck": WORKER_HEALTHCHECK_S}
    return {}


def _setting_error(exc: ValidationError) -> str:
    """``--max-batch-size / RNNSERVE_MAX_BATCH_SIZE: Input should be ... (got 0)``."""
    err = exc.errors(include_url=False)[0]
    name = str(err["loc"][0]) if err["loc"] else ""
    if name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        where = f"{flag} / RNNSERVE_{name.upper()}"
    else:
        where = f"unknown setting {name!r}" if name else "settings"
    msg = str(err["msg"]).removeprefix("Value error, ")
    got = (
        f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
    )
    return f"{where}: {msg}{got}"


if __name__ == "__main__":
    main()
