"""One run on a GPU host that measures what decides the GPU defaults, in about seven minutes.

Usage::

    python -m bench.gpu_decide [--out DIR] [--budget-s 480] [--cpu --quick] [--only STEPS]

Steps, in order, each a process of its own under its own timeout, each writing its results to
``DIR/<step>.json`` as it goes (a step that is killed keeps what it had written):

1. ``env``: GPU (``nvidia-smi``), versions, commit;
2. ``floors``: a copy of each smoother shape's bytes (the memory floor, timed as the kernels
   are) and an empty Triton kernel's launch cost;
3. ``smoother-chunked``, ``smoother-chained``, ``smoother-lookback``: every forward design (and
   the chunked scan's ``sub`` tiles) on B=256 T=4000, B=64 T=1000, B=1 T=100,000: error against
   float64, GPU µs (graph replay of the inner entry over rotating inputs, CUDA events), wall µs
   per public call; one process per design, so a look-back hang costs only its own step;
4. ``host``: host overhead per public call on a one-sequence batch, its parts, and compiles
   over 200 random batches after warm-up;
5. ``rollout``: B = 1 / 64 / 1024, µs per step and error, with and without PDL;
6. ``jax``: JAX's ``associative_scan`` smoother and ``lax.scan`` rollout, in a process of their
   own (JAX and torch in one process died on an H200);
7. ``ncu``: Nsight Compute on a few kernels, if ``ncu`` is on the PATH (skipped otherwise);
8. ``tests``: the key ``tests/gpu`` tests;
9. ``e2e``: the service with ``--device cuda`` against ``--device cpu`` (``bench_gpu_e2e``).

The predictions and decision rules (:mod:`bench.gpu_rules`) are written at the top of
``DIR/decide.md`` before the first step; after every step the report is rewritten with what
has finished, the rules applied and the targets met. ``--budget-s`` bounds the whole run: a
step gets its own limit or what is left after reserving the end-to-end step's, whichever is
less, and is skipped when that is under ``MIN_STEP_S``.

``--cpu --quick`` is the dry run (CI runs it, ``tests/bench/test_gpu_decide.py``): every step on
tiny shapes in Triton's interpreter, so that a Python error costs no GPU minute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import gpu_rules

ROOT = Path(__file__).resolve().parents[1]
MIN_STEP_S = 10
KEY_TESTS = (
    "after_warm_up or inner_entry or forward_and_state or lookback_scan or chained_scan "
    "or matches_cpu_torchscript or graph_replay or chunked_rollout_on_cuda"
)
NCU_KERNELS = "regex:_fwd_replay|_fwd_chunk_summary|_fwd_chained|_layer_step_kernel"
NCU_METRICS = (
    "gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,"
    "sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,"
    "launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem"
)


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    reserved: bool = False  # its time is kept for it whatever the steps before it took


STEPS = (  # limits allow for Triton's first compiles on a fresh host (its disk cache is empty)
    Step("env", 20),
    Step("floors", 30),
    Step("smoother-chunked", 90),
    Step("smoother-chained", 40),
    Step("smoother-lookback", 40),
    Step("host", 50),
    Step("rollout", 50),
    Step("jax", 45),
    Step("ncu", 40),
    Step("tests", 80),
    Step("e2e", 120, reserved=True),
)


class Run:
    def __init__(self, out: Path, cpu: bool, quick: bool, budget_s: float) -> None:
        self.out, self.cpu, self.quick = out, cpu, quick
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.started = dt.datetime.now(dt.UTC)
        self.statuses: dict[str, dict[str, Any]] = {}
        self.results: dict[str, Any] = {}
        self.env = {k: v for k, v in os.environ.items()}
        self.env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        )
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        if cpu:
            self.env["TRITON_INTERPRET"] = "1"
        else:
            self.env.pop("TRITON_INTERPRET", None)  # real kernels, not the interpreter

    # -- the steps ----------------------------------------------------------------------------

    def mode(self) -> list[str]:
        return (["--cpu"] if self.cpu else []) + (["--quick"] if self.quick else [])

    def command(self, name: str) -> list[str] | str:
        """The step's command, or why it is skipped."""
        py, out = sys.executable, self.out
        if name.startswith("smoother-"):
            design = name.split("-", 1)[1]
            return [py, "-m", "bench.gpu_measure", "smoother", str(out / f"{name}.json"),
                    "--design", design, *self.mode()]  # fmt: skip
        if name in ("floors", "host", "rollout", "jax"):
            return [py, "-m", "bench.gpu_measure", name, str(out / f"{name}.json"), *self.mode()]
        if name == "env":
            return [py, "-m", "bench.gpu_decide", "--env", str(out / "env.json")]
        if name == "ncu":
            ncu = shutil.which("ncu")
            if ncu is None or self.cpu:
                return "ncu not on the PATH" if ncu is None else "no GPU to profile (--cpu)"
            return [ncu, "--csv", "--target-processes", "all", "-k", NCU_KERNELS, "-c", "8",
                    "--metrics", NCU_METRICS, py, "-m", "bench.gpu_measure", "ncu-target",
                    str(out / "ncu-target.json"), *self.mode()]  # fmt: skip
        if name == "tests":
            return [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "-k",
                    KEY_TESTS, "--timeout", "60"]  # fmt: skip
        if name == "e2e":
            devices = ["cpu", "--quick"] if self.cpu else ["cuda", "cpu"]
            return [py, "-m", "bench.bench_gpu_e2e", "--devices", *devices, "--out",
                    str(out / "bench_e2e.md"), "--json", str(out / "e2e.json")]  # fmt: skip
        raise ValueError(name)

    def limit(self, step: Step) -> float:
        left = self.deadline - time.monotonic()
        ahead = STEPS[STEPS.index(step) + 1 :]
        keep = sum(s.limit_s for s in ahead if s.reserved)
        return min(step.limit_s, left - keep) if not step.reserved else min(step.limit_s, left)

    def run_step(self, step: Step) -> None:
        cmd = self.command(step.name)
        limit = self.limit(step)
        if isinstance(cmd, str) or limit < MIN_STEP_S:
            why = cmd if isinstance(cmd, str) else f"out of time ({limit:.0f} s left for it)"
            self.statuses[step.name] = {"status": "skipped", "why": why, "seconds": 0.0}
            self.results[step.name] = {"step": step.name, "skipped": why, "rows": [], "done": True}
            self.write(step.name)
            return
        _log(f"{step.name} (limit {limit:.0f} s): {' '.join(cmd)}")
        log = self.out / f"{step.name}.log"
        t0 = time.monotonic()
        with log.open("w", encoding="utf-8") as sink:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else f"failed (exit {rc})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the step and whatever it started
                proc.wait()
                status = f"timed out after {limit:.0f} s"
        seconds = time.monotonic() - t0
        self.statuses[step.name] = {"status": status, "seconds": seconds, "limit_s": limit}
        self.results[step.name] = self.collect(step.name, log)
        self.write(step.name)

    def collect(self, name: str, log: Path) -> dict[str, Any]:
        """The step's results: its own JSON file, or what its log says (tests, ncu)."""
        text = log.read_text(encoding="utf-8", errors="replace")
        path = self.out / f"{name}.json"
        data: dict[str, Any]
        if name in ("tests", "ncu"):  # read from the log, written beside the others
            rows = [tests_summary(text)] if name == "tests" else ncu_rows(text)
            data = {"step": name, "rows": rows, "done": True}
            path.write_text(json.dumps(data, indent=1), encoding="utf-8")
            return data
        if path.exists():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                return data
            except json.JSONDecodeError:
                pass
        return {"step": name, "rows": [], "done": False, "log_tail": text[-2000:]}

    # -- the report ---------------------------------------------------------------------------

    def write(self, last: str | None = None) -> None:
        blob = {
            "started": self.started.isoformat(),
            "mode": "cpu dry run" if self.cpu else "gpu",
            "quick": self.quick,
            "budget_s": self.budget_s,
            "statuses": self.statuses,
            "results": self.results,
        }
        (self.out / "results.json").write_text(json.dumps(blob, indent=1, default=str))
        (self.out / "decide.md").write_text(render(self), encoding="utf-8")
        if last:
            _log(f"{last}: {self.statuses[last]['status']}; wrote {self.out / 'decide.md'}")


def tests_summary(text: str) -> dict[str, Any]:
    line = next(
        (
            ln
            for ln in reversed(text.splitlines())
            if re.search(r"\d+ (passed|failed|skipped|error|deselected)", ln)
        ),
        "no summary line",
    )
    counts = {
        kind: int(n)
        for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed)", line)
    }
    return {"summary": line.strip("= "), **counts}


def ncu_rows(text: str) -> list[dict[str, Any]]:
    """Nsight Compute's ``--csv`` lines: one row per kernel launch and metric."""
    import csv

    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = []
    for r in csv.DictReader(lines):
        name = r.get("Kernel Name", "")
        rows.append({"kernel": name[:40], "id": r.get("ID"), "metric": r.get("Metric Name"),
                     "unit": r.get("Metric Unit"), "value": r.get("Metric Value")})  # fmt: skip
    return rows


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:,.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items())
    if isinstance(v, list):
        return "×".join(str(x) for x in v)
    return str(v).replace("|", "/")


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["*(no rows)*"]
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return out


def header(run: Run) -> list[str]:
    """The part written before any step: what is predicted, and how the run decides."""
    mode = (
        "a dry run on the CPU (Triton's interpreter, tiny shapes: not a measurement)"
        if run.cpu
        else "GPU"
    )
    out = [
        "# GPU decision run (`python -m bench.gpu_decide`)",
        "",
        f"Started {run.started:%Y-%m-%d %H:%M UTC} on {platform.node()}; {mode}; budget "
        f"{run.budget_s:.0f} s. Written before the first step: the predictions and rules below.",
        "",
        "## Predictions and targets",
        "",
        "| quantity | predicted | target |",
        "|---|---|---|",
        *(f"| {q} | {p} | {t} |" for q, p, t in gpu_rules.PREDICTIONS),
        "",
        "## Decision rules",
        "",
        *(f"{i}. {rule}" for i, rule in enumerate(gpu_rules.RULES, 1)),
        "",
    ]
    return out


def render(run: Run) -> str:
    out = header(run)
    out += ["## Steps", "", "| step | status | seconds | limit s |", "|---|---|---|---|"]
    for step in STEPS:
        st = run.statuses.get(step.name)
        if st is None:
            out.append(f"| {step.name} | not run yet | | {step.limit_s} |")
            continue
        status = st["status"] + (f": {st['why']}" if "why" in st else "")
        out.append(f"| {step.name} | {status} | {st['seconds']:.0f} | {st.get('limit_s', 0):.0f} |")
    out.append("")
    for step in STEPS:
        res = run.results.get(step.name)
        if res is None or step.name == "env":
            continue
        note = "" if res.get("done") else " (cut: what it had written)"
        out += [f"## {step.name}{note}", ""]
        if res.get("skipped"):
            out += [f"Skipped: {res['skipped']}.", ""]
            continue
        out += [*table(res.get("rows", [])), ""]
    if "env" in run.results:
        out += ["## Environment", "", *table([run.results["env"].get("info", {})]), ""]
    out += ["## Decisions (the rules applied)", ""]
    out += [f"- {line}" for line in gpu_rules.decide(run.results)]
    out += ["", "## Targets", "", "| target | measured | met? |", "|---|---|---|"]
    out += [f"| {t} | {m} | {ok} |" for t, m, ok in gpu_rules.targets(run.results)]
    return "\n".join(out) + "\n"


def environment(path: Path) -> int:
    """The ``env`` step: GPU, versions, commit, CPUs."""
    import importlib

    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    for name in ("torch", "triton", "jax", "numba", "numpy"):
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception as e:
            info[name] = f"not importable ({type(e).__name__})"
    try:
        import torch

        info["cuda"] = torch.version.cuda if torch.cuda.is_available() else "none visible"
    except Exception as e:
        info["cuda"] = f"unknown ({type(e).__name__})"
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    info["gpu"] = _run(query) or "none (nvidia-smi absent or failing)"
    commit = _run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    info["commit"] = commit + (" + uncommitted changes" if dirty else "")
    path.write_text(json.dumps({"step": "env", "info": info, "rows": [], "done": True}, indent=1))
    return 0


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip().replace("\n", "; ")


def _log(msg: str) -> None:
    print(f"[gpu_decide] {msg}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("gpu-results"), help="results folder")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole run's limit")
    parser.add_argument("--cpu", action="store_true", help="dry run in Triton's interpreter")
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--only", default="", help="comma-separated steps to run (default all)")
    parser.add_argument("--env", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.env is not None:
        return environment(args.env)
    only = {s for s in args.only.split(",") if s}
    unknown = only - {s.name for s in STEPS}
    if unknown:
        parser.error(f"--only: unknown steps {', '.join(sorted(unknown))}")
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out.resolve(), args.cpu, args.quick, args.budget_s)
    run.write()  # the predictions and rules, before anything is measured
    for step in STEPS:
        if not only or step.name in only:
            run.run_step(step)
    run.write()
    failed = [n for n, s in run.statuses.items() if s["status"] not in ("ok", "skipped")]
    _log(f"done in {(dt.datetime.now(dt.UTC) - run.started).total_seconds():.0f} s; "
         f"{'failed: ' + ', '.join(failed) if failed else 'every step ok or skipped'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
