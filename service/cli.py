"""The ``rnnserve`` command: settings from flags and ``RNNSERVE_*``, then uvicorn."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence

import uvicorn

from service.app import create_app
from service.config import Settings


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    settings = Settings(_cli_parse_args=args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s),
    )


if __name__ == "__main__":
    main()
