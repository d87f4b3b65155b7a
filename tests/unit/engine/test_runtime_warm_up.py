"""Start-up compiles the smoother's Triton kernels for every tile plan a batch can get.

On this CPU the model's own ``warm_up`` has nothing to compile (tests/gpu checks the CUDA side:
no kernel compiles after it, whatever the batches); here the runtime is checked to ask for it,
with the configured longest sequence, once per smoother, and to log what it compiled.
"""

from __future__ import annotations

import logging

import pytest

from rnnserve.models.smoothing import LinearRecursion
from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import ModelRuntime


async def test_start_up_warms_each_smoother_up_to_the_longest_sequence(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked: list[tuple[int, int]] = []

    def warm_up(self: LinearRecursion, max_steps: int) -> int:
        asked.append((self.feat_dim, max_steps))
        return 7

    monkeypatch.setattr(LinearRecursion, "warm_up", warm_up)
    runtime = ModelRuntime(Settings(max_delay_ms=1.0, max_sequence_length=1234))
    with caplog.at_level(logging.INFO, logger="rnnserve.service.engine.runtime"):
        await runtime.start()
    try:
        assert asked == [(16, 1234)]  # the default smoother only; the Traveller has its own
        assert any(
            r.getMessage().startswith("smoother: compiled the Triton smoother's 7 tile plans in ")
            for r in caplog.records
        )
    finally:
        await runtime.stop()


async def test_nothing_is_logged_when_nothing_was_compiled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runtime = ModelRuntime(Settings(max_delay_ms=1.0))
    with caplog.at_level(logging.INFO, logger="rnnserve.service.engine.runtime"):
        await runtime.start()
    try:
        assert not any("tile plans" in r.getMessage() for r in caplog.records)
    finally:
        await runtime.stop()
