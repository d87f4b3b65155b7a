"""models.load, the weights files and the weights generator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import models
from models.traveller import Traveller

ROOT = Path(__file__).resolve().parents[2]


def test_bundled_models() -> None:
    assert models.available() == ["smoother", "traveller"]


def test_shipped_weights_are_what_the_script_makes(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "scripts/make_weights.py", str(tmp_path)], cwd=ROOT, check=True)
    for name in ("smoother", "traveller"):
        made = load_file(str(tmp_path / f"{name}.safetensors"))
        shipped = load_file(str(models.DEFAULT_MODEL_DIR / f"{name}.safetensors"))
        assert made.keys() == shipped.keys()
        for key in made:
            assert torch.equal(made[key], shipped[key]), f"{name}.{key} differs"


def test_save_and_load_a_custom_model(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = Traveller(4, 8, 1)
    models.save(model, tmp_path / "tiny.safetensors")
    assert models.available(tmp_path) == ["tiny"]
    loaded = models.load("tiny", tmp_path, rollout_backend="eager")
    assert isinstance(loaded, Traveller)
    assert loaded.config == model.config
    assert not loaded.training
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_unknown_model_names_what_exists(tmp_path: Path) -> None:
    with pytest.raises(models.ModelNotFound, match=r"available: smoother, traveller"):
        models.load("nope")
    with pytest.raises(models.ModelNotFound, match="available: none"):
        models.load("nope", tmp_path)


def test_file_without_metadata_is_refused(tmp_path: Path) -> None:
    save_file({"wx": torch.ones(3)}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(ValueError, match="no rnnserve metadata"):
        models.load("bare", tmp_path)


def test_describe() -> None:
    info = models.describe(models.load("traveller"))
    assert info["kind"] == "traveller"
    assert info["shapes"] == {"input": ["T", 6], "output": ["T", 2]}
    assert info["parameters"] == sum(p.numel() for p in models.load("traveller").parameters())
