"""``rnnserve train``: the trainer as a subcommand of the rnnserve command, which writes a folder
that the server loads and serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.service import cli
from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import ModelRuntime, preflight
from rnnserve.service.interface import FlatSequences
from rnnserve.service.metrics import Metrics

SMOOTHER = ["--features", "4", "--steps", "5", "--batch", "6", "--length", "20", "--quiet"]
TRAVELLER = ["--hidden", "8", "--layers", "1", "--steps", "3", "--batch", "4", "--length", "8"]
TRAVELLER += ["--held-out", "4", "--quiet"]


def train(*args: str) -> int | str | None:
    with pytest.raises(SystemExit) as done:
        cli.main(["train", *args])
    return done.value.code


def test_train_is_a_subcommand() -> None:
    assert "train" in cli.COMMANDS


def test_the_servers_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_settings(["--help"])
    text = capsys.readouterr().out
    listed = text.split("commands (rnnserve COMMAND --help):", 1)[1]
    for name, what in cli.COMMANDS.items():
        assert f"{name}" in listed
        assert what in listed


async def test_both_kinds_train_into_a_folder_the_server_serves(tmp_path: Path) -> None:
    out = tmp_path / "trained"
    assert train("smoother", "--out", str(out), *SMOOTHER) == 0
    settings = Settings(model_dir=out, device="cpu", max_delay_ms=1.0)
    rows = np.random.default_rng(0).standard_normal((9, 4)).astype(np.float32)
    runtime = ModelRuntime(settings, Metrics())
    await runtime.start()
    try:
        answer = await runtime.infer("smoother", FlatSequences.from_arrays([rows]))
    finally:
        await runtime.stop()
    trained = models.load("smoother", out)
    assert isinstance(trained, LinearRecursion)
    np.testing.assert_array_equal(answer.data, trained.smooth_flat(rows, np.array([9])))
    assert train("traveller", "--out", str(out), *TRAVELLER) == 0
    assert preflight(settings) == ["smoother", "traveller"]  # what the server checks first


def test_its_usage_names_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert train("smoother") == 2  # no --out
    err = capsys.readouterr().err
    assert err.startswith("usage: rnnserve train"), err
    assert "the following arguments are required: --out" in err


def test_the_console_script_trains(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(Path(sys.executable).with_name("rnnserve")), "train", "smoother",
         "--out", str(tmp_path), *SMOOTHER],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert models.available(tmp_path) == ["smoother"]
    assert "wrote" in done.stdout
