"""``rnnserve train traveller``: a folder the loader serves, a free-running
rollout that beats its initialisation and the baselines on fresh data, the same file from the
same seed, the physics of the synthetic agent, refusals of bad arguments."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rnnserve import models
from rnnserve.models import train
from rnnserve.models.traveller import Traveller

# a tiny configuration: seconds on one core, still far better than the baselines
TINY = ["--hidden", "24", "--layers", "1", "--batch", "16", "--length", "32", "--lr", "0.01"]
TINY += ["--held-out", "48", "--quiet"]
TINY_STEPS = "200"


def run(out: Path, *extra: str, steps: str = TINY_STEPS) -> Traveller:
    assert train.main(["traveller", "--out", str(out), *TINY, "--steps", steps, *extra]) == 0
    model = models.load("traveller", out, rollout_backend="eager")
    assert isinstance(model, Traveller)
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Traveller]:
    out = tmp_path_factory.mktemp("traveller")
    return out, run(out)


def numbers(out: Path) -> dict:
    return json.loads((out / "traveller.json").read_text())


def test_writes_a_model_folder_the_loader_serves_with_a_card(
    trained: tuple[Path, Traveller],
) -> None:
    out, model = trained
    assert models.available(out) == ["traveller"]
    assert (model.num_inputs, model.hidden_size, model.num_layers) == (6, 24, 1)
    assert stat.S_IMODE((out / "traveller.safetensors").stat().st_mode) == 0o644
    card = (out / "traveller.md").read_text()
    assert "Synthetic data only" in card
    figures = numbers(out)
    held = figures["held_out"]
    assert f"**{held['model']['mse']:.5f}**" in card
    assert f"| {held['straight_line']['mse']:.5f} |" in card
    assert f"| {held['origin']['mse']:.5f} |" in card
    assert f"| {figures['untrained']['mse']:.5f} |" in card
    longer = figures["held_out_twice_length"]
    assert f"**{longer['model']['mse']:.5f}**" in card
    assert f"| {longer['straight_line']['mse']:.5f} |" in card
    steps = [p["step"] for p in figures["curve"]]
    assert steps[0] == 0
    assert steps[-1] == int(TINY_STEPS)
    for p in figures["curve"]:
        assert f"| {p['step']} | {p['loss']:.5f} | {p['validation']:.5f} |" in card
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_the_card_reports_the_free_running_error_on_its_held_out_set(
    trained: tuple[Path, Traveller],
) -> None:
    """The card's figure is the rollout from the commands alone: recomputed here from the
    held-out set's seed, it matches; positions fed from the truth would give another."""
    out, model = trained
    gen = torch.Generator().manual_seed(0 + train.HELD_OUT_SEED_OFFSET)
    us, ps = train.trajectories(gen, [32] * 48)
    with torch.no_grad():
        got = [model(u[:, None, :]) for u in us]  # one sequence at a time, own outputs fed back
    mse = float(((torch.cat(got) - torch.cat(ps)).double() ** 2).mean())
    assert numbers(out)["held_out"]["model"]["mse"] == pytest.approx(mse, rel=1e-4, abs=1e-7)


def test_the_trained_model_beats_its_init_and_the_baselines_on_fresh_data(
    trained: tuple[Path, Traveller],
) -> None:
    out, model = trained
    us, ps = train.trajectories(torch.Generator().manual_seed(99), [32] * 64)
    torch.manual_seed(0)
    init = Traveller(6, 24, 1)
    errors = train.held_out_errors(model, us, ps)
    untrained = train.held_out_errors(init, us, ps)["model"]
    assert errors["model"].mse < 0.5 * errors["straight_line"].mse
    assert errors["model"].mse < 0.2 * errors["origin"].mse
    assert errors["model"].mse < 0.2 * untrained.mse
    assert errors["model"].final_distance < 0.7 * errors["straight_line"].final_distance
    # and by the card's own margins, on its held-out set
    held = numbers(out)["held_out"]
    assert held["model"]["mse"] < 0.5 * held["straight_line"]["mse"]
    assert held["model"]["mse"] < 0.2 * numbers(out)["untrained"]["mse"]


def test_a_few_training_steps_lower_the_loss(tmp_path: Path) -> None:
    run(tmp_path, steps="8")
    curve = numbers(tmp_path)["curve"]
    assert curve[0]["step"] == 0
    assert curve[-1]["step"] == 8
    assert curve[-1]["validation"] < 0.9 * curve[0]["validation"]


def test_the_same_seed_writes_the_same_weights(tmp_path: Path) -> None:
    run(tmp_path / "a", "--seed", "3", steps="30")
    run(tmp_path / "b", "--seed", "3", steps="30")
    run(tmp_path / "c", "--seed", "4", steps="30")
    weights = {k: load_file(tmp_path / k / "traveller.safetensors") for k in "abc"}
    assert "output_layer.weight" in weights["a"]
    for key in weights["a"]:
        assert torch.equal(weights["a"][key], weights["b"][key]), key
        assert not torch.equal(weights["a"][key], weights["c"][key]), key


def test_two_training_steps_from_one_seed_give_the_same_weights(tmp_path: Path) -> None:
    run(tmp_path / "a", "--seed", "5", steps="2")
    run(tmp_path / "b", "--seed", "5", steps="2")
    a = load_file(tmp_path / "a" / "traveller.safetensors")
    b = load_file(tmp_path / "b" / "traveller.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_the_agent_turns_then_moves_along_its_new_heading() -> None:
    """A quarter turn at the first step, then full speed: the agent goes up the ``y`` axis;
    the distractors move nothing, and the straight line ignores the turn."""
    u = torch.zeros(3, 6)
    u[0, 0] = (math.pi / 2) / train.TURN_RAD
    u[:, 1] = 1.0
    u[:, 2:] = torch.tensor([3.0, -2.0, 1.0, 5.0])
    y = torch.tensor([1.0, 2.0, 3.0]) * train.STEP
    want = torch.stack([torch.zeros(3), y], 1)
    torch.testing.assert_close(train.true_positions(u), torch.tanh(want / train.SCALE))
    straight = torch.stack([y, torch.zeros(3)], 1)
    torch.testing.assert_close(train.straight_line(u), torch.tanh(straight / train.SCALE))


def test_the_commands_are_smooth_and_the_speed_is_in_range() -> None:
    (u,) = train.commands(torch.Generator().manual_seed(1), [20000])
    assert u.shape == (20000, 6)
    assert float(u[:, 1].min()) > 0
    assert float(u[:, 1].max()) < 1
    free = u[:, [0, 2, 3, 4, 5]].double()
    lag1 = (free[1:] * free[:-1]).mean(0) / (free * free).mean(0)
    torch.testing.assert_close(
        lag1, torch.full((5,), train.COMMAND_RHO, dtype=torch.float64), atol=0.03, rtol=0
    )
    torch.testing.assert_close(free.std(0), torch.ones(5, dtype=torch.float64), atol=0.1, rtol=0)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["traveller", "--features", "4"], "--features applies to the smoother only"),
        (["smoother", "--hidden", "4"], "--hidden applies to the traveller only"),
        (["traveller", "--held-out", "0"], "--held-out must be at least 1"),
        (["traveller", "--layers", "0"], "--layers must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    with pytest.raises(SystemExit) as info:
        train.main([*argv[:1], "--out", str(tmp_path), *argv[1:]])
    assert info.value.code == 2
    assert words in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
