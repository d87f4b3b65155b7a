"""``rnnserve train smoother``: a folder the loader serves, a per-channel
alpha that fits each channel, the same file from the same seed, refusals of bad arguments."""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rnnserve import models
from rnnserve.models import train
from rnnserve.models.kernels import ema_packed_torch
from rnnserve.models.packing import pack
from rnnserve.models.smoothing import LinearRecursion

SMALL = ["--features", "5", "--steps", "60", "--batch", "12", "--length", "96", "--quiet"]


def run(out: Path, *extra: str) -> LinearRecursion:
    assert train.main(["smoother", "--out", str(out), *SMALL, *extra]) == 0
    model = models.load("smoother", out)
    assert isinstance(model, LinearRecursion)
    return model


def test_writes_a_model_folder_the_loader_serves_with_a_card(tmp_path: Path) -> None:
    model = run(tmp_path / "out")
    out = tmp_path / "out"
    assert models.available(out) == ["smoother"]
    assert model.feat_dim == 5
    assert stat.S_IMODE((out / "smoother.safetensors").stat().st_mode) == 0o644
    card = (out / "smoother.md").read_text()
    assert "Synthetic data only" in card
    for c, a in enumerate(model.alpha_smooth.tolist()):
        assert f"| {c} |" in card
        assert f"{a:.4f}" in card
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_each_channel_gets_the_alpha_that_fits_it_best(tmp_path: Path) -> None:
    """On fresh data, no alpha on a grid beats the learned one on any channel by much, and the
    channels' alphas differ: one shared alpha could not do that."""
    model = run(tmp_path)
    channels = train.Channels.spread(5)
    xs, ys = train.sequences(channels, [96] * 24, torch.Generator().manual_seed(99))
    x, want = pack(xs), pack(ys).data.double()
    wx = model.wx.detach().double()

    def per_channel_mse(alpha: torch.Tensor) -> np.ndarray:
        s = ema_packed_torch(x.data.double(), x.batch_sizes, alpha)
        return ((torch.tanh(wx * s) - want) ** 2).mean(0).numpy()

    learned = per_channel_mse(model.alpha_smooth.detach().double())
    grid = np.stack([per_channel_mse(torch.full((5,), a)) for a in np.linspace(0, 0.95, 20)])
    assert (learned <= grid.min(0) * 1.02 + 1e-5).all(), (learned, grid.min(0))
    alpha = model.alpha_smooth.detach()
    assert float(alpha.max() - alpha.min()) > 0.3


def test_the_same_seed_writes_the_same_weights(tmp_path: Path) -> None:
    run(tmp_path / "a", "--seed", "3")
    run(tmp_path / "b", "--seed", "3")
    run(tmp_path / "c", "--seed", "4")
    # the tensors, not the bytes: safetensors writes its header's keys in no fixed order
    weights = {k: load_file(tmp_path / k / "smoother.safetensors") for k in "abc"}
    assert weights["a"].keys() == {"alpha_smooth", "wx"}
    for key in weights["a"]:
        assert torch.equal(weights["a"][key], weights["b"][key])
        assert not torch.equal(weights["a"][key], weights["c"][key])


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--steps", "0", "--steps must be at least 1"),
        ("--lr", "nan", "--lr must be a positive number"),
        ("--name", "../smoother", "--name: up to 128 letters"),
        ("--seed", str(10**23), "--seed must be from 0 to 2**63 - 1"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, words: str
) -> None:
    with pytest.raises(SystemExit) as info:
        train.main(["smoother", "--out", str(tmp_path), flag, value])
    assert info.value.code == 2
    assert words in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_training_that_diverges_writes_nothing_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step size that blows the weights up to NaN: no model a server would load and answer
    null with, and a non-zero exit."""
    out = tmp_path / "m"
    args = ["smoother", "--out", str(out), "--features", "3", "--steps", "20", "--batch", "4"]
    assert train.main([*args, "--length", "16", "--lr", "1e30", "--quiet"]) == 1
    assert "training diverged" in capsys.readouterr().out
    assert not list(out.iterdir())


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_folder_that_cannot_be_written_fails_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker if where == "a file" else blocker / "m"
    assert train.main(["smoother", "--out", str(out), *SMALL]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}:" in err
    assert "Traceback" not in err


def test_the_synthetic_channels_have_their_own_dynamics_and_noise() -> None:
    """Lag-1 autocorrelation of the clean signal is ``rho``, the noise's deviation ``sigma``."""
    channels = train.Channels.spread(6)
    assert len(set(np.round(channels.rho, 6))) == 6
    assert len(set(np.round(channels.sigma, 6))) == 6
    xs, ys = train.sequences(channels, [4000] * 8, torch.Generator().manual_seed(1))
    z = torch.atanh(torch.stack(ys).double().clamp(-1 + 1e-7, 1 - 1e-7))  # [B, T, F]
    noise = torch.stack(xs).double() - z
    lag1 = (z[:, 1:] * z[:, :-1]).mean((0, 1)) / (z * z).mean((0, 1))
    np.testing.assert_allclose(lag1.numpy(), channels.rho, atol=0.03)
    np.testing.assert_allclose(noise.std((0, 1)).numpy(), channels.sigma, rtol=0.03)


def test_progress_lines_give_the_loss_the_rate_and_the_time_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train.main(["smoother", "--out", str(tmp_path), "--steps", "20"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert len(lines) == 10  # one per tenth of the steps
    assert re.fullmatch(
        r"step 20/20: loss \d\.\d{5}, validation \d\.\d{5}, \d+\.\d\d steps/s, ETA 0m00s",
        lines[-1],
    ), lines[-1]


def test_training_runs_the_fused_loss_each_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rnnserve.models.smoothing as smoothing

    calls: list[int] = []
    real = smoothing.smooth_mse_packed_numba

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(smoothing, "smooth_mse_packed_numba", spy)
    run(tmp_path, "--steps", "7")
    assert len(calls) == 7
