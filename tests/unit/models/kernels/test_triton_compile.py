"""Every Triton kernel compiles for the GPU rnnserve is deployed on (sm_90, Hopper), on the CPU.

The other Triton tests run the kernels in Triton's interpreter, which executes them as Python
and never sees what Triton's compiler sees: on a real GPU (an H200) every smoother kernel was
once refused at compile time (``x_ptr: Any``: Triton resolves a parameter's
annotation as a global, and only constexpr globals are allowed), while all interpreter tests
passed. The compiler needs no GPU (front end, optimiser, LLVM and the ptxas shipped in the
triton wheel all run here), so this test records every kernel launch that the interpreter runs
(argument types, constexprs, warps), adds the variants only a GPU launches (programmatic
dependent launch), and compiles each to a cubin for sm_90 in a child process without the
interpreter.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - tests/conftest.py sets it
    pytest.skip("records launches in Triton's interpreter", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction

from rnnserve.models.kernels import rollout_triton as rt
from rnnserve.models.kernels import smoother_triton as st
from rnnserve.models.packing import pack

# compiles every Triton kernel for sm_90 (no GPU needed): tens of seconds
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[4]
POINTER = {
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.float64: "*fp64",
    torch.int32: "*i32",
    torch.int64: "*i64",
}

# The child: compile each job for sm_90 and report what happened, one JSON line per job.
CHILD = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for job in json.load(sys.stdin):
    fn = getattr(importlib.import_module(job["module"]), job["kernel"])
    names = list(fn.arg_names)
    constexprs = {(names.index(k),): v for k, v in job["constexprs"].items()}
    result = {"job": job["id"]}
    try:
        compiled = triton.compile(
            ASTSource(fn, job["signature"], constexprs=constexprs),
            target=GPUTarget("cuda", 90, 32),
            options=job["options"],
        )
        result["cubin_bytes"] = len(compiled.asm["cubin"])
        result["ptx_target"] = "sm_90" if ".target sm_90" in compiled.asm["ptx"] else "other"
        result["do_not_specialize"] = sorted(  # indices or names, by Triton version
            d if isinstance(d, str) else names[d] for d in fn.do_not_specialize
        )
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
    print(json.dumps(result), flush=True)
"""


def _type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _job(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What compiling this launch takes: the kernel, its signature, constexprs and options."""
    params = inspect.signature(fn.fn).parameters
    values = dict(zip(params, args, strict=False))
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    values.update({k: v for k, v in kwargs.items() if k in params})
    signature, constexprs = {}, {}
    for name, param in params.items():
        if "constexpr" in str(param.annotation):
            signature[name] = "constexpr"
            constexprs[name] = values[name]
        else:
            signature[name] = _type(values[name])
    return {
        "module": fn.fn.__module__,
        "kernel": fn.fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "options": options,
    }


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every kernel launch the interpreter runs meanwhile, as a compile job."""
    jobs: list[dict[str, Any]] = []
    run = InterpretedFunction.run

    def recording(self: Any, *args: Any, grid: Any, **kwargs: Any) -> Any:
        jobs.append(_job(self, args, kwargs))
        return run(self, *args, grid=grid, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return jobs


def _smoother_launches(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    packed = pack([torch.randn(n, 3, generator=gen, dtype=dtype) for n in (9, 6, 2)])
    alpha = torch.full((3,), 0.6, dtype=dtype, requires_grad=True)
    wx = torch.ones(3, dtype=dtype, requires_grad=True)
    x = packed.data.clone().requires_grad_()
    for init in (None, torch.zeros(3, 3, dtype=dtype, requires_grad=True)):
        for scan in st.SCANS:
            y, final = st.smooth_packed_triton(
                x, packed.batch_sizes, alpha, wx, init, chunk=4, scan=scan
            )
            (y.sum() + final.sum()).backward()
    with torch.inference_mode():  # as the server runs it: no state kept for a backward pass
        st.smooth_packed_triton(packed.data, packed.batch_sizes, alpha, wx, None, chunk=4)
        for sub in (1, 2):  # the forward scanned in pieces (a loop over steps at 1)
            st.smooth_packed_triton(packed.data, packed.batch_sizes, alpha, wx, None, sub=sub)
        st.smooth_packed_triton(packed.data, packed.batch_sizes, alpha, wx, None, scan="chained")
        st.smooth_packed_triton(packed.data, packed.batch_sizes, alpha, wx, None, scan="lookback")


def _rollout_launches() -> None:
    gen = torch.Generator().manual_seed(1)
    hidden, num_inputs, layers = 16, 3, 2
    w = [torch.randn(2 + hidden + num_inputs, 4 * hidden, generator=gen) * 0.2]
    w += [torch.randn(2 * hidden, 4 * hidden, generator=gen) * 0.2 for _ in range(layers - 1)]
    b = [torch.randn(4 * hidden, generator=gen) * 0.1 for _ in range(layers)]
    w_out, b_out = torch.randn(hidden, 2, generator=gen), torch.zeros(2)
    small = rt.KernelConfig(block_b=2, block_h=8, block_k=16, use_dot=False)
    wide = rt.KernelConfig(block_b=16, block_h=16, block_k=16, use_dot=True)
    cases = [(small, "ieee", [2, 2, 1]), (wide, "ieee", [17, 9]), (wide, "tf32x3", [17, 9])]
    for config, precision, sizes in cases:
        roll = rt.TritonRollout(config=config, precision=precision, max_chunk=2)
        u = torch.randn(sum(sizes), num_inputs, generator=gen)
        roll(u, sizes, w, b, w_out, b_out)


def _with_gpu_only_variants(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded jobs, deduplicated, plus each step kernel with PDL on (a GPU-only launch)."""
    unique: dict[str, dict[str, Any]] = {}
    for job in jobs:
        unique.setdefault(json.dumps(job, sort_keys=True), job)
        if job["constexprs"].get("PDL") is False:
            pdl = {**job, "constexprs": {**job["constexprs"], "PDL": True}}
            unique.setdefault(json.dumps(pdl, sort_keys=True), pdl)
    return [{**job, "id": i} for i, job in enumerate(unique.values())]


def _compile(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_sm90(launches: list[dict[str, Any]]) -> None:
    for dtype in (torch.float32, torch.float64):
        _smoother_launches(dtype)
    _rollout_launches()
    jobs = _with_gpu_only_variants(launches)
    kernels = {(j["module"].rsplit(".", 1)[-1], j["kernel"]) for j in jobs}
    # every kernel of the smoother and rollout modules was launched, so every one is compiled below
    assert kernels == {
        ("smoother_triton", "_fwd_chunk_summary"),
        ("smoother_triton", "_carry_scan"),
        ("smoother_triton", "_fwd_replay"),
        ("smoother_triton_single_pass", "_fwd_chained"),
        ("smoother_triton_single_pass", "_fwd_lookback"),
        ("smoother_triton_backward", "_bwd_chunk_summary"),
        ("smoother_triton_backward", "_bwd_replay"),
        ("rollout_triton", "_layer_step_kernel"),
        ("rollout_triton", "_advance_kernel"),
    }
    precisions = {j["constexprs"].get("PRECISION") for j in jobs}
    assert {"ieee", "tf32x3"} <= precisions
    assert {True, False} <= {j["constexprs"].get("USE_DOT") for j in jobs}
    assert {True, False} <= {j["constexprs"].get("PDL") for j in jobs}
    assert {1, 2} <= {j["constexprs"].get("SUB") for j in jobs}
    for single_pass in ("_fwd_chained", "_fwd_lookback"):
        launched = [j["constexprs"] for j in jobs if j["kernel"] == single_pass]
        assert {(c["HAS_INIT"], c["STORE_S"]) for c in launched} == {
            (False, False),
            (False, True),
            (True, True),
        }

    results = _compile(jobs)
    assert [r["job"] for r in results] == [j["id"] for j in jobs]
    failed = [(jobs[r["job"]]["kernel"], r["error"]) for r in results if "error" in r]
    assert not failed, "\n\n".join(f"{k}: {e}" for k, e in failed)
    assert all(r["cubin_bytes"] > 0 and r["ptx_target"] == "sm_90" for r in results)

    # the smoother's batch-dependent integers are not specialised on (one binary per tile plan)
    for job, result in zip(jobs, results, strict=True):
        if job["module"].rsplit(".", 1)[-1].startswith("smoother_triton"):
            varying = {"n_steps", "n_cols", "n_chunks"} & set(job["signature"])
            assert set(result["do_not_specialize"]) == varying, job["kernel"]
