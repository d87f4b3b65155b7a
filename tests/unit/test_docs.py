"""The docs stay true: the README's two commands and dependencies, every setting, every metric."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from rnnserve.service.config import Settings
from rnnserve.service.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "CONFIGURATION.md").read_text()
METRICS = (ROOT / "docs" / "METRICS.md").read_text()


def test_first_block_holds_exactly_the_two_commands_and_ci_runs_the_test_one() -> None:
    first = re.search(r"```[a-z]*\n(.*?)```", README, re.S)
    assert first is not None
    lines = [ln for ln in first.group(1).splitlines() if ln.strip()]
    assert lines == [
        "./scripts/install.sh && .venv/bin/rnnserve",
        "./scripts/install.sh --test && .venv/bin/python -m pytest",
    ]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[1] in ci, "CI must run the README's test command verbatim"


def test_every_setting_is_documented_with_its_default() -> None:
    for name, field in Settings.model_fields.items():
        env = f"RNNSERVE_{name.upper()}"
        row = next((ln for ln in CONFIGURATION.splitlines() if ln.startswith(f"| `{env}`")), None)
        assert row is not None, f"{env} missing from docs/CONFIGURATION.md"
        assert f"`--{name.replace('_', '-')}`" in row
        default = field.default
        if default is not None:
            shown = str(default).lower() if isinstance(default, bool) else str(default)
            # the default column itself: the description may name other values (0.0.0.0)
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[2] == f"`{shown}`", f"{env}: documented default differs from {default!r}"


def test_every_documented_setting_exists() -> None:
    documented = re.findall(r"^\| `RNNSERVE_([A-Z_]+)`", CONFIGURATION, re.M)
    assert sorted(n.lower() for n in documented) == sorted(Settings.model_fields)


def test_every_metric_is_documented() -> None:
    families = list(Metrics().registry.collect())
    assert len(families) >= 10
    names = {fam.name + ("_total" if fam.type == "counter" else "") for fam in families}
    documented = set(re.findall(r"^\| `(rnnserve_[a-z_]+)` \|", METRICS, re.M))
    assert documented == names, (names - documented, documented - names)


def _runtime_dependencies() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0] for dep in project["dependencies"]]


def test_the_readme_says_why_each_runtime_dependency_is_there() -> None:
    section = README.split("## Why each dependency", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- `([a-z0-9_.-]+)(?:\[[a-z]+\])?`", section, re.M)
    assert sorted(listed) == sorted(_runtime_dependencies())


def test_the_readme_is_a_guide_not_a_reference() -> None:
    assert len(README.encode()) <= 15_000
    for page in ("API.md", "CONFIGURATION.md", "METRICS.md", "ARCHITECTURE.md"):
        assert f"(docs/{page}" in README, page
