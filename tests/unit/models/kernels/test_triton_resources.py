"""The served Triton kernels' resource budget, read from their sm_90 cubins on the CPU.

What a kernel costs on an SM is fixed at compile time: registers per thread, shared memory per
block, local memory (spills), barriers. So it can be checked without a GPU, from the cubin that
Triton's compiler makes here (as ``test_triton_compile.py`` does), with the ``cuobjdump`` shipped
in the triton wheel: ``--dump-resource-usage`` for registers, stack, local and static shared
memory, ``-sass`` for the instructions (spill stores and loads, barriers). The dynamic shared
memory Triton asks for at launch is in the compiled kernel's metadata.

The budget (what the served kernels must keep on sm_90):

- no kernel served spills (no local memory, no ``STL``/``LDL``);
- the smoother's forward kernels fit at least two blocks per SM on sm_90 (65,536 registers,
  228 KiB of shared memory, 2,048 threads, 32 blocks), so that one block's loads overlap
  another's scan; a kernel that misses it today is an ``xfail(strict=True)`` naming the reason,
  so that the fix is noticed;
- each rollout kernel has a recorded number of barriers a step (``BAR`` instructions in its
  SASS): more is a regression to explain, fewer a change to record.

The launches are those of the benchmark's shapes and of the server's warm-up, recorded in
Triton's interpreter without running them (the arguments alone make the compile jobs), then
compiled in a child process without the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - tests/conftest.py sets it
    pytest.skip("records launches in Triton's interpreter", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction

from rnnserve.models.kernels import rollout_triton as rt
from rnnserve.models.kernels import smoother_triton as st
from tests.unit.models.kernels.test_triton_compile import ROOT, _job

pytestmark = pytest.mark.slow  # tens of compiles for sm_90

FEAT = 16  # the benchmark's and the served smoother's features
SMOOTHER_SHAPES = ((64, 1000), (256, 4000), (1, 100_000))  # (B, T), lengths T/2..T
ROLLOUT_ROWS = (1, 64, 1024)  # the benchmark's batches; one state-row bucket each
HIDDEN, LAYERS, INPUTS = 128, 2, 6  # the served Traveller
WARM_STEPS = 4000

# sm_90 (H100, H200) per SM
SM_REGISTERS = 65_536
SM_SHARED = 228 * 1024
SM_THREADS = 2048
SM_BLOCKS = 32
RESERVED_SHARED = 1024  # the system's shared memory per block on sm_80 and later
REGISTER_UNIT = 256  # registers are allocated per warp, in units of 256

FORWARD = {
    "chunked": ("_fwd_chunk_summary", "_carry_scan", "_fwd_replay"),
    "chained": ("_fwd_chained",),
    "lookback": ("_fwd_lookback",),
}
# Most BAR instructions in any variant of each rollout kernel (one a layer) in its SASS (sm_90,
# the served tiles at hidden 128): what rollout_triton.py compiled to when these were recorded
# (Triton 3.9; after its rework to one reduction a layer and 64-row tiles at 1024 rows), as a
# ceiling, so that a change adding barriers to a step fails here. Fewer: lower the entry.
ROLLOUT_BARRIERS = {
    ("_layer_step_kernel", 1): 13,
    ("_layer_step_kernel", 64): 13,
    ("_layer_step_kernel", 1024): 16,
    ("_advance_kernel", 1): 0,
    ("_advance_kernel", 64): 0,
    ("_advance_kernel", 1024): 0,
}

# The child: compile each job for sm_90, dump the cubin's resources and count SASS instructions.
CHILD = r"""
import importlib, json, re, subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def tool(name):
    try:
        from triton import knobs
        return getattr(knobs.nvidia, name).path
    except (ImportError, AttributeError):
        return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)

cuobjdump = tool("cuobjdump")
tmp = Path(tempfile.mkdtemp(prefix="rnnserve-cubin-"))
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
        cubin = tmp / f"{job['id']}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
        ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
        result.update(
            registers=int(fields["REG"]), stack=int(fields["STACK"]),
            local=int(fields["LOCAL"]), static_shared=int(fields["SHARED"]),
            dynamic_shared=int(compiled.metadata.shared), warps=int(compiled.metadata.num_warps),
            barriers=sum(op.startswith("BAR.") or op == "BAR" for op in ops),
            spill_ops=sum(op.split(".")[0] in ("STL", "LDL") for op in ops),
            instructions=len(ops),
        )
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
    print(json.dumps(result), flush=True)
"""


def blocks_per_sm(registers: int, warps: int, shared_bytes: int) -> int:
    """Resident blocks per sm_90 SM: the least of what registers, shared memory, threads and
    the block limit allow."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (SM_REGISTERS // per_warp) // warps if per_warp else SM_BLOCKS
    by_shared = SM_SHARED // (shared_bytes + RESERVED_SHARED)
    by_threads = SM_THREADS // (32 * warps)
    return min(by_registers, by_shared, by_threads, SM_BLOCKS)


def test_blocks_per_sm_follows_the_tightest_limit() -> None:
    # 146 registers at 8 warps: 4,864 a warp, 13 warps' worth: one block (the issue's chained)
    assert blocks_per_sm(146, 8, 0) == 1
    assert blocks_per_sm(128, 8, 0) == 2  # 4,096 a warp: 16 warps
    assert blocks_per_sm(32, 4, 0) == 16  # threads: 2,048 / 128
    assert blocks_per_sm(32, 4, 100 * 1024) == 2  # shared memory: 228 KiB / 101 KiB
    assert blocks_per_sm(16, 1, 0) == SM_BLOCKS


def _record_only(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []

    def record(self: Any, *args: Any, grid: Any, warmup: bool = False, **kwargs: Any) -> None:
        jobs.append(_job(self, args, kwargs))

    monkeypatch.setattr(InterpretedFunction, "run", record)
    return jobs


def _sizes(batch: int, steps: int) -> torch.Tensor:
    lengths = [steps - (i * (steps // 2)) // max(1, batch - 1) for i in range(batch)]
    t = torch.arange(steps)
    return (torch.tensor(lengths)[None, :] > t[:, None]).sum(1).to(torch.int64)


def _serve_smoother(scan: str, batch: int, steps: int) -> None:
    sizes = _sizes(batch, steps)
    data = torch.zeros(int(sizes.sum()), FEAT)
    alpha, wx = torch.full((FEAT,), 0.5), torch.ones(FEAT)
    with torch.inference_mode():  # as the server runs it
        st.smooth_packed_triton(data, sizes, alpha, wx, None, scan=scan)


def _rollout_weights() -> tuple[Any, ...]:
    w = [torch.zeros(2 + HIDDEN + INPUTS, 4 * HIDDEN)]
    w += [torch.zeros(2 * HIDDEN, 4 * HIDDEN) for _ in range(LAYERS - 1)]
    b = [torch.zeros(4 * HIDDEN) for _ in range(LAYERS)]
    return w, b, torch.zeros(HIDDEN, 2), torch.zeros(2)


def _key(job: dict[str, Any]) -> str:
    return json.dumps({k: job[k] for k in ("module", "kernel", "signature", "constexprs")})


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


Resources = dict[tuple[str, str], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def resources() -> Resources:
    """``(case, kernel) -> resources`` of each variant of the kernel a case launches (the
    rollout's step kernel has one per layer): case ``"<scan> B=.. T=.."`` for the smoother's
    shapes, ``"warm-up <chunk>x<block>"`` for the warm-up's plans, ``"rollout B=.."`` for the
    rollout."""
    monkeypatch = pytest.MonkeyPatch()
    jobs = _record_only(monkeypatch)
    cases: list[tuple[str, int]] = []  # (case, index of its first job)
    try:
        for scan in st.SCANS:
            for batch, steps in SMOOTHER_SHAPES:
                cases.append((f"{scan} B={batch} T={steps}", len(jobs)))
                _serve_smoother(scan, batch, steps)
        alpha, wx = torch.full((FEAT,), 0.5), torch.ones(FEAT)
        for chunk, block, carry in st.tile_plans(FEAT, WARM_STEPS):
            cases.append((f"warm-up {chunk}x{block}", len(jobs)))
            data, sizes = torch.zeros(1, FEAT), torch.ones(1, dtype=torch.int64)
            with torch.inference_mode():
                st.smooth_packed_triton(
                    data, sizes, alpha, wx, None, chunk=chunk, block=block, carry=carry
                )
        weights = _rollout_weights()
        for rows in ROLLOUT_ROWS:
            cases.append((f"rollout B={rows}", len(jobs)))
            roll = rt.TritonRollout(config=rt.kernel_config(rt.bucket_rows(rows), HIDDEN))
            with torch.inference_mode():
                roll(torch.zeros(rows * 2, INPUTS), [rows, rows], *weights)
    finally:
        monkeypatch.undo()
    ends = [start for _, start in cases[1:]] + [len(jobs)]
    unique: dict[str, dict[str, Any]] = {}
    owners: list[tuple[str, str, str]] = []  # (case, kernel, job key)
    for (case, start), end in zip(cases, ends, strict=True):
        for job in jobs[start:end]:
            unique.setdefault(_key(job), job)
            owners.append((case, job["kernel"], _key(job)))
    ordered = list(unique)
    compiled = _compile([{**unique[k], "id": i} for i, k in enumerate(ordered)])
    by_key = {ordered[r["job"]]: r for r in compiled}
    failed = [r for r in compiled if "error" in r]
    assert not failed, failed
    found: Resources = {}
    for case, kernel, key in owners:
        variants = found.setdefault((case, kernel), [])
        if by_key[key] not in variants:
            variants.append(by_key[key])
    return found


def _blocks(r: dict[str, Any]) -> int:
    return blocks_per_sm(r["registers"], r["warps"], r["dynamic_shared"] + r["static_shared"])


def _fewest_blocks(variants: list[dict[str, Any]]) -> dict[str, Any]:
    return min(variants, key=_blocks)


def _describe(r: dict[str, Any]) -> str:
    return (
        f"{r['registers']} registers x {r['warps']} warps, "
        f"{r['dynamic_shared'] + r['static_shared']} B shared: {_blocks(r)} block(s) per SM"
    )


def test_no_served_kernel_spills(resources: Resources) -> None:
    assert len(resources) >= 20  # every case recorded its launches
    spilling = {
        f"{case}: {kernel}": (r["local"], r["stack"], r["spill_ops"])
        for (case, kernel), variants in resources.items()
        for r in variants
        if r["local"] or r["stack"] or r["spill_ops"]
    }
    assert spilling == {}


# (design, kernel, shapes) that miss two blocks per SM today, and why: each is register-bound at
# 8 warps (a whole [CHUNK, BLOCK] tile scanned in registers, several live values an element)
_ALL = SMOOTHER_SHAPES
ONE_BLOCK = (
    ("chained", "_fwd_chained", _ALL, "a 256x16 tile scanned whole at 8 warps"),
    ("chunked", "_carry_scan", _ALL, "CARRY x 32 chunk maps (8,192 values) scanned at 8 warps"),
    ("lookback", "_fwd_lookback", ((64, 1000), (256, 4000)), "a 32x128 tile and its window"),
)


def _one_block_reason(scan: str, kernel: str, shape: tuple[int, int]) -> str | None:
    for s, k, shapes, why in ONE_BLOCK:
        if (s, k) == (scan, kernel) and shape in shapes:
            return f"{kernel}: one block per SM, register-bound: {why}"
    return None


def _forward_cases() -> Iterator[Any]:
    for scan, kernels in FORWARD.items():
        for shape in SMOOTHER_SHAPES:
            for kernel in kernels:
                reason = _one_block_reason(scan, kernel, shape)
                marks = [] if reason is None else [pytest.mark.xfail(strict=True, reason=reason)]
                case = f"{scan} B={shape[0]} T={shape[1]}"
                yield pytest.param(case, kernel, marks=marks, id=f"{case}-{kernel}")


@pytest.mark.parametrize(("case", "kernel"), list(_forward_cases()))
def test_forward_smoother_kernel_fits_two_blocks_per_sm(
    resources: Resources, case: str, kernel: str
) -> None:
    r = _fewest_blocks(resources[(case, kernel)])
    assert _blocks(r) >= 2, f"{case}, {kernel}: {_describe(r)}"


def test_warm_up_plans_tile_kernels_fit_two_blocks_per_sm(resources: Resources) -> None:
    """Every plan the server compiles at start-up, its two tile kernels (the carry scan is
    one binary a block width, an expected failure above)."""
    warm = {k: r for k, r in resources.items() if k[0].startswith("warm-up")}
    assert len(warm) == 3 * len(st.tile_plans(FEAT, WARM_STEPS))
    short = {
        f"{case}: {kernel}": _describe(_fewest_blocks(variants))
        for (case, kernel), variants in warm.items()
        if kernel != "_carry_scan" and _blocks(_fewest_blocks(variants)) < 2
    }
    assert short == {}


def test_rollout_kernels_keep_their_recorded_barrier_count(resources: Resources) -> None:
    counted = {  # the most of any variant (layer 0's step kernel, the others')
        (kernel, int(case.split("=")[1])): max(r["barriers"] for r in variants)
        for (case, kernel), variants in resources.items()
        if case.startswith("rollout")
    }
    assert counted.keys() == ROLLOUT_BARRIERS.keys()  # a new kernel: record its count
    over = {k: (n, ROLLOUT_BARRIERS[k]) for k, n in counted.items() if n > ROLLOUT_BARRIERS[k]}
    assert over == {}
