"""Reloading the model directory while serving (``ModelRuntime.reload``): new and changed files
are loaded beside the served version and swapped in, bad ones leave the old version serving,
removed ones stop their model, and requests in flight finish on the version they started with.

The models are small smoothers (4 features) written to a temporary folder; a version's answer is
the smoother's own kernel run on the same rows, so answers compare exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from rnnserve.service.interface import (
    FlatSequences,
    ModelChanged,
    UnknownModel,
)
from rnnserve.service.metrics import Metrics
from tests.metrics import value

WIDTH = 4
ROWS = FlatSequences.from_arrays(
    [np.random.default_rng(3).standard_normal((n, WIDTH)).astype(np.float32) for n in (9, 2, 5)]
)


def smoother(alpha: float, width: int = WIDTH) -> LinearRecursion:
    module = models.build("smoother", {"feat_dim": width, "alpha_smooth": alpha})
    assert isinstance(module, LinearRecursion)
    return module.eval().requires_grad_(False)


def write(folder: Path, name: str, alpha: float, width: int = WIDTH) -> None:
    """As a deployment replaces a file: written aside, then moved over the old one at once."""
    aside = folder / f".{name}.partial"
    models.save(smoother(alpha, width), aside)
    os.replace(aside, folder / f"{name}.safetensors")


def write_traveller(folder: Path, name: str, inputs: int) -> None:
    aside = folder / f".{name}.partial"
    config = {"num_inputs": inputs, "hidden_size": 8, "num_layers": 1}
    models.save(models.build("traveller", config), aside)
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


@pytest.mark.parametrize("kind", ["fifo", "link to a device"])
async def test_a_model_entry_that_is_not_a_regular_file_fails_without_blocking(
    served: tuple[ModelRuntime, Path], kind: str
) -> None:
    """A FIFO would block a read for ever and /dev/zero never end one: refused unread, and the
    next reload is not held up by it."""
    runtime, folder = served
    entry = folder / "c.safetensors"
    if kind == "fifo":
        os.mkfifo(entry)
    else:
        entry.symlink_to("/dev/zero")
    report = await asyncio.wait_for(runtime.reload(), 30)
    assert list(report.failed) == ["c"]
    assert "c.safetensors: not a regular file" in report.failed["c"]
    assert sorted(runtime.models) == ["a", "b"]
    entry.unlink()
    write(folder, "c", 0.2)
    assert (await asyncio.wait_for(runtime.reload(), 30)).loaded == ["c"]


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


def rows(width: int, *lengths: int) -> FlatSequences:
    rng = np.random.default_rng(width)
    return FlatSequences.from_arrays(
        [rng.standard_normal((n, width)).astype(np.float32) for n in lengths]
    )


async def test_rows_checked_against_the_width_a_reload_replaced_are_a_model_changed(
    served: tuple[ModelRuntime, Path],
) -> None:
    """As the HTTP layer checks a request against the served model, then submits it: a reload
    that lands in between and makes the model wider refuses the request, naming the width."""
    runtime, folder = served
    checked = runtime.get("a")  # the HTTP layer's check: 4 features a step
    assert checked.input_dim == WIDTH
    state = (await runtime.infer("a", dataclasses.replace(ROWS, return_state=True))).state
    assert state is not None
    write(folder, "a", 0.9, width=6)
    assert (await runtime.reload()).changed == ["a"]
    new = runtime.models["a"]
    for request in (
        ROWS,
        dataclasses.replace(ROWS, return_state=True),
        dataclasses.replace(ROWS, state=state, return_state=True),  # the old version's state
    ):
        with pytest.raises(ModelChanged) as raised:
            await runtime.infer("a", request)
        assert str(raised.value) == (
            f"model 'a' changed while this request was on its way: version '{new.version}' "
            "takes 6 input features per step, the request's steps have 4"
        )
    with pytest.raises(ModelChanged, match="takes 6 input features"):
        await runtime.infer("a", list(ROWS))  # arrays, not flat rows: the same check
    wide = rows(6, 3, 5)  # the new width is served
    np.testing.assert_array_equal(
        (await runtime.infer("a", wide)).data, smoother(0.9, 6).smooth_flat(wide.data, wide.lengths)
    )


async def test_a_stream_checked_against_the_width_a_reload_replaced_is_a_model_changed(
    tmp_path: Path,
) -> None:
    write(tmp_path, "a", 0.5)
    write_traveller(tmp_path, "t", 3)
    runtime = ModelRuntime(Settings(model_dir=tmp_path, device="cpu", max_delay_ms=1.0))
    await runtime.start()
    try:
        assert runtime.get("t").input_dim == 3
        narrow = rows(3, 4, 2)
        assert len([c async for c in await runtime.open_stream("t", narrow)]) >= 1
        write_traveller(tmp_path, "t", 5)
        assert (await runtime.reload()).changed == ["t"]
        version = runtime.models["t"].version
        for request in (narrow, dataclasses.replace(narrow, return_state=True)):
            with pytest.raises(ModelChanged, match=f"version '{version}' takes 5 input"):
                runtime.stream("t", request)
            with pytest.raises(ModelChanged, match="the request's steps have 3"):
                await runtime.open_stream("t", request)
        assert len([c async for c in await runtime.open_stream("t", rows(5, 4, 2))]) >= 1
    finally:
        await runtime.stop()


async def test_a_new_model_takes_requests_before_it_is_listed_until_the_listeners_have_it(
    served: tuple[ModelRuntime, Path],
) -> None:
    """A listener that returns an awaitable (the engine's announcement to the HTTP workers) holds
    a new model unlisted but served until it is done; then the model is listed."""
    runtime, folder = served
    told = asyncio.Event()
    seen: list[tuple[list[str], list[str]]] = []
    heard = asyncio.get_running_loop().create_future()

    def listener() -> asyncio.Future[None]:
        seen.append((sorted(runtime.models), sorted(runtime.staged)))
        told.set()
        return heard

    runtime.on_models_changed(listener)
    write(folder, "c", 0.2)
    reload = asyncio.ensure_future(runtime.reload())
    try:
        await asyncio.wait_for(told.wait(), 30)
        assert seen == [(["a", "b"], ["c"])]
        assert "c" not in runtime.models
        assert runtime.get("c").version == runtime.staged["c"].version
        np.testing.assert_array_equal((await runtime.infer("c", ROWS)).data, answer(0.2))
        assert not reload.done()
    finally:
        heard.set_result(None)  # a failed check above leaves no reload waiting on it
    report = await asyncio.wait_for(reload, 30)
    assert report.loaded == ["c"]
    assert seen == [(["a", "b"], ["c"]), (["a", "b", "c"], [])]
    assert runtime.staged == {}
    np.testing.assert_array_equal((await runtime.infer("c", ROWS)).data, answer(0.2))


async def test_a_listener_that_fails_its_wait_does_not_fail_the_reload(
    served: tuple[ModelRuntime, Path], caplog: pytest.LogCaptureFixture
) -> None:
    runtime, folder = served

    async def failing() -> None:
        raise OSError("the socket is gone")

    runtime.on_models_changed(failing)
    write(folder, "c", 0.2)
    with caplog.at_level(logging.ERROR, logger="rnnserve.service.engine.runtime"):
        report = await runtime.reload()
    assert report.loaded == ["c"]
    assert sorted(runtime.models) == ["a", "b", "c"]
    assert [r.getMessage() for r in caplog.records] == [
        "a listener of the model list failed: the socket is gone"
    ] * 2


async def test_an_untrusted_torchscript_file_in_the_folder_changes_nothing(
    served: tuple[ModelRuntime, Path],
) -> None:
    """The start-up check of the whole folder, at a reload: the new smoother beside the
    TorchScript file is not loaded either."""
    runtime, folder = served
    before = dict(runtime.models)
    write(folder, "c", 0.2)
    (folder / "code.torchscript.pt").write_bytes(b"PK not loaded")
    report = await runtime.reload()
    assert list(report.failed) == [""]
    assert "code.torchscript.pt: TorchScript files are code" in report.failed[""]
    assert (report.loaded, report.changed, report.removed) == ([], [], [])
    assert runtime.models == before
    assert reloads(runtime, "failed") == 1


async def test_a_folder_emptied_of_models_changes_nothing(
    served: tuple[ModelRuntime, Path],
) -> None:
    runtime, folder = served
    before = dict(runtime.models)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    report = await runtime.reload()
    assert list(report.failed) == [""]
    assert "holds no <name>.safetensors model; nothing to serve" in report.failed[""]
    assert report.removed == []
    assert runtime.models == before
    np.testing.assert_array_equal((await runtime.infer("a", ROWS)).data, answer(0.5))
