"""TorchScript models (kind ``torchscript``): exported with ``rnnserve export
--torchscript``, loaded only when trusted, called with the packed-sequence signature, refused at
start-up with one line otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import rnnserve.service.cli
from examples.gru_encoder import gru_cell_loop, make, make_packed
from rnnserve import models
from rnnserve.models import export, torchscript
from rnnserve.models.packing import pack, unpack
from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import StartupError, preflight


class OneArgument(nn.Module):
    """The wrong signature: forward(x) only."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x)


class MixesSequences(nn.Module):
    """The right signature, but each row's answer depends on every row of the batch."""

    def forward(self, data: Tensor, batch_sizes: Tensor) -> Tensor:
        return data - data.mean(dim=0, keepdim=True)


class NotScriptable(nn.Module):
    """Eager PyTorch that TorchScript does not take (norm's keyword arguments)."""

    def forward(self, data: Tensor, batch_sizes: Tensor) -> Tensor:
        out: Tensor = data / data.norm(dim=-1, keepdim=True)
        return out


class OneRowShort(nn.Module):
    def forward(self, data: Tensor, batch_sizes: Tensor) -> Tensor:
        return data[1:]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ts")
    code = export.main(
        ["--torchscript", "--factory", "examples.gru_encoder:make_packed", "--name", "enc_ts",
         "--out-dir", str(d)]
    )  # fmt: skip
    assert code == 0
    return d


def test_export_writes_a_checked_archive_that_answers_like_the_original(
    exported: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert [p.name for p in exported.iterdir()] == ["enc_ts.torchscript.pt"]  # no leftovers
    assert models.available(exported) == ["enc_ts"]
    assert models.pickles(exported) == []  # the double suffix is not a pickle
    assert torchscript.read_meta(exported / "enc_ts.torchscript.pt") == {
        "input_size": 6,
        "output_size": 4,
    }
    model = models.load("enc_ts", exported, trust_torchscript=True)
    assert isinstance(model, models.TorchScriptModel)
    info = models.describe(model)
    assert info["kind"] == "torchscript"
    assert info["shapes"] == {"input": ["T", 6], "output": ["T", 4]}
    assert info["config"] == {"input_size": 6, "output_size": 4}
    assert info["parameters"] == sum(p.numel() for p in make().parameters())
    # a packed batch, sequence by sequence against the original module and a GRUCell loop
    original, packed_original = make().eval(), make_packed().eval()
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, 6, generator=gen) for n in (9, 1, 14, 4, 4)]
    with torch.no_grad():
        got = unpack(model(pack(xs)))
        for x, y in zip(xs, got, strict=True):
            torch.testing.assert_close(
                y, export.one_sequence(packed_original, x), atol=1e-5, rtol=0
            )
            torch.testing.assert_close(y, gru_cell_loop(original, x), atol=1e-5, rtol=0)


def test_the_export_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = export.main(
        ["--torchscript", "--factory", "examples.gru_encoder:make_packed", "--name", "e",
         "--out-dir", str(tmp_path)]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("\n") == 1
    assert "e.torchscript.pt (torchscript: input size 6, output size 4)" in out
    assert "RNNSERVE_TRUST_TORCHSCRIPT=true" in out


def test_refused_unless_trusted(exported: Path) -> None:
    path = exported / "enc_ts.torchscript.pt"
    with pytest.raises(models.ModelLoadError, match="refused unless trusted") as err:
        models.read("enc_ts", exported)
    assert str(path) in str(err.value)
    with pytest.raises(StartupError) as stop:
        preflight(Settings(model_dir=exported))
    line = str(stop.value)
    assert "\n" not in line
    assert line.startswith(f"{path}: ")
    assert "TorchScript files are code" in line
    assert "RNNSERVE_TRUST_TORCHSCRIPT=true" in line
    assert preflight(Settings(model_dir=exported, trust_torchscript=True)) == ["enc_ts"]
    assert rnnserve.service.cli.parse_settings(["--trust-torchscript"]).trust_torchscript is True
    assert Settings().trust_torchscript is False


def test_a_trusted_torchscript_default_is_refused_for_its_kind_not_for_trust(
    exported: Path,
) -> None:
    """--default-smoother naming a TorchScript model: with the trust setting the file is read
    and the refusal says what it is; without it, the refusal is about trust."""
    trusted = Settings(model_dir=exported, trust_torchscript=True, default_smoother="enc_ts")
    with pytest.raises(StartupError, match="'enc_ts' is a torchscript model, not a smoother"):
        rnnserve.service.cli.check_defaults(trusted, ["enc_ts"])
    untrusted = Settings(model_dir=exported, default_smoother="enc_ts")
    with pytest.raises(StartupError, match="refused unless trusted"):
        rnnserve.service.cli.check_defaults(untrusted, ["enc_ts"])


def script_to(tmp_path: Path, module: nn.Module, name: str, meta: bool = True) -> Path:
    path = tmp_path / f"{name}.torchscript.pt"
    scripted = torch.jit.script(module)
    if meta:
        torchscript.save(scripted, path, 3, 3)
    else:
        torch.jit.save(scripted, str(path))
    return path


@pytest.mark.parametrize(
    ("module", "words"),
    [
        (OneArgument(), ["its forward is (x: Tensor) -> Tensor", "rnnserve calls forward(data"]),
        (OneRowShort(), ["the probe call answered [5, 3]", "one float row per input row"]),
    ],
)
def test_a_wrong_signature_is_refused_at_start_up_with_one_line(
    tmp_path: Path, module: nn.Module, words: list[str]
) -> None:
    path = script_to(tmp_path, module, "bad")
    with pytest.raises(StartupError) as stop:
        preflight(Settings(model_dir=tmp_path, trust_torchscript=True))
    line = str(stop.value)
    assert "\n" not in line
    assert line.startswith(f"{path}: ")
    for w in words:
        assert w in line, line


def test_export_refuses_a_wrong_signature_and_a_module_that_mixes_sequences(
    tmp_path: Path,
) -> None:
    with pytest.raises(export.ExportError, match=r"OneArgument\.forward takes \(x\); rnnserve"):
        export.export_torchscript(OneArgument(), 3, "bad", tmp_path)
    with pytest.raises(export.ExportError, match=r"its forward is \(x: Tensor\)"):
        export.export_torchscript(torch.jit.script(OneArgument()), 3, "bad", tmp_path)
    with pytest.raises(export.ExportError, match="cannot be scripted") as err:
        export.export_torchscript(NotScriptable(), 3, "ns", tmp_path)
    assert "test_torchscript.py, line" in str(err.value)
    assert "data.norm(dim=-1" in str(err.value)
    with pytest.raises(export.CheckFailed, match="differs from yours"):
        export.export_torchscript(MixesSequences(), 3, "mix", tmp_path)
    assert models.available(tmp_path) == []  # nothing written


def test_widths_from_a_sidecar_when_the_archive_has_none(tmp_path: Path) -> None:
    path = script_to(tmp_path, MixesSequences(), "plain", meta=False)
    with pytest.raises(models.ModelLoadError, match="no input width") as err:
        models.read("plain", tmp_path, trust_torchscript=True)
    assert "plain.torchscript.json" in str(err.value)
    (tmp_path / "plain.torchscript.json").write_text('{"input_size": 5}')
    model = models.read("plain", tmp_path, trust_torchscript=True)
    assert models.describe(model)["shapes"] == {"input": ["T", 5], "output": ["T", 5]}
    (tmp_path / "plain.torchscript.json").write_text('{"input_size": 5, "output_size": 2}')
    with pytest.raises(models.ModelLoadError, match="output_size 2; the probe call answered 5"):
        models.read("plain", tmp_path, trust_torchscript=True)
    assert path.is_file()


def test_an_archive_under_a_pickles_name_and_two_files_for_one_name(
    exported: Path, tmp_path: Path
) -> None:
    shutil.copy(exported / "enc_ts.torchscript.pt", tmp_path / "enc.pt")
    with pytest.raises(StartupError, match=r"name it enc\.torchscript\.pt") as stop:
        preflight(Settings(model_dir=tmp_path, trust_torchscript=True))
    assert "RNNSERVE_TRUST_TORCHSCRIPT=true" in str(stop.value)
    (tmp_path / "enc.pt").unlink()
    shutil.copy(exported / "enc_ts.torchscript.pt", tmp_path / "smoother.torchscript.pt")
    shutil.copy(models.DEFAULT_MODEL_DIR / "smoother.safetensors", tmp_path)
    with pytest.raises(StartupError, match="two files"):
        preflight(Settings(model_dir=tmp_path, trust_torchscript=True))


def test_save_refuses_a_torchscript_model(exported: Path, tmp_path: Path) -> None:
    model = models.load("enc_ts", exported, trust_torchscript=True)
    with pytest.raises(TypeError, match="rnnserve export --torchscript"):
        models.save(model, tmp_path / "x.safetensors")
