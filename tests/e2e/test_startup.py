"""Fail closed at start-up: a real ``rnnserve`` exits non-zero with one line naming the problem."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import StartupError, preflight

EXE = str(Path(sys.executable).with_name("rnnserve"))


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    return subprocess.run(
        [EXE, "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
        check=False,
    )


def folder(tmp_path: Path, kind: str) -> Path:
    d = tmp_path / kind
    d.mkdir()
    good = d / "smoother.safetensors"
    if kind == "pickle":
        models.save(LinearRecursion(4), good)
        torch.save(LinearRecursion(4).state_dict(), d / "mine.pt")
    elif kind == "random-bytes":
        good.write_bytes(os.urandom(256))
    elif kind == "no-metadata":
        save_file({"wx": torch.ones(4), "alpha_smooth": torch.ones(4)}, str(good))
    elif kind == "wrong-shapes":
        tensors = {"wx": torch.ones(4), "alpha_smooth": torch.ones(5)}
        save_file(tensors, str(good), metadata={"kind": "smoother", "config": '{"feat_dim": 4}'})
    elif kind == "missing-tensor":
        tensors = {"wx": torch.ones(4)}
        save_file(tensors, str(good), metadata={"kind": "smoother", "config": '{"feat_dim": 4}'})
    elif kind == "unknown-kind":
        save_file({"w": torch.ones(1)}, str(good), metadata={"kind": "gru", "config": "{}"})
    return d


CASES = [
    ("missing", lambda d: ["--model-dir", str(d / "nope")], ["nope", "no such directory"]),
    ("empty", lambda d: ["--model-dir", str(folder(d, "empty"))], ["holds no", "nothing to serve"]),
    (
        "pickle",
        lambda d: ["--model-dir", str(folder(d, "pickle"))],
        ["mine.pt", "refused", "rnnserve export", "move the file out"],
    ),
    (
        "random bytes",
        lambda d: ["--model-dir", str(folder(d, "random-bytes"))],
        ["smoother.safetensors", "not a valid safetensors file"],
    ),
    (
        "no metadata",
        lambda d: ["--model-dir", str(folder(d, "no-metadata"))],
        ["smoother.safetensors", "no rnnserve metadata"],
    ),
    (
        "wrong shapes",
        lambda d: ["--model-dir", str(folder(d, "wrong-shapes"))],
        ["smoother.safetensors", "do not fit", "alpha_smooth"],
    ),
    (
        "missing tensor",
        lambda d: ["--model-dir", str(folder(d, "missing-tensor"))],
        ["smoother.safetensors", "do not fit", "alpha_smooth"],
    ),
    (
        "unknown kind",
        lambda d: ["--model-dir", str(folder(d, "unknown-kind"))],
        ["smoother.safetensors", "unknown model kind 'gru'"],
    ),
    ("bad device", lambda d: ["--device", "gpu"], ["--device", "unknown device 'gpu'"]),
    ("zero batch", lambda d: ["--max-batch-size", "0"], ["--max-batch-size", "greater than"]),
]
if not torch.cuda.is_available():
    CASES.append(("no cuda", lambda d: ["--device", "cuda"], ["--device cuda", "not available"]))


def _cli_args(args: list[str]) -> dict[str, object]:
    """``["--model-dir", "x"]`` -> ``{"model_dir": "x"}``."""
    flags = zip(args[::2], args[1::2], strict=True)
    return {k.removeprefix("--").replace("-", "_"): v for k, v in flags}


@pytest.mark.parametrize(("args", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_preflight_names_the_problem(tmp_path: Path, args: object, words: list[str]) -> None:
    """In-process, every case: the settings or the start-up check refuse, naming the problem."""
    argv = args(tmp_path)  # type: ignore[operator]
    with pytest.raises((StartupError, ValidationError)) as info:
        preflight(Settings(**_cli_args(argv)))  # type: ignore[arg-type]
    text = (
        str(info.value).replace("max_batch_size", "--max-batch-size").replace("device", "--device")
    )
    for word in words:
        assert word.removeprefix("--device ").split()[0].strip("'") in text, text


E2E = {"missing", "pickle", "random bytes", "wrong shapes", "bad device", "zero batch", "no cuda"}


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "words"),
    [c[1:] for c in CASES if c[0] in E2E],
    ids=[c[0] for c in CASES if c[0] in E2E],
)
def test_fails_closed_with_one_line(tmp_path: Path, args: object, words: list[str]) -> None:
    """A real process: exit non-zero, one line on stderr, the port never opened."""
    proc = run(tmp_path, *args(tmp_path))  # type: ignore[operator]
    assert proc.returncode != 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # one line, no traceback
    assert lines[0].startswith("rnnserve: ")
    for word in words:
        assert word in lines[0], lines[0]
    assert "Uvicorn running" not in proc.stderr + proc.stdout  # the port never opened


def test_a_busy_port_is_reported_before_any_model_loads(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        for workers in ("1", "2"):
            r = subprocess.run(
                [EXE, "--port", str(port), "--workers", workers],
                capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path, check=False,
            )  # fmt: skip
            assert r.returncode != 0
            assert f"rnnserve: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
            assert "warmed" not in r.stderr  # no model was loaded ("loaded and warmed smoother")
            assert "Traceback" not in r.stderr


OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("variables", "workers", "words"),
    [
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "1", ["OTEL_TRACES_EXPORTER=jaeger", "not jaeger"]),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", OTLP_PROTOCOL: "grpc"},
            "2",
            ["OTLP protocol grpc", "http/protobuf"],
        ),
    ],
    ids=["unknown-exporter", "grpc-two-workers"],
)
def test_a_tracing_setting_rnnserve_cannot_honour_fails_closed_with_one_line(
    tmp_path: Path, variables: dict[str, str], workers: str, words: list[str]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RNNSERVE_", "OTEL_"))}
    proc = subprocess.run(
        [EXE, "--port", "0", "--workers", workers],
        capture_output=True, text=True, timeout=120, env={**env, **variables}, cwd=tmp_path,
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # one line, no traceback
    assert lines[0].startswith("rnnserve: ")
    for word in words:
        assert word in lines[0], lines[0]
    assert "warmed" not in proc.stderr  # refused before any model loads
