"""Settings defaults with no RNNSERVE_* variable set, and what the CLI hands to uvicorn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import rnnserve.service.cli
from rnnserve.service.config import Settings

# The defaults users rely on; the host above all: loopback unless they opt in to 0.0.0.0.
DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 8000,
    "log_level": "info",
    "access_log": False,
    "model_dir": None,
    "device": "auto",
    "torch_threads": 1,
    "rollout_backend": "auto",
    "rollout_gemm_routes": "measured",
    "max_batch_size": 64,
    "max_batch_timesteps": 262_144,
    "max_delay_ms": 0.0,
    "max_queue_size": 1024,
    "max_request_bytes": 64 * 1024 * 1024,
    "max_sequences_per_request": 256,
    "max_sequence_length": 100_000,
    "max_request_timesteps": 1_000_000,
    "drain_timeout_s": 30.0,
}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No RNNSERVE_* variable, and a working directory with nothing in it."""
    for key in [k for k in os.environ if k.upper().startswith("RNNSERVE_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.mark.usefixtures("clean_env")
def test_defaults_without_environment() -> None:
    settings = Settings()
    assert {name: getattr(settings, name) for name in DEFAULTS} == DEFAULTS


@pytest.mark.usefixtures("clean_env")
def test_cli_without_flags_has_the_same_defaults() -> None:
    settings = Settings(_cli_parse_args=[])
    assert {name: getattr(settings, name) for name in DEFAULTS} == DEFAULTS


@pytest.mark.usefixtures("clean_env")
def test_environment_then_flags_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RNNSERVE_PORT", "9001")
    monkeypatch.setenv("RNNSERVE_MAX_DELAY_MS", "7.5")
    settings = Settings(_cli_parse_args=["--port", "9002"])
    assert settings.port == 9002  # the flag wins over the environment
    assert settings.max_delay_ms == 7.5
    assert settings.host == "127.0.0.1"


def _run_main(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake_run(app: Any, **kwargs: Any) -> None:
        seen.update(kwargs, app=app)

    monkeypatch.setattr(rnnserve.service.cli.uvicorn, "run", fake_run)
    monkeypatch.setattr(rnnserve.service.cli.logging, "basicConfig", lambda **kw: None)
    rnnserve.service.cli.main(argv)
    return seen


@pytest.mark.usefixtures("clean_env")
def test_rnnserve_binds_loopback_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _run_main(monkeypatch, [])
    assert seen["host"] == "127.0.0.1"
    assert seen["port"] == 8000
    assert seen["log_level"] == "info"
    assert seen["access_log"] is False
    assert seen["timeout_graceful_shutdown"] == 30
    assert seen["app"].state.settings.host == "127.0.0.1"


@pytest.mark.usefixtures("clean_env")
def test_rnnserve_passes_its_flags_to_uvicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--host", "::1", "--port", "0", "--log-level", "debug", "--access-log",
            "--drain-timeout-s", "2.5"]  # fmt: skip
    seen = _run_main(monkeypatch, argv)
    assert (seen["host"], seen["port"], seen["log_level"]) == ("::1", 0, "debug")
    assert seen["access_log"] is True
    assert seen["timeout_graceful_shutdown"] == 3  # whole seconds, rounded up


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="port"):
        Settings(port=70000)
    with pytest.raises(ValueError, match="max_delay_ms"):
        Settings(max_delay_ms=-1)
    with pytest.raises(ValueError, match="unknown_setting"):
        Settings(unknown_setting=1)  # type: ignore[call-arg]


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("name", ["drain_timeout_s", "max_delay_ms", "request_timeout_s"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_no_setting_takes_infinity_or_nan(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """Refused with the setting's name when read, not when used (drain_timeout_s=inf failed
    once the models had loaded)."""
    monkeypatch.setenv(f"RNNSERVE_{name.upper()}", value)
    with pytest.raises(ValueError, match=f"{name}[\\s\\S]*finite number"):
        Settings()
