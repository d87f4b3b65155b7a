"""Process-wide memory settings, shared by the single-process server and the engine process."""

from __future__ import annotations

import gc


def settle_garbage_collector() -> None:
    """Call once the models are loaded and warm: move every object alive now (modules, models,
    compiled code: hundreds of thousands of them) out of the cyclic collector's reach
    (``gc.freeze``; ``gc.unfreeze`` gives them back at shutdown).

    Python's full collections otherwise walk all of them, tens of milliseconds each, stalling
    every request in flight: under load on /smooth they were most of the p99 latency (194 ms
    against 63 ms frozen, docs/BENCHMARKS.md).
    """
    gc.collect()
    gc.freeze()
