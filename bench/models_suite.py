"""The state of one benchmark run that every subject's cases share: the plan, the device,
JAX (here or in a process of its own), and how a case is built, checked and timed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from bench.models_harness import (
    ROOT,
    SMOOTHER_FLOOR_CPU,
    SMOOTHER_FLOOR_CUDA,
    Builder,
    Case,
    CheckFailed,
    Plan,
    Results,
    Row,
    Timing,
    Unavailable,
    _cuda_wait,
    _fmt_s,
    _log,
    _no_wait,
    measure,
    shape_label,
)


class SuiteBase:
    """One run on one device: inputs, the implementations to try, and what came of them."""

    def __init__(self, plan: Plan, use_jax: bool = True, jax_process: bool = False) -> None:
        self.plan = plan
        # JAX in a process of its own per case (the default on CUDA): no JAX in this process
        self.jax_process = jax_process
        self.jax_elsewhere_ready = False  # process mode, asked for and installed
        self.device = torch.device(plan.device)
        self.cuda = self.device.type == "cuda"
        self.wait: Callable[[object], object] = _cuda_wait if self.cuda else _no_wait
        self.res = Results()
        self.jax: ModuleType | None = None
        self.jax_device: Any = None
        self.jax_reason = "not tried (--no-jax)"
        self.jax_version = "not installed"
        if use_jax:
            self._load_jax()

    @property
    def smoother_floor(self) -> str:
        return SMOOTHER_FLOOR_CUDA if self.cuda else SMOOTHER_FLOOR_CPU

    def _load_jax(self) -> None:
        if self.jax_process:  # checked here without importing it; its process may still fail
            if importlib.util.find_spec("jax") is None:
                self.jax_reason = "JAX is not installed; `pip install '.[bench]'` adds it"
                _log(f"skipping the JAX rows: {self.jax_reason}")
                return
            self.jax_version = f"{importlib.metadata.version('jax')} (in a process of its own)"
            self.jax_elsewhere_ready = True
            self.res.notes.append(
                "JAX rows: each measured in a process of its own (`--jax process`, the default on "
                "CUDA), right after the other rows of its shape were set up and before they were "
                "timed: not in their round-robin rounds, so its ratio compares medians of "
                "different rounds."
            )
            return
        try:
            jb = importlib.import_module("bench.jax_baselines")
        except ImportError as e:
            self.jax_reason = (
                f"JAX is not installed ({e}); `pip install '.[bench]'` adds it"
                if "jax" in str(e)
                else f"bench.jax_baselines did not import: {e}"
            )
            _log(f"skipping the JAX rows: {self.jax_reason}")
            return
        jax = importlib.import_module("jax")
        self.jax_version = f"{jax.__version__}"
        try:
            self.jax_device = jb.device_for(self.device.type)
        except RuntimeError as e:
            self.jax_reason = str(e)
            _log(f"skipping the JAX rows: {self.jax_reason}")
            return
        self.jax = jb
        self.jax_version += f" ({self.jax_device.platform})"

    # -- running one case -------------------------------------------------------------------

    def build(self, name: str, shape: str, builder: Builder) -> Case | None:
        """Build and check one case; record why not when it cannot or does not agree."""
        try:
            return builder()
        except Unavailable as e:
            self.res.skipped.append((name, shape, str(e)))
            _log(f"  skip {name}: {e}")
        except CheckFailed as e:
            self.res.failed.append((name, shape, str(e)))
            _log(f"  FAILED {e}")
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self.res.failed.append((name, shape, f"{type(e).__name__}: {e}"))
            _log(f"  FAILED {name}: {type(e).__name__}: {e}")
        return None

    def run_shape(
        self,
        builders: Sequence[tuple[str, Builder]],
        rows: list[Row],
        batch: int,
        steps: int,
        packed_rows: int,
    ) -> None:
        label = shape_label(batch, steps)
        cases = [c for name, b in builders if (c := self.build(name, label, b)) is not None]
        floor_name = builders[0][0]
        if not cases or cases[0].name != floor_name:
            _log(f"  no floor at {label}: nothing timed")
            return
        timings = measure(cases, self.plan)
        floor = timings[floor_name].median
        for case in cases:
            t = timings[case.name]
            rows.append(
                Row(label, case.name, t, t.median / floor, batch, steps, packed_rows, case.err)
            )

    def first_call(self, what: str, fn: Callable[[], object]) -> object:
        """Call ``fn`` once, timing it (synchronised) into the compile table."""
        self.wait(None)
        start = time.perf_counter()
        out = fn()
        self.wait(out)
        self.res.compile.append((what, _fmt_s(time.perf_counter() - start)))
        return out

    # -- the smoother -------------------------------------------------------------------------

    def _jax(self) -> Any:
        if self.jax is None:
            raise Unavailable(self.jax_reason)
        return self.jax

    def jax_elsewhere(
        self, fn_name: str, arrays: dict[str, np.ndarray], label: str
    ) -> tuple[np.ndarray, Timing]:
        """Compile, check-call and time ``bench.jax_baselines.<fn_name>`` in a process of its
        own (``python -m bench.jax_baselines``): its output and its timing, as ``measure`` would
        take them (the same number of rounds, each sample about ``sample_s`` long). A crash
        there costs this row only."""
        if not self.jax_elsewhere_ready:  # --no-jax, or not installed
            raise Unavailable(self.jax_reason)
        with tempfile.TemporaryDirectory(prefix="rnnserve-jax-") as tmp:
            inputs, result = Path(tmp) / "inputs.npz", Path(tmp) / "result.npz"
            np.savez(inputs, **arrays)  # type: ignore[arg-type]  # (allow_pickle)
            command = [
                sys.executable, "-m", "bench.jax_baselines", fn_name, str(inputs), str(result),
                "--device", self.device.type, "--rounds", str(self.plan.rounds),
                "--sample-s", str(self.plan.sample_s),
            ]  # fmt: skip
            try:
                done = subprocess.run(
                    command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
                )
            except subprocess.TimeoutExpired as e:
                raise Unavailable("its process took over 600 s") from e
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or ["(no output)"]
                raise Unavailable(f"its process failed (exit {done.returncode}): {lines[-1][:300]}")
            with np.load(result) as r:
                out, samples = np.asarray(r["out"]), [float(v) for v in r["samples"]]
                number, secs = int(r["number"]), float(r["compile_s"])
        self.res.compile.append(
            (f"JAX jit compile, `{fn_name}` ({label}; in its own process)", _fmt_s(secs))
        )
        return out, Timing(number=number, samples=samples)
