"""models.load, the weights files and the weights generator."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rnnserve import models
from rnnserve.models import torchscript
from rnnserve.models.packing import pack
from rnnserve.models.recurrent import RecurrentConfig, RecurrentModel
from rnnserve.models.traveller import Traveller

ROOT = Path(__file__).resolve().parents[3]


def test_bundled_models() -> None:
    assert models.available() == ["smoother", "traveller"]


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


# -- from the mutation run (scripts/mutation.sh models/__init__.py) ----------------------------


def _meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        meta: dict[str, str] = f.metadata()
    return meta


def test_save_writes_kind_and_config_of_every_kind(tmp_path: Path) -> None:
    torch.manual_seed(0)
    smoother = models.build("smoother", {"feat_dim": 3})
    with torch.no_grad():
        smoother.alpha_smooth.copy_(torch.tensor([0.1, 0.2, 0.3]))
    recurrent = models.build("recurrent", {"cell": "gru", "input_size": 3, "hidden_size": 4})
    for name, model, kind, config in [
        ("s", smoother, "smoother", {"feat_dim": 3}),  # alpha is in the weights, not the config
        ("r", recurrent, "recurrent", {"cell": "gru", "input_size": 3, "hidden_size": 4,
                                       "num_layers": 1, "head_size": 1, "activation": "none",
                                       "bias": True, "head_bias": True}),
    ]:  # fmt: skip
        models.save(model, tmp_path / f"{name}.safetensors")
        meta = _meta(tmp_path / f"{name}.safetensors")
        assert meta["kind"] == kind
        assert json.loads(meta["config"]) == config
        loaded = models.load(name, tmp_path)
        assert type(loaded) is type(model)
        assert loaded.state_dict().keys() == model.state_dict().keys()
        for key, value in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), f"{name}.{key}"


def test_build_each_kind_and_refuse_unknown_ones() -> None:
    recurrent = models.build("recurrent", {"cell": "lstm", "input_size": 2, "hidden_size": 3})
    assert isinstance(recurrent, RecurrentModel)
    assert recurrent.config == RecurrentConfig("lstm", 2, 3)
    smoother = models.build("smoother", {"feat_dim": 5})
    assert isinstance(smoother, models.LinearRecursion)
    assert smoother.feat_dim == 5
    with pytest.raises(ValueError, match=r"^unknown model kind") as err:
        models.build("nope", {})
    assert str(err.value) == (
        "unknown model kind 'nope'; known kinds: smoother, traveller, recurrent"
    )


def test_not_an_rnnserve_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError) as err:
        models.save(torch.nn.Linear(2, 2), tmp_path / "x.safetensors")
    assert str(err.value) == "not an rnnserve model: Linear"
    with pytest.raises(TypeError) as err:
        models.describe(torch.nn.GRU(2, 2))
    assert str(err.value) == "not an rnnserve model: GRU"
    with pytest.raises(TypeError) as err:
        models.kind_of(torch.nn.Linear(2, 2))
    assert str(err.value) == "not an rnnserve model: Linear"


def test_describe_every_kind() -> None:
    assert models.describe(models.load("smoother")) == {
        "kind": "smoother",
        "config": {"feat_dim": 16},
        "shapes": {"input": ["T", 16], "output": ["T", 16]},
        "parameters": 32,
        "device": "cpu",
        "dtype": "float32",
    }
    assert models.describe(models.load("traveller", rollout_backend="eager")) == {
        "kind": "traveller",
        "config": {"num_inputs": 6, "hidden_size": 128, "num_layers": 2, "dropout": 0.0,
                   "rollout_backend": "eager"},
        "shapes": {"input": ["T", 6], "output": ["T", 2]},
        "parameters": 203010,
        "device": "cpu",
        "dtype": "float32",
    }  # fmt: skip
    config = {"cell": "gru", "input_size": 3, "hidden_size": 4, "head_size": 2}
    assert models.describe(models.build("recurrent", config).double()) == {
        "kind": "recurrent",
        "config": {**config, "num_layers": 1, "activation": "none", "bias": True,
                   "head_bias": True},
        "shapes": {"input": ["T", 3], "output": ["T", 2]},
        "parameters": 3 * (3 * 4 + 4 * 4 + 2 * 4) + 4 * 2 + 2,
        "device": "cpu",
        "dtype": "float64",
    }  # fmt: skip


def test_loaded_models_are_frozen_and_on_the_device() -> None:
    model = models.load("smoother")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    on_meta = models.load("smoother", device="meta")
    assert {p.device.type for p in on_meta.parameters()} == {"meta"}
    assert models.describe(on_meta)["device"] == "meta"


def test_pickles_lists_only_pickle_files(tmp_path: Path) -> None:
    for name in ("a.pt", "b.pkl", "c.safetensors", "d.txt", "e.ckpt"):
        (tmp_path / name).write_bytes(b"x")
    assert models.pickles(tmp_path) == [tmp_path / "a.pt", tmp_path / "b.pkl", tmp_path / "e.ckpt"]
    assert models.pickles(str(tmp_path)) == models.pickles(tmp_path)
    assert models.pickles(tmp_path / "missing") == []
    assert models.pickles() == []  # the shipped weights are safetensors only


def test_first_line() -> None:
    assert models._first_line(ValueError("one\ntwo")) == "one"
    assert models._first_line(ValueError("  padded  ")) == "padded"
    assert models._first_line(KeyError()) == "KeyError"


DENIED = (
    "cannot read the file: permission denied (the server's user cannot read it: make it "
    "readable, e.g. chmod 644)"
)


def test_unreadable_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _resave_without(tmp_path)
    path = tmp_path / "t.safetensors"

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    def as_safetensors_says(*args: object, **kwargs: object) -> None:
        # safetensors turns every failure to open into this, whatever the reason
        raise FileNotFoundError(f"No such file or directory: {path}")

    monkeypatch.setattr(models, "open", denied, raising=False)
    monkeypatch.setattr(models, "safe_open", as_safetensors_says)
    with pytest.raises(models.ModelLoadError) as err:
        models.read("t", tmp_path)
    assert str(err.value) == f"{path}: {DENIED}"

    monkeypatch.undo()

    def gone(*args: object, **kwargs: object) -> None:
        raise OSError("Disk went away")

    monkeypatch.setattr(models, "safe_open", gone)
    with pytest.raises(models.ModelLoadError) as err:
        models.read("t", tmp_path)
    assert str(err.value) == f"{path}: cannot read the file: disk went away"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_the_server_cannot_read_says_permission_denied(tmp_path: Path) -> None:
    _resave_without(tmp_path)
    path = tmp_path / "t.safetensors"
    path.chmod(0)
    with pytest.raises(models.ModelLoadError) as err:
        models.read("t", tmp_path)
    assert str(err.value) == f"{path}: {DENIED}"


def test_not_safetensors_is_refused_with_the_library_reason(tmp_path: Path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(Exception, match="header") as lib:  # the library's words, independently
        safe_open(str(path), framework="pt")
    reason = str(lib.value).splitlines()[0]
    with pytest.raises(models.ModelLoadError) as err:
        models.read("junk", tmp_path)
    assert str(err.value) == (
        f"{path}: not a valid safetensors file ({reason}); write your model with rnnserve "
        "export (or rnnserve.models.save), or move this file out of the model directory"
    )


@pytest.mark.parametrize("meta", [{"kind": "traveller"}, {"config": "{}"}])
def test_half_the_metadata_is_refused(tmp_path: Path, meta: dict[str, str]) -> None:
    save_file({"wx": torch.ones(3)}, str(tmp_path / "half.safetensors"), metadata=meta)
    with pytest.raises(models.ModelLoadError, match="no rnnserve metadata"):
        models.read("half", tmp_path)


def test_bad_metadata_message(tmp_path: Path) -> None:
    path = tmp_path / "b.safetensors"
    save_file({"wx": torch.ones(3)}, str(path), metadata={"kind": "smoother", "config": "[1]"})
    with pytest.raises(models.ModelLoadError) as err:
        models.read("b", tmp_path)
    assert str(err.value) == (
        f"{path}: bad metadata (kind 'smoother', config '[1]'): config is not a JSON object"
    )
    save_file({"wx": torch.ones(3)}, str(path), metadata={"kind": "mlp", "config": "{}"})
    with pytest.raises(models.ModelLoadError) as err:
        models.read("b", tmp_path)
    assert str(err.value) == (
        f"{path}: bad metadata (kind 'mlp', config '{{}}'): unknown model kind 'mlp'; "
        "known kinds: smoother, traveller, recurrent"
    )


def test_tensors_that_do_not_fit_are_all_named(tmp_path: Path) -> None:
    # an unexpected key and two size mismatches: torch's message has four lines
    src = str(models.DEFAULT_MODEL_DIR / "smoother.safetensors")
    meta = _meta(Path(src))
    save_file(
        {"alpha_smooth": torch.zeros(3), "wx": torch.zeros(2), "extra": torch.zeros(1)},
        str(tmp_path / "s.safetensors"),
        metadata=meta,
    )
    with pytest.raises(models.ModelLoadError) as err:
        models.read("s", tmp_path)
    prefix = f"{tmp_path / 's.safetensors'}: the tensors do not fit a smoother with config "
    assert str(err.value).startswith(prefix + '{"feat_dim": 16}: ')
    detail = str(err.value).removeprefix(prefix + '{"feat_dim": 16}: ')
    assert detail == (
        'Unexpected key(s) in state_dict: "extra". '
        "size mismatch for alpha_smooth: copying a param with shape torch.Size([3]) from "
        "checkpoint, the shape in current model is torch.Size([16]). "
        "size mismatch for wx: copying a param with shape torch.Size([2]) from checkpoint, "
        "the shape in current model is torch.Size([16])."
    )


def test_a_config_torch_cannot_build_is_bad_metadata(tmp_path: Path) -> None:
    # torch raises RuntimeError (not ValueError) for a negative size: still a ModelLoadError
    path = tmp_path / "neg.safetensors"
    config = '{"feat_dim": -1}'
    save_file({"wx": torch.ones(3)}, str(path), metadata={"kind": "smoother", "config": config})
    with pytest.raises(models.ModelLoadError) as err:
        models.read("neg", tmp_path)
    assert str(err.value) == (
        f"{path}: bad metadata (kind 'smoother', config '{config}'): "
        "Trying to create tensor with negative dimension -1: [-1]"
    )


class _Twice(torch.nn.Module):
    def forward(self, data: torch.Tensor, batch_sizes: torch.Tensor) -> torch.Tensor:
        return data * 2.0


def test_torchscript_files_are_refused_unless_trusted(tmp_path: Path) -> None:
    path = tmp_path / "tw.torchscript.pt"
    torchscript.save(torch.jit.script(_Twice()), path, 3, 3)
    assert models.torchscript_files(tmp_path) == [path]
    assert models.torchscript_files() == []  # none ship with rnnserve
    refused = (
        f"{path}: a TorchScript file is code that runs when it is loaded; refused unless "
        "trusted (trust_torchscript)"
    )
    for call in (models.load, models.read):
        with pytest.raises(models.ModelLoadError) as err:
            call("tw", tmp_path)
        assert str(err.value) == refused
    model = models.load("tw", tmp_path, trust_torchscript=True)
    assert isinstance(model, models.TorchScriptModel)
    info = models.describe(model)
    assert (info["kind"], info["parameters"], info["device"], info["dtype"]) == (
        "torchscript", 0, "cpu", "float32"
    )  # fmt: skip
    with pytest.raises(TypeError) as terr:
        models.save(model, tmp_path / "x.safetensors")
    assert str(terr.value) == (
        "a TorchScript model is code, not a safetensors file: write it with "
        "rnnserve export --torchscript (rnnserve.models.torchscript.save)"
    )
