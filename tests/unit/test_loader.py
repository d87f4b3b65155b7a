"""models.load, the weights files and the weights generator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import models
from models.packing import pack
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


@pytest.mark.parametrize("name", ["smoother", "traveller"])
def test_every_loaded_tensor_is_the_file_tensor(name: str) -> None:
    # the file, read independently: a tensor skipped on load keeps its fresh init and differs
    stored = load_file(str(models.DEFAULT_MODEL_DIR / f"{name}.safetensors"))
    loaded = models.load(name, rollout_backend="eager").state_dict()
    assert sorted(loaded) == sorted(stored)
    for key, tensor in stored.items():
        assert torch.equal(loaded[key], tensor), f"{name}.{key} differs from the file"


def _resave_without(tmp_path: Path, drop: str | None = None, add: str | None = None) -> None:
    """Copy the bundled traveller to ``tmp_path/t.safetensors`` less or plus one tensor."""
    src = str(models.DEFAULT_MODEL_DIR / "traveller.safetensors")
    with safe_open(src, framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(src)
    if drop is not None:
        del tensors[drop]
    if add is not None:
        tensors[add] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata=meta)


def test_a_file_missing_a_tensor_is_refused(tmp_path: Path) -> None:
    _resave_without(tmp_path, drop="output_layer.bias")
    with pytest.raises(models.ModelLoadError, match=r"Missing key\(s\).*output_layer\.bias"):
        models.load("t", tmp_path, rollout_backend="eager")


def test_a_file_with_an_unknown_tensor_is_refused(tmp_path: Path) -> None:
    _resave_without(tmp_path, add="output_layer.scale")
    with pytest.raises(models.ModelLoadError, match=r"Unexpected key\(s\).*output_layer\.scale"):
        models.load("t", tmp_path, rollout_backend="eager")


def test_a_loaded_smoother_computes_with_its_stored_constants() -> None:
    stored = load_file(str(models.DEFAULT_MODEL_DIR / "smoother.safetensors"))
    model = models.load("smoother")
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y = model(pack([x])).data
    alpha, wx = stored["alpha_smooth"].double(), stored["wx"].double()
    s = x[0].double()
    expected = [torch.tanh(wx * s)]
    for t in range(1, 6):
        s = alpha * s + (1 - alpha) * x[t].double()
        expected.append(torch.tanh(wx * s))
    torch.testing.assert_close(y.double(), torch.stack(expected), atol=1e-5, rtol=0)


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
