"""The load generator's workloads and their request bodies (built, seeded, before timing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import orjson
from safetensors.numpy import save as st_save

JSON_TYPE = "application/json"
BINARY_TYPE = "application/x-safetensors"
Format = Literal["json", "binary"]


@dataclass(frozen=True)
class Workload:
    """One kind of request: endpoint, field names, shape of its single sequence."""

    name: str
    path: str
    field: str  # request field: "sequences" or "inputs"
    out_field: str  # response field: "sequences" or "positions"
    model: str  # the model's label in rnnserve's metrics
    features: int
    out_features: int
    min_steps: int
    max_steps: int

    def describe(self) -> str:
        steps = (
            f"{self.min_steps:,}"
            if self.min_steps == self.max_steps
            else f"{self.min_steps}–{self.max_steps}"
        )
        return f"`{self.path}`, one sequence of {steps} steps × {self.features}"


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("smooth", "/smooth", "sequences", "sequences", "smoother", 16, 16, 50, 500),
        Workload("rollout", "/rollout", "inputs", "positions", "traveller", 6, 2, 50, 500),
        Workload("smooth4000", "/smooth", "sequences", "sequences", "smoother", 16, 16, 4000, 4000),
    )
}


@dataclass(frozen=True)
class Body:
    """One pre-built request: the bytes, their headers, and the timesteps they hold."""

    data: bytes
    headers: Mapping[str, str]
    steps: int


def make_bodies(
    workload: Workload, count: int = 64, *, seed: int = 0, fmt: Format = "json"
) -> list[Body]:
    """``count`` request bodies of one sequence each, lengths uniform in the workload's range."""
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(count):
        steps = int(rng.integers(workload.min_steps, workload.max_steps + 1))
        x = rng.uniform(-1.0, 1.0, (steps, workload.features)).astype(np.float32)
        bodies.append(encode(workload, [x], fmt))
    return bodies


def encode(workload: Workload, sequences: Sequence[np.ndarray], fmt: Format = "json") -> Body:
    """One request body holding ``sequences`` (each ``[T_i, features]`` float32)."""
    steps = sum(len(s) for s in sequences)
    if fmt == "json":
        data = orjson.dumps(
            {workload.field: [np.ascontiguousarray(s, np.float32) for s in sequences]},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        return Body(data, {"Content-Type": JSON_TYPE}, steps)
    tensors: dict[str, np.ndarray] = {
        workload.field: np.ascontiguousarray(np.concatenate(sequences), np.float32),
        "lengths": np.array([len(s) for s in sequences], np.int64),
    }
    headers = {"Content-Type": BINARY_TYPE, "Accept": BINARY_TYPE}
    return Body(st_save(tensors), headers, steps)
