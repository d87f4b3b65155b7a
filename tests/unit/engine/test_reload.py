"""Reloading the model directory while serving (``ModelRuntime.reload``): new and changed files
are loaded beside the served version and swapped in, bad ones leave the old version serving,
removed ones stop their model, and requests in flight finish on the version they started with.

The models are small smoothers (4 features) written to a temporary folder; a version's answer is
the smoother's own kernel run on the same rows, so answers compare exactly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import generate_latest

from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import ModelRuntime
from rnnserve.service.interface import FlatSequences, UnknownModel
from rnnserve.service.metrics import Metrics
from tests.metrics import value

WIDTH = 4
ROWS = FlatSequences.from_arrays(
    [np.random.default_rng(3).standard_normal((n, WIDTH)).astype(np.float32) for n in (9, 2, 5)]
)


def smoother(alpha: float) -> LinearRecursion:
    module = models.build("smoother", {"feat_dim": WIDTH, "alpha_smooth": alpha})
    assert isinstance(module, LinearRecursion)
    return module.eval().requires_grad_(False)


def write(folder: Path, name: str, alpha: float) -> None:
    """As a deployment replaces a file: written aside, then moved over the old one at once."""
    aside = folder / f".{name}.partial"
    models.save(smoother(alpha), aside)
    os.replace(aside, folder / f"{name}.safetensors")


def answer(alpha: float) -> np.ndarray:
    """Version ``alpha``'s answer to ``ROWS``, by the kernel the runtime runs on the CPU."""
    return smoother(alpha).smooth_flat(ROWS.data, ROWS.lengths)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[ModelRuntime, Path]]:
    write(tmp_path, "a", 0.5)
    write(tmp_path, "b", 0.3)
    runtime = ModelRuntime(Settings(model_dir=tmp_path, device="cpu", max_delay_ms=1.0), Metrics())
    await runtime.start()
    try:
        yield runtime, tmp_path
    finally:
        await runtime.stop()


def reloads(runtime: ModelRuntime, result: str) -> float:
    assert runtime.metrics is not None
    text = generate_latest(runtime.metrics.registry).decode()
    return value(text, "rnnserve_model_reloads_total", result=result)


class Held:
    """Holds the batches of one served version on its worker thread until released."""

    def __init__(self, runtime: ModelRuntime, name: str) -> None:
        module = runtime.models[name].module
        assert isinstance(module, LinearRecursion)
        self.running = threading.Event()
        self.release = threading.Event()
        smooth: Callable[..., Any] = module.smooth_flat

        def held(*args: Any) -> Any:
            self.running.set()
            assert self.release.wait(30)
            return smooth(*args)

        module.smooth_flat = held  # type: ignore[method-assign]  # this version's object only

    async def started(self) -> None:
        assert await asyncio.to_thread(self.running.wait, 30)


async def test_a_changed_file_is_a_new_version_with_its_own_answers(
    served: tuple[ModelRuntime, Path],
) -> None:
    runtime, folder = served
    old = runtime.models["a"]
    np.testing.assert_array_equal((await runtime.infer("a", ROWS)).data, answer(0.5))
    told: list[set[str]] = []
    runtime.on_models_changed(lambda: told.append(set(runtime.models)))
    write(folder, "a", 0.9)
    report = await runtime.reload()
    assert (report.changed, report.unchanged) == (["a"], ["b"])
    assert (report.loaded, report.removed, report.failed) == ([], [], {})
    new = runtime.models["a"]
    assert len(new.version) == 12
    assert new.version != old.version
    assert new.loaded_at >= old.loaded_at
    np.testing.assert_array_equal((await runtime.infer("a", ROWS)).data, answer(0.9))
    assert not np.array_equal(answer(0.9), answer(0.5))
    assert told == [{"a", "b"}]
    assert reloads(runtime, "changed") == 1


async def test_a_file_written_again_unchanged_keeps_its_version(
    served: tuple[ModelRuntime, Path],
) -> None:
    runtime, folder = served
    before = runtime.models["a"]
    shutil.copy(folder / "a.safetensors", folder / "copy")
    os.replace(folder / "copy", folder / "a.safetensors")  # a new inode and time, same bytes
    report = await runtime.reload()
    assert sorted(report.unchanged) == ["a", "b"]
    assert runtime.models["a"] is before


async def test_a_bad_file_leaves_the_old_version_serving_and_is_counted(
    served: tuple[ModelRuntime, Path], caplog: pytest.LogCaptureFixture
) -> None:
    runtime, folder = served
    before = runtime.models["a"]
    (folder / "bad").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    os.replace(folder / "bad", folder / "a.safetensors")
    with caplog.at_level(logging.ERROR, logger="rnnserve.service.engine.runtime"):
        report = await runtime.reload()
    assert list(report.failed) == ["a"]
    assert "a.safetensors: not a valid safetensors file" in report.failed["a"]
    assert report.unchanged == ["b"]
    assert runtime.models["a"] is before
    np.testing.assert_array_equal((await runtime.infer("a", ROWS)).data, answer(0.5))
    assert reloads(runtime, "failed") == 1
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert f"the new file of a is refused (version {before.version} serves on)" in line
    write(folder, "a", 0.7)  # fixed: the next reload takes it
    assert (await runtime.reload()).changed == ["a"]
    np.testing.assert_array_equal((await runtime.infer("a", ROWS)).data, answer(0.7))


async def test_a_request_in_flight_finishes_on_the_version_it_started_with(
    served: tuple[ModelRuntime, Path],
) -> None:
    runtime, folder = served
    held = Held(runtime, "a")
    first = asyncio.ensure_future(runtime.infer("a", ROWS))
    await held.started()
    queued = asyncio.ensure_future(runtime.infer("a", ROWS))  # waits behind it, same version
    await asyncio.sleep(0.01)
    write(folder, "a", 0.9)
    assert (await runtime.reload()).changed == ["a"]
    # the new version answers at once while the old one still holds its batch
    np.testing.assert_array_equal((await runtime.infer("a", ROWS)).data, answer(0.9))
    assert not first.done()
    held.release.set()
    np.testing.assert_array_equal((await first).data, answer(0.5))
    np.testing.assert_array_equal((await queued).data, answer(0.5))


async def test_a_removed_file_stops_its_model_after_its_requests(
    served: tuple[ModelRuntime, Path],
) -> None:
    runtime, folder = served
    held = Held(runtime, "b")
    in_flight = asyncio.ensure_future(runtime.infer("b", ROWS))
    await held.started()
    (folder / "b.safetensors").unlink()
    report = await runtime.reload()
    assert (report.removed, report.unchanged) == (["b"], ["a"])
    assert sorted(runtime.models) == ["a"]
    with pytest.raises(UnknownModel, match="no model named 'b'"):
        await runtime.infer("b", ROWS)
    held.release.set()
    np.testing.assert_array_equal((await in_flight).data, answer(0.3))
    assert reloads(runtime, "removed") == 1


async def test_a_new_file_is_served_but_a_pickle_in_the_folder_changes_nothing(
    served: tuple[ModelRuntime, Path],
) -> None:
    runtime, folder = served
    write(folder, "c", 0.2)
    (folder / "evil.pt").write_bytes(b"not loaded")
    report = await runtime.reload()
    assert list(report.failed) == [""]
    assert "evil.pt: pickle files are refused" in report.failed[""]
    assert (report.loaded, report.changed, report.removed) == ([], [], [])
    assert sorted(runtime.models) == ["a", "b"]
    (folder / "evil.pt").unlink()
    assert (await runtime.reload()).loaded == ["c"]
    np.testing.assert_array_equal((await runtime.infer("c", ROWS)).data, answer(0.2))
    assert reloads(runtime, "loaded") == 1
    assert reloads(runtime, "failed") == 1


async def test_the_configured_default_model_cannot_be_removed(tmp_path: Path) -> None:
    write(tmp_path, "a", 0.5)
    write(tmp_path, "b", 0.3)
    settings = Settings(model_dir=tmp_path, device="cpu", default_smoother="a")
    runtime = ModelRuntime(settings, Metrics())
    await runtime.start()
    try:
        (tmp_path / "a.safetensors").unlink()
        report = await runtime.reload()
        assert report.failed == {"a": "'a' is --default-smoother: a reload may not remove it"}
        assert sorted(runtime.models) == ["a", "b"]
    finally:
        await runtime.stop()


async def test_the_poll_reloads_a_changed_folder(tmp_path: Path) -> None:
    write(tmp_path, "a", 0.5)
    settings = Settings(model_dir=tmp_path, device="cpu", max_delay_ms=1.0, reload_poll_s=0.02)
    runtime = ModelRuntime(settings, Metrics())
    await runtime.start()
    try:
        old = runtime.models["a"].version
        write(tmp_path, "a", 0.9)
        async with asyncio.timeout(30):
            while runtime.models["a"].version == old:  # noqa: ASYNC110 (the poll is the subject)
                await asyncio.sleep(0.02)
        np.testing.assert_array_equal((await runtime.infer("a", ROWS)).data, answer(0.9))
    finally:
        await runtime.stop()
