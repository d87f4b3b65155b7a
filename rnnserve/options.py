"""The values of the rollout's settings, named once for the server's configuration (which an HTTP
worker reads without torch) and for the models that act on them; typing's names only."""

from __future__ import annotations

from typing import Literal, get_args

# how the Traveller's rollout loop runs; auto: the fastest for the device
RolloutBackend = Literal["auto", "eager", "torchscript", "numba", "triton"]
ROLLOUT_BACKENDS: tuple[str, ...] = get_args(RolloutBackend)
# how the numba rollout picks each GEMM: timed on this CPU at load, or the same in every process
GemmRoutes = Literal["measured", "fixed"]
