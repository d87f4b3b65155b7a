"""The example request each served model is documented with, and its real answer.

Every model's OpenAPI examples (``/openapi.json``) use the same small request: two sequences
(3 and 2 steps) of the model's input width, from :func:`example_inputs`. At start-up the
runtime runs each model on it, on the model's own worker thread and through the same code path a
lone request takes (not through the batcher: no metrics, no queue), and keeps the answer as the
JSON numbers a client would receive (:func:`as_json`), so the documented 200 response is the
response, not an illustration.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

LENGTHS = (3, 2)


def example_rows(length: int, width: int, seed: int) -> list[list[float]]:
    """``length`` steps of ``width`` numbers in [-1, 1] with two decimals (readable, finite)."""
    return [
        [round(math.sin(0.7 * seed + 0.3 * t + 0.5 * f), 2) for f in range(width)]
        for t in range(length)
    ]


def example_inputs(width: int) -> list[list[list[float]]]:
    """The documented request's sequences for a model taking ``width`` features per step."""
    return [example_rows(n, width, i) for i, n in enumerate(LENGTHS)]


def as_arrays(inputs: list[list[list[float]]]) -> list[np.ndarray]:
    """The sequences as the server parses them from JSON (float32)."""
    return [np.asarray(seq, dtype=np.float32) for seq in inputs]


def as_json(outputs: Any) -> list[list[list[float]]]:
    """Output arrays as the numbers a JSON response holds (orjson writes float32 the short way)."""
    result: list[list[list[float]]] = orjson.loads(
        orjson.dumps(list(outputs), option=orjson.OPT_SERIALIZE_NUMPY)
    )
    return result
