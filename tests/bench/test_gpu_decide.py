"""The GPU decision script: its dry run on the CPU runs every step and writes results of the
shape the rules read, so that a GPU host's minutes are never lost to a Python error; and the
rules, budget and report checked on made-up results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_decide, gpu_rules
from tests.bench.test_bench_smoke import assert_tables_well_formed

ROOT = Path(__file__).resolve().parents[2]
DESIGNS = ("chunked", "chained", "lookback")


def _step_rows(out: Path, name: str) -> list[dict[str, Any]]:
    data = json.loads((out / f"{name}.json").read_text(encoding="utf-8"))
    assert data["done"] is True, name
    return list(data["rows"])


@pytest.mark.slow
def test_the_cpu_dry_run_runs_every_step_and_writes_what_the_rules_read(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_decide", "--cpu", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    blob = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    statuses = {name: s["status"] for name, s in blob["statuses"].items()}
    want = {s.name: "ok" for s in gpu_decide.STEPS} | {"ncu": "skipped"}
    assert statuses == want

    floors = _step_rows(tmp_path, "floors")
    assert [r["what"] for r in floors] == ["copy", "copy", "launch"]
    assert all(r["gpu_us"] > 0 for r in floors)
    assert all(r["wall_us"] > 0 for r in floors)
    for design in DESIGNS:
        rows = _step_rows(tmp_path, f"smoother-{design}")
        assert {tuple(r["shape"]) for r in rows} == {(3, 9), (1, 12)}
        for r in rows:
            assert r["design"] == design
            assert r["error"] <= gpu_rules.TOLERANCE  # the kernels against float64
            assert r["gpu_us"] > 0
            assert r["wall_us"] > 0
    host, compiles = _step_rows(tmp_path, "host")
    assert set(host["parts_us"]) == {
        "plan_tiles",
        "device_schedule",
        "prepare_forward",
        "launch_forward",
    }
    assert host["host_us"] == pytest.approx(host["wall_us"] - host["gpu_us"])
    assert compiles == {"what": "compiles after warm-up", "batches": 2, "compiles": None}
    rollout = _step_rows(tmp_path, "rollout")
    assert [tuple(r["shape"]) for r in rollout] == [(1, 6), (5, 4)]
    assert all(r["error"] <= gpu_rules.TOLERANCE for r in rollout)
    jax = _step_rows(tmp_path, "jax")
    assert [r["fn"] for r in jax] == ["smoother_associative_scan"] * 2 + [
        "traveller_rollout_scan"
    ] * 2
    assert all(r["error"] <= gpu_rules.TOLERANCE for r in jax)  # against the same references
    assert (
        "passed" in _step_rows(tmp_path, "tests")[0]["summary"]
        or "skipped" in (_step_rows(tmp_path, "tests")[0]["summary"])
    )
    e2e = _step_rows(tmp_path, "e2e")
    assert [r["device"] for r in e2e] == ["cpu"] * 3
    assert all(r["rps"] > 0 for r in e2e)

    report = (tmp_path / "decide.md").read_text(encoding="utf-8")
    assert report.index("## Predictions") < report.index("## Decision rules")
    assert report.index("## Decision rules") < report.index("## Steps")
    # the rules ran on the dry run's rows: the quick tiles stand in for the default plan
    assert "- Smoother: keep `chunked`" in report or "- Smoother: switch" in report
    assert_tables_well_formed(report)


def test_the_rules_are_written_before_any_step_runs(tmp_path: Path) -> None:
    run = gpu_decide.Run(tmp_path, cpu=True, quick=True, budget_s=60)
    run.write()
    report = (tmp_path / "decide.md").read_text(encoding="utf-8")
    for rule in gpu_rules.RULES:
        assert rule in report
    for quantity, predicted, target in gpu_rules.PREDICTIONS:
        assert f"| {quantity} | {predicted} | {target} |" in report
    assert report.count("| not run yet |") == len(gpu_decide.STEPS)


def test_a_step_cut_by_its_timeout_keeps_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    partial = {"step": "floors", "rows": [{"what": "copy", "gpu_us": 1.5}], "done": False}
    script = (
        "import json, sys, time; "
        f"open(sys.argv[1], 'w').write(json.dumps({partial!r})); time.sleep(60)"
    )
    monkeypatch.setattr(gpu_decide, "MIN_STEP_S", 0)
    monkeypatch.setattr(gpu_decide, "STEPS", (gpu_decide.Step("floors", 2),))
    run = gpu_decide.Run(tmp_path, cpu=True, quick=True, budget_s=30)
    monkeypatch.setattr(
        run, "command", lambda name: [sys.executable, "-c", script, str(tmp_path / "floors.json")]
    )
    t0 = time.monotonic()
    run.run_step(gpu_decide.STEPS[0])
    assert time.monotonic() - t0 < 30  # killed, not waited for
    assert run.statuses["floors"]["status"] == "timed out after 2 s"
    assert run.results["floors"]["rows"] == partial["rows"]
    report = (tmp_path / "decide.md").read_text(encoding="utf-8")
    assert "## floors (cut: what it had written)" in report


def test_a_step_gets_what_is_left_after_the_reserved_end_to_end_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = gpu_decide.Run(tmp_path, cpu=True, quick=True, budget_s=0)
    steps = {s.name: s for s in gpu_decide.STEPS}
    e2e = steps["e2e"].limit_s
    run.deadline = time.monotonic() + e2e + 30
    assert run.limit(steps["tests"]) == pytest.approx(30, abs=1)
    assert run.limit(steps["e2e"]) == e2e
    run.deadline = time.monotonic() + e2e + 1000
    assert run.limit(steps["smoother-chunked"]) == steps["smoother-chunked"].limit_s
    run.deadline = time.monotonic() + e2e + 3
    run.run_step(steps["tests"])  # under MIN_STEP_S left: skipped, not started
    assert run.statuses["tests"]["status"] == "skipped"
    assert "out of time" in run.statuses["tests"]["why"]


# --------------------------------------------------------------------------- the rules


SHAPES = ([256, 4000], [64, 1000], [1, 100_000])


def smoother_results(times: dict[tuple[str, str], list[float]], error: float = 1e-7) -> dict:
    rows: dict[str, list[dict[str, Any]]] = {}
    for (design, tiles), us in times.items():
        for shape, t in zip(SHAPES, us, strict=True):
            rows.setdefault(f"smoother-{design}", []).append(
                {
                    "design": design,
                    "tiles": tiles,
                    "shape": shape,
                    "error": error,
                    "gpu_us": t,
                    "wall_us": t + 50,
                }
            )
    return {name: {"rows": r, "done": True} for name, r in rows.items()}


def test_a_design_faster_everywhere_becomes_the_default() -> None:
    res = smoother_results(
        {("chunked", "default plan"): [100, 20, 200], ("chained", "default plan"): [70, 15, 190]}
    )
    (smoother, *_rest) = gpu_rules.decide(res)
    assert smoother.startswith("Smoother: switch the default to `chained` (default plan)")


def test_a_design_much_slower_on_one_shape_is_a_dispatch_candidate_not_the_default() -> None:
    res = smoother_results(
        {("chunked", "default plan"): [100, 20, 200], ("chained", "default plan"): [40, 8, 400]}
    )
    lines = gpu_rules.decide(res)
    assert lines[0].startswith("Smoother: keep `chunked`")
    assert "Dispatch candidate: `chained` (default plan) at B=256 T=4000: 2.5× faster." in lines
    assert "Dispatch candidate: `chained` (default plan) at B=64 T=1000: 2.5× faster." in lines


def test_a_small_gain_keeps_the_default() -> None:
    res = smoother_results(
        {("chunked", "default plan"): [100, 20, 200], ("chunked", "sub=8"): [95, 19, 190]}
    )
    assert gpu_rules.decide(res)[0].startswith("Smoother: keep `chunked`")


def test_a_candidate_off_against_float64_never_counts() -> None:
    res = smoother_results({("chunked", "default plan"): [100, 20, 200]})
    res |= smoother_results({("lookback", "default plan"): [10, 2, 20]}, error=1e-3)
    assert ("lookback", "default plan") not in gpu_rules.candidates(res)
    assert gpu_rules.decide(res)[0].startswith("Smoother: keep `chunked`")


def _rollout(default: list[float], pdl: list[float]) -> dict:
    shapes = ([1, 1000], [64, 500], [1024, 200])
    rows = [
        {"variant": v, "shape": s, "us_per_step": t, "error": 1e-8}
        for v, times in (("default", default), ("PDL", pdl))
        for s, t in zip(shapes, times, strict=True)
    ]
    return {"rollout": {"rows": rows, "done": True}}


def test_pdl_becomes_the_rollouts_default_only_if_faster_at_every_batch() -> None:
    assert gpu_rules.decide(_rollout([8, 14, 28], [7, 13, 26]))[-1].startswith(
        "Rollout: launch with PDL"
    )
    assert gpu_rules.decide(_rollout([8, 14, 28], [7, 13, 29]))[-1].startswith(
        "Rollout: keep launching without PDL"
    )


def test_targets_are_met_missed_or_unknown_from_the_run_alone() -> None:
    res = smoother_results({("chunked", "default plan"): [24, 30, 50]})
    res["floors"] = {
        "rows": [
            {"what": "copy", "shape": [256, 4000], "gpu_us": 20.0, "wall_us": 30.0},
            {"what": "copy", "shape": [64, 1000], "gpu_us": 10.0, "wall_us": 20.0},
        ]
    }
    res |= _rollout([5, 11, 15], [5, 11, 15])
    got = {target: (measured, met) for target, measured, met in gpu_rules.targets(res)}
    assert got["smoother GPU time, B=256 T=4000 ≤ 1.3× copy"][1] == "yes"  # 24 / 20
    assert got["smoother GPU time, B=64 T=1000 ≤ 2× copy"][1] == "no"  # 30 / 10
    assert got["smoother GPU time, B=1 T=100,000 ≤ 2× copy"] == ("not measured", "unknown")
    assert got["smoother per call ≤ 1.5× `copy_` call"] == ("2.47×", "no")  # 74 / 30
    rollout = {k: v for k, v in got.items() if k.startswith("rollout")}
    assert [met for _, met in rollout.values()] == ["yes", "no", "yes"]  # 5 ≤ 6, 11 > 10, 15
    assert got["`/smooth, 50–500 steps` cuda ≥ 1.0× cpu"] == ("not measured", "unknown")


def test_the_benchmarks_doc_states_the_same_predictions_rules_and_limits() -> None:
    """What docs/BENCHMARKS.md says the next run predicts and decides by is what it will."""
    doc = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    for quantity, predicted, target in gpu_rules.PREDICTIONS:
        assert f"| {quantity} | {predicted} | {target} |" in doc
    for i, rule in enumerate(gpu_rules.RULES, 1):
        assert f"{i}. {rule}" in doc
    for step in gpu_decide.STEPS:
        kept = " (kept)" if step.reserved else ""
        assert f"| `{step.name}` | {step.limit_s}{kept} |" in doc


def test_every_key_test_name_selects_a_gpu_test() -> None:
    """A renamed GPU test would drop out of the decision run's ``tests`` step unnoticed: each
    name in its ``-k`` expression must still match a test of tests/gpu."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/gpu"]
    listed = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
    tests = [line for line in listed.stdout.splitlines() if "::" in line]
    names = gpu_decide.KEY_TESTS.split(" or ")
    assert len(names) >= 8
    unmatched = [name for name in names if not any(name in test for test in tests)]
    assert unmatched == []
