"""pytest plugin for scripts/mutation.sh: compile and warm the bundled models once, up front.

mutmut forks one worker per mutant from a process that has loaded this plugin, so the numba
kernels and TorchScript functions compiled here are inherited instead of being compiled again
in every worker (seconds each). The app is started and stopped once; no thread or event loop
is left running when the workers fork.
"""

from __future__ import annotations

import asyncio


def _warm() -> None:
    from rnnserve.service.config import Settings
    from rnnserve.service.http.app import create_app

    app = create_app(Settings())

    async def start_and_stop() -> None:
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(start_and_stop())


_warm()
