"""The default models that ship in models/weights are the trainer's: they score on their cards'
held-out sets exactly what the cards say, on freshly drawn data about as much, and far better
than the simple baselines; retraining with scripts/make_weights.py scores the same (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rnnserve import models
from rnnserve.models import train
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import Traveller

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = models.DEFAULT_MODEL_DIR
SEED = 0  # the trainer's default, which make_weights.py uses
SMOOTHER = train.KIND_DEFAULTS["smoother"]
TRAVELLER = train.KIND_DEFAULTS["traveller"]


def card(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


def smoother(folder: Path = SHIPPED) -> LinearRecursion:
    model = models.load("smoother", folder)
    assert isinstance(model, LinearRecursion)
    return model


def traveller(folder: Path = SHIPPED) -> Traveller:
    model = models.load("traveller", folder, rollout_backend="eager")
    assert isinstance(model, Traveller)
    return model


def smoother_validation(model: LinearRecursion, seed: int, batch: int) -> tuple[float, float]:
    """The model's and no smoothing's MSE on the trainer's validation draw for ``seed``."""
    channels = train.Channels.spread(model.feat_dim)
    gen = torch.Generator().manual_seed(seed)
    xs, ys = train.sequences(channels, train.random_lengths(gen, batch, SMOOTHER["length"]), gen)
    raw = torch.nn.functional.mse_loss(
        torch.tanh(torch.cat(xs)), torch.cat(ys)
    )  # fmt: skip
    return train.val_loss(model, xs, ys), float(raw)


def traveller_errors(model: Traveller, seed: int, count: int) -> dict[str, train.Errors]:
    gen = torch.Generator().manual_seed(seed)
    us, ps = train.trajectories(gen, [int(TRAVELLER["length"])] * count)
    return train.held_out_errors(model, us, ps)


def test_the_shipped_smoother_scores_what_its_card_says() -> None:
    figures = card(SHIPPED, "smoother")["validation"]
    mse, raw = smoother_validation(smoother(), SEED, int(SMOOTHER["batch"]))
    assert mse == pytest.approx(figures["model"], rel=1e-4)
    assert raw == pytest.approx(figures["no_smoothing"], rel=1e-4)
    fresh, fresh_raw = smoother_validation(smoother(), 1234, 128)  # drawn anew
    assert fresh == pytest.approx(figures["model"], rel=0.15)
    assert fresh < 0.7 * fresh_raw  # smoothing removes a good part of the noise


def test_the_shipped_smoother_learned_a_different_alpha_per_channel() -> None:
    alpha = smoother().alpha_smooth.detach()
    assert float(alpha.max() - alpha.min()) > 0.5
    # the slowest channel (the last) keeps more of its past than the fastest (the first)
    assert float(alpha[-1]) > float(alpha[0])


def test_the_shipped_traveller_scores_what_its_card_says() -> None:
    figures = card(SHIPPED, "traveller")["held_out"]
    held = traveller_errors(traveller(), SEED + train.HELD_OUT_SEED_OFFSET, 256)
    for name in ("model", "origin", "straight_line"):
        assert held[name].mse == pytest.approx(figures[name]["mse"], rel=1e-4, abs=1e-7), name
    fresh = traveller_errors(traveller(), 4321, 256)  # drawn anew
    assert fresh["model"].mse == pytest.approx(figures["model"]["mse"], rel=0.25)
    assert fresh["model"].mse < 0.05 * fresh["origin"].mse
    assert fresh["model"].mse < 0.05 * fresh["straight_line"].mse
    assert fresh["model"].final_distance < 0.3 * fresh["straight_line"].final_distance


@pytest.mark.slow
def test_make_weights_trains_models_that_score_as_the_shipped_ones(tmp_path: Path) -> None:
    # bit-equal weights need the same floating-point kernels as the machine that made them;
    # the same held-out scores do not
    subprocess.run([sys.executable, "scripts/make_weights.py", str(tmp_path)], cwd=ROOT, check=True)
    assert models.available(tmp_path) == ["smoother", "traveller"]
    made = card(tmp_path, "smoother")["validation"]["model"]
    assert made == pytest.approx(card(SHIPPED, "smoother")["validation"]["model"], rel=0.02)
    made_traveller = traveller_errors(traveller(tmp_path), 4321, 256)["model"].mse
    shipped = traveller_errors(traveller(), 4321, 256)["model"].mse
    assert made_traveller == pytest.approx(shipped, rel=0.2)
