"""The README stays true: its two commands, every setting and every metric."""

from __future__ import annotations

import re
from pathlib import Path

from rnnserve.service.config import Settings
from rnnserve.service.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_first_block_holds_exactly_the_two_commands_and_ci_runs_the_test_one() -> None:
    first = re.search(r"```[a-z]*\n(.*?)```", README, re.S)
    assert first is not None
    lines = [ln for ln in first.group(1).splitlines() if ln.strip()]
    assert len(lines) == 2
    start, test = lines
    assert "rnnserve" in start
    assert "pytest" in test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci, "CI must run the README's test command verbatim"


def test_every_setting_is_documented_with_its_default() -> None:
    for name, field in Settings.model_fields.items():
        env = f"RNNSERVE_{name.upper()}"
        row = next((ln for ln in README.splitlines() if ln.startswith(f"| `{env}`")), None)
        assert row is not None, f"{env} missing from README"
        assert f"`--{name.replace('_', '-')}`" in row
        default = field.default
        if default is not None:
            shown = str(default).lower() if isinstance(default, bool) else str(default)
            # the default column itself: the description may name other values (0.0.0.0)
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[2] == f"`{shown}`", f"{env}: README default differs from {default!r}"


def test_every_metric_is_documented() -> None:
    families = list(Metrics().registry.collect())
    assert len(families) >= 10
    for fam in families:
        name = fam.name + ("_total" if fam.type == "counter" else "")
        assert f"`{name}`" in README, f"{name} missing from README's metrics table"
