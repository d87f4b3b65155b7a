"""``rnnserve export``: a user's checkpoint or module in, a checked safetensors
file out."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from examples.gru_encoder import GRUEncoder, gru_cell_loop, make, make_packed
from rnnserve import models
from rnnserve.models import export
from rnnserve.models.packing import pack, unpack
from rnnserve.models.recurrent import RecurrentModel
from rnnserve.models.torchscript import clip


class Tagger(nn.Module):
    """A user's LSTM tagger: their names (lstm, fc), batch_first, a wrapped checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 16, num_layers=3, batch_first=True)
        self.fc = nn.Linear(16, 3)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = export.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_gru_encoder_round_trip_against_a_gru_cell_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = make().eval()
    torch.save(user.state_dict(), tmp_path / "enc.pt")
    code, out, err = run(
        capsys, "--checkpoint", str(tmp_path / "enc.pt"), "--name", "gru_encoder",
        "--out-dir", str(tmp_path / "m"), "--activation", "l2_normalize",
    )  # fmt: skip
    assert code == 0, err
    assert out.count("\n") == 1
    assert "gru_encoder.safetensors" in out
    assert "hidden size 200, 2 layer(s), head size 4" in out
    assert models.available(tmp_path / "m") == ["gru_encoder"]  # no leftovers
    model = models.load("gru_encoder", tmp_path / "m")
    assert isinstance(model, RecurrentModel)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, 6, generator=gen) for n in (12, 1, 30, 7)]
    with torch.no_grad():
        got = unpack(model(pack(xs)))
        for x, y in zip(xs, got, strict=True):
            torch.testing.assert_close(y, gru_cell_loop(user, x), atol=1e-5, rtol=0)
            torch.testing.assert_close(y, user(x[:, None])[:, 0], atol=1e-5, rtol=0)


def test_factory_with_the_users_own_forward(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _out, err = run(
        capsys, "--factory", "examples.gru_encoder:make", "--name", "enc",
        "--out-dir", str(tmp_path), "--activation", "l2_normalize",
    )  # fmt: skip
    assert code == 0, err
    model = models.load("enc", tmp_path)
    x = torch.randn(9, 6)
    with torch.no_grad():
        torch.testing.assert_close(unpack(model(pack([x])))[0], make()(x[:, None])[:, 0])


def test_batch_first_lstm_with_other_names_in_a_wrapped_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(4)
    user = Tagger().eval()
    torch.save({"epoch": 3, "state_dict": user.state_dict()}, tmp_path / "ckpt.pth")
    code, _, err = run(
        capsys, "--checkpoint", str(tmp_path / "ckpt.pth"), "--name", "tagger",
        "--out-dir", str(tmp_path / "m"), "--activation", "sigmoid", "--cell", "lstm",
        "--num-layers", "3",
    )  # fmt: skip
    assert code == 0, err
    model = models.load("tagger", tmp_path / "m")
    x = torch.randn(11, 5)
    with torch.no_grad():
        want = torch.sigmoid(user.fc(user.lstm(x[None])[0][0]))
        torch.testing.assert_close(unpack(model(pack([x])))[0], want, atol=1e-6, rtol=0)


def test_a_safetensors_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    user = GRUEncoder(3, 8, 2)
    tensors = {k: v.contiguous() for k, v in user.state_dict().items()}
    save_file(tensors, str(tmp_path / "enc.safetensors"))
    code, _, err = run(
        capsys, "--checkpoint", str(tmp_path / "enc.safetensors"), "--name", "e",
        "--out-dir", str(tmp_path / "m"), "--activation", "none",
    )  # fmt: skip
    assert code == 0, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--hidden-size", "100"], "do not fit a GRU with input size 6, hidden size 100"),
        (["--cell", "lstm"], "size mismatch for gru.weight_ih_l0"),
        (["--num-layers", "3"], "weight_ih_l2"),
    ],
)
def test_a_checkpoint_with_wrong_shapes_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    torch.save(GRUEncoder().state_dict(), tmp_path / "enc.pt")
    code, out, err = run(
        capsys, "--checkpoint", str(tmp_path / "enc.pt"), "--name", "e",
        "--out-dir", str(tmp_path / "m"), "--activation", "none", *flags,
    )  # fmt: skip
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1, err
    assert message in err, err
    assert models.available(tmp_path / "m") == []


def test_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(GRUEncoder(), tmp_path / "whole.pt")  # a pickled module, not a state_dict
    code, _, err = run(capsys, "--checkpoint", str(tmp_path / "whole.pt"), "--name", "e",
                       "--out-dir", str(tmp_path), "--activation", "none")  # fmt: skip
    assert code == 2
    assert "weights_only=True" in err
    assert err.count("\n") == 1
    state = {**GRUEncoder().state_dict(), "extra.scale": torch.ones(4)}
    torch.save(state, tmp_path / "extra.pt")
    code, _, err = run(capsys, "--checkpoint", str(tmp_path / "extra.pt"), "--name", "e",
                       "--out-dir", str(tmp_path), "--activation", "none")  # fmt: skip
    assert code == 2
    assert "extra.scale" in err
    bi = nn.GRU(3, 4, bidirectional=True)
    torch.save({**{f"gru.{k}": v for k, v in bi.state_dict().items()},
                "fc.weight": torch.ones(2, 8)}, tmp_path / "bi.pt")  # fmt: skip
    code, _, err = run(capsys, "--checkpoint", str(tmp_path / "bi.pt"), "--name", "e",
                       "--out-dir", str(tmp_path), "--activation", "none")  # fmt: skip
    assert code == 2
    assert "bidirectional" in err


def test_a_failed_check_exits_1_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save(GRUEncoder(3, 8, 2).state_dict(), tmp_path / "enc.pt")
    code, _, err = run(
        capsys, "--checkpoint", str(tmp_path / "enc.pt"), "--name", "e",
        "--out-dir", str(tmp_path / "m"), "--activation", "none", "--tolerance", "-1",
    )  # fmt: skip
    assert code == 1
    assert err.startswith("rnnserve export: check failed: sequence 0")
    assert err.count("\n") == 1
    assert list((tmp_path / "m").iterdir()) == []


def test_the_command_line(tmp_path: Path) -> None:
    torch.save(GRUEncoder(3, 8, 2).state_dict(), tmp_path / "enc.pt")
    done = subprocess.run(
        [str(Path(sys.executable).with_name("rnnserve")), "export",
         "--checkpoint", str(tmp_path / "enc.pt"),
         "--name", "e", "--out-dir", str(tmp_path / "m"), "--activation", "none",
         "--hidden-size", "9"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_the_activation_is_required(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(GRUEncoder(3, 8, 2).state_dict(), tmp_path / "enc.pt")
    with pytest.raises(SystemExit) as done:
        export.main(["--checkpoint", str(tmp_path / "enc.pt"), "--name", "e",
                     "--out-dir", str(tmp_path / "m")])  # fmt: skip
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rnnserve export"), err
    assert err.splitlines()[-1] == (
        "rnnserve export: error: --activation is required (the weights do not hold it): one of "
        "none, tanh, sigmoid, l2_normalize"
    )
    assert not (tmp_path / "m").exists()


def test_the_activation_does_not_apply_to_torchscript(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        export.main(["--torchscript", "--factory", "examples.gru_encoder:make_packed",
                     "--name", "e", "--out-dir", "unused", "--activation", "tanh"])  # fmt: skip
    assert "--activation is for the recurrent kind" in capsys.readouterr().err


def test_an_exported_file_is_readable_by_the_server_user(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save(GRUEncoder(3, 8, 2).state_dict(), tmp_path / "enc.pt")
    code, _, err = run(
        capsys, "--checkpoint", str(tmp_path / "enc.pt"), "--name", "e",
        "--out-dir", str(tmp_path / "m"), "--activation", "tanh",
    )  # fmt: skip
    assert code == 0, err
    assert stat.S_IMODE((tmp_path / "m" / "e.safetensors").stat().st_mode) == 0o644


def test_a_torchscript_file_is_readable_by_the_server_user(tmp_path: Path) -> None:
    path, _, _ = export.export_torchscript(make_packed(), 6, "ts", tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_refusal_names_the_file_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(GRUEncoder(), tmp_path / "whole.pt")
    code, _, err = run(capsys, "--checkpoint", str(tmp_path / "whole.pt"), "--name", "e",
                       "--out-dir", str(tmp_path), "--activation", "none")  # fmt: skip
    assert code == 2
    assert err.count(str(tmp_path / "whole.pt")) == 1, err
    assert err.startswith(f"rnnserve export: {tmp_path / 'whole.pt'}: cannot be read"), err
    assert "\x1b" not in err
    # the reason torch gives last is the one that says what was refused
    assert "Unsupported global: GLOBAL examples.gru_encoder.GRUEncoder" in err, err
    assert err.rstrip("\n").endswith("save model.state_dict(), not the model"), err


def test_a_message_loses_its_colours_and_is_cut_between_words() -> None:
    bold = "\x1b[1mdo those steps only if you trust it\x1b[0m. \n\tmore"
    assert clip(bold) == "do those steps only if you trust it. more"
    long = " ".join(["word"] * 100)  # 499 characters
    cut = clip(long, limit=50)
    assert cut == " ".join(["word"] * 9) + "..."  # 44 + 3: "word" is never cut in two
    assert clip("x" * 60, limit=50) == "x" * 47 + "..."  # one word longer than the line
    assert clip("short", limit=50) == "short"


def test_no_linear_head_is_said_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rnn = {f"gru.{k}": v for k, v in nn.GRU(3, 4).state_dict().items()}
    torch.save(rnn, tmp_path / "nohead.pt")
    code, _, err = run(capsys, "--checkpoint", str(tmp_path / "nohead.pt"), "--name", "e",
                       "--out-dir", str(tmp_path), "--activation", "none")  # fmt: skip
    assert code == 2
    assert "the checkpoint has no linear head (no <prefix>.weight tensor)" in err, err
    two = {**rnn, "fc.weight": torch.ones(2, 4), "proj.weight": torch.ones(2, 4)}
    torch.save(two, tmp_path / "two.pt")
    code, _, err = run(capsys, "--checkpoint", str(tmp_path / "two.pt"), "--name", "e",
                       "--out-dir", str(tmp_path), "--activation", "none")  # fmt: skip
    assert code == 2
    assert "the checkpoint has several linear heads (fc, proj)" in err, err


def test_a_module_without_a_head_is_said_as_such() -> None:
    with pytest.raises(export.ExportError) as err:
        export.find_in_module(nn.Sequential(nn.GRU(3, 4)))
    assert str(err.value) == (
        "Sequential has no nn.Linear head (name it with --rnn-key / --head-key)"
    )


USERS_MODELS = """
# the user's own `models` package: rnnserve must never import it
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("yes")
"""

USERS_FACTORY = """
from torch import nn


class Mine(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 8)
        self.fc = nn.Linear(8, 2)


def make():
    return Mine()
"""


def test_the_command_ignores_the_users_own_models_package(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text(USERS_MODELS)
    (tmp_path / "mine.py").write_text(USERS_FACTORY)
    torch.save(GRUEncoder(3, 8, 2).state_dict(), tmp_path / "enc.pt")
    command = [str(Path(sys.executable).with_name("rnnserve")), "export"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for source in (["--checkpoint", "enc.pt"], ["--factory", "mine:make"]):
        done = subprocess.run(
            [*command, *source, "--name", source[1].split(".")[0].split(":")[0],
             "--out-dir", "served", "--activation", "sigmoid"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("wrote served/"), done.stdout
    assert not (tmp_path / "models" / "IMPORTED").exists()
    assert models.available(tmp_path / "served") == ["enc", "mine"]


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_dir_that_cannot_be_written_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    torch.save(GRUEncoder(3, 8, 2).state_dict(), tmp_path / "enc.pt")
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker if where == "a file" else blocker / "m"
    with pytest.raises(SystemExit) as done:
        export.main(["--checkpoint", str(tmp_path / "enc.pt"), "--name", "e",
                     "--activation", "tanh", "--out-dir", str(out)])  # fmt: skip
    assert done.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith(f"rnnserve export: error: --out-dir {out}: ")
    )


@pytest.mark.parametrize(
    ("source", "said"),
    [("def make(:\n", "raised SyntaxError"), ("def make():\n    raise ValueError('boom')\n",
                                              "raised ValueError: boom")],
)  # fmt: skip
def test_a_factory_that_raises_is_refused_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    said: str,
) -> None:
    (tmp_path / "users_factory.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run(capsys, "--factory", "users_factory:make", "--name", "e",
                       "--activation", "tanh", "--out-dir", str(tmp_path / "m"))  # fmt: skip
    assert code == 2
    assert said in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
