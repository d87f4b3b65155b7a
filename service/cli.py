"""The ``rnnserve`` command: settings from flags and ``RNNSERVE_*``, then uvicorn."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence

import uvicorn
from pydantic import ValidationError

from service.app import create_app
from service.config import Settings
from service.runtime import StartupError, preflight

log = logging.getLogger("rnnserve")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = Settings(_cli_parse_args=args)
    except ValidationError as exc:
        sys.exit(f"rnnserve: {_setting_error(exc)}")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        preflight(settings)  # fail closed, with one line, before the port opens
    except StartupError as exc:
        log.debug("start-up check failed", exc_info=True)
        sys.exit(f"rnnserve: {exc}")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s),
    )


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
