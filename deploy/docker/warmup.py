"""Build-time warm-up for the image: load every bundled model and run the start-up warm-up.

Run by the Dockerfile as the runtime user, so a broken install step, a missing weight file or a
kernel that no longer compiles fails ``docker build`` rather than the first container start.
What it leaves behind: numba kernels declared with ``cache=True`` are written to
``NUMBA_CACHE_DIR`` and loaded from there at start-up. Kernels declared with ``cache=False``
(the models' packing, smoother and rollout loops), TorchScript's profiling and Triton's GPU
kernels cannot be kept in a file from here: they compile again, in memory, during the
server's own warm-up before ``/readyz`` turns 200 (Triton needs the GPU it compiles for, which
``docker build`` does not have).
"""

from __future__ import annotations

import asyncio
import time

from rnnserve.service.codec import bodies
from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import ModelRuntime


async def warm() -> list[str]:
    runtime = ModelRuntime(Settings(device="cpu", model_dir=None))
    await runtime.start()
    try:
        return sorted(runtime.models)
    finally:
        await runtime.stop()


def main() -> None:
    started = time.perf_counter()
    # the JSON reader's and writer's numba kernels compile on first use, cached to
    # NUMBA_CACHE_DIR: used here as the server's start-up uses them
    bodies.warm_up()
    names = asyncio.run(warm())
    print(f"warmed {', '.join(names)} in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
