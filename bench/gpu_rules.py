"""What ``bench.gpu_decide`` predicts and how it decides, fixed before the run.

The predictions are the hardware floors (copy bandwidth, launch cost) and the targets set for
the GPU path, with the kernels' own design notes; the rules say which smoother design and tile,
and which rollout launch option, become the defaults given which figures. Both are printed at
the top of the run's report before any step runs, and copied into docs/BENCHMARKS.md;
:func:`decide` and :func:`targets` apply them to the run's results.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

TOLERANCE = 1e-5  # largest error against float64 that a candidate may have
SWITCH_GAIN = 0.10  # a new default must be this much faster (geometric mean over the shapes)
WORST_SHAPE = 1.25  # ... and no more than this much slower on any one shape
DISPATCH_GAIN = 1.5  # a design this much faster on one shape: a per-shape dispatch candidate
PDL_GAIN = 0.05  # PDL becomes the rollout's default if this much faster at every batch

PREDICTIONS: tuple[tuple[str, str, str], ...] = (
    # (quantity, predicted, target)
    ("copy, B=256 T=4000 (98 MB moved), GPU time", "20–23 µs (HBM3e ~4.8 TB/s)", "the floor"),
    ("empty Triton launch, wall per call", "4–8 µs", "—"),
    ("smoother `chunked`, GPU time / copy, B=256 T=4000", "2–4× (reads x twice)", "≤ 1.3×"),
    ("smoother `chained`, GPU time, B=256 T=4000", "30–50 µs (1.5–2.5× the copy)", "≤ 1.3×"),
    ("smoother `chained`, B=1 T=100,000", "far worse than `chunked` (one program)", "≤ 2×"),
    ("smoother `lookback`, GPU time / copy, B=256 T=4000", "1.0–1.5×", "≤ 1.3×"),
    ("smoother GPU time / copy, B=64 T=1000 and B=1 T=100,000", "2–6× (chunked)", "≤ 2×"),
    ("smoother per call / `copy_` call, B=256 T=4000", "3–6× (host work per call)", "≤ 1.5×"),
    ("smoother per call against JAX `associative_scan`", "1.5–3× faster", "≥ 5× faster"),
    ("smoother host overhead per call, 1 sequence", "25–50 µs (3 launches' binding)", "≤ 30 µs"),
    ("compiles after warm-up, 200 random batches", "0", "0"),
    (
        "rollout µs/step, B = 1 / 64 / 1024",
        "6–8 / 10–13 / 15–25 (one kernel a layer a step still)",
        "≤ 6/10/15",
    ),
    ("rollout µs/step with PDL", "≤ 0.95× without", "—"),
    ("rollout against JAX `lax.scan`", "0.7–0.95×", "≤ 0.5×"),
    (
        "`/smooth` 50–500 steps, cuda / cpu requests/s",
        "≥ 1.0× (warm-up compiles every plan)",
        "≥ 1.0×",
    ),
    ("`/rollout` 50–500 steps, cuda / cpu requests/s", "2.5–3×", "≥ 2.5×"),
)

RULES: tuple[str, ...] = (
    f"A smoother candidate (design × tile) counts only if it ran on every shape with error ≤ "
    f"{TOLERANCE:g} against float64.",
    f"The smoother's default becomes the counting candidate with the lowest geometric mean of "
    f"GPU µs over the three shapes, if that is at least {SWITCH_GAIN:.0%} below the current "
    f"default's (`chunked`, default plan) and no shape is more than {WORST_SHAPE}× the current "
    "default's time; otherwise the default stays.",
    f"A candidate at least {DISPATCH_GAIN}× faster than the chosen default on one shape is "
    "reported as a per-shape dispatch candidate (a follow-up, not switched by this run).",
    f"The rollout launches with PDL by default if PDL is at least {PDL_GAIN:.0%} faster per step "
    f"at every batch and its error stays ≤ {TOLERANCE:g}.",
    "Host overhead per call is the 1-sequence batch's wall time per public call minus its GPU "
    "time; the largest host part (planning, schedule copy, buffers, launches) is what to cut next.",
    "Each target is met or not from this run's figures alone; a step that failed or was cut "
    "leaves its targets unknown, never met.",
)


def _rows(results: dict[str, Any], step: str) -> list[dict[str, Any]]:
    return list((results.get(step) or {}).get("rows", []))


def smoother_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for name in results if name.startswith("smoother-") for r in _rows(results, name)]


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def candidates(results: dict[str, Any]) -> dict[tuple[str, str], dict[tuple[int, int], float]]:
    """``(design, tiles) -> {shape: GPU µs}`` of the candidates that count (rule 1)."""
    rows = smoother_rows(results)
    shapes = {tuple(r["shape"]) for r in rows}
    found: dict[tuple[str, str], dict[tuple[int, int], float]] = {}
    bad: set[tuple[str, str]] = set()
    for r in rows:
        key = (r["design"], r["tiles"])
        if "failed" in r or r.get("error", math.inf) > TOLERANCE:
            bad.add(key)
            continue
        batch, steps = r["shape"]
        found.setdefault(key, {})[(batch, steps)] = float(r["gpu_us"])
    return {k: v for k, v in found.items() if k not in bad and set(v) == shapes}


def decide(results: dict[str, Any]) -> list[str]:
    """The rules applied: one line per decision."""
    out = []
    counted = candidates(results)
    current = ("chunked", "default plan")
    if current not in counted:
        out.append("Smoother: the current default did not count (failed, off or cut): no change.")
    else:
        base = counted[current]
        best = min(counted, key=lambda k: _geomean(list(counted[k].values())))
        gain = 1 - _geomean(list(counted[best].values())) / _geomean(list(base.values()))
        worst = max(counted[best][s] / base[s] for s in base)
        if best != current and gain >= SWITCH_GAIN and worst <= WORST_SHAPE:
            out.append(
                f"Smoother: switch the default to `{best[0]}` ({best[1]}): {gain:.0%} lower "
                f"geometric mean of GPU time, at worst {worst:.2f}× the current on one shape."
            )
            chosen = best
        else:
            out.append(
                f"Smoother: keep `chunked` (default plan); the fastest counting candidate, "
                f"`{best[0]}` ({best[1]}), is {gain:.0%} below it, at worst {worst:.2f}×."
            )
            chosen = current
        for key, times in counted.items():
            for shape, us in times.items():
                if us * DISPATCH_GAIN <= counted[chosen][shape]:
                    out.append(
                        f"Dispatch candidate: `{key[0]}` ({key[1]}) at B={shape[0]} "
                        f"T={shape[1]}: {counted[chosen][shape] / us:.1f}× faster."
                    )
    out.append(_rollout_decision(_rows(results, "rollout")))
    return out


def _rollout_decision(rows: list[dict[str, Any]]) -> str:
    by = {(r["variant"], tuple(r["shape"])): r for r in rows if "failed" not in r}
    shapes = sorted({s for _, s in by})
    if not shapes or any(("default", s) not in by or ("PDL", s) not in by for s in shapes):
        return "Rollout: PDL not measured at every batch: no change."
    pairs = [(by[("default", s)], by[("PDL", s)]) for s in shapes]
    ok = all(
        b["us_per_step"] <= (1 - PDL_GAIN) * a["us_per_step"] and b["error"] <= TOLERANCE
        for a, b in pairs
    )
    ratios = ", ".join(f"{b['us_per_step'] / a['us_per_step']:.2f}×" for a, b in pairs)
    verdict = "launch with" if ok else "keep launching without"
    return f"Rollout: {verdict} PDL (PDL / default, per step: {ratios})."


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and "failed" not in r:
            return r
    return None


def targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(target, measured, met)`` for the issue's targets table."""
    floors, srows = _rows(results, "floors"), smoother_rows(results)
    rows: list[tuple[str, str, str]] = []

    def ratio_row(label: str, shape: list[int], limit: float) -> None:
        copy = _find(floors, what="copy", shape=shape)
        cell = _find(srows, design="chunked", tiles="default plan", shape=shape)
        best = min(
            (r for r in srows if r["shape"] == shape and "gpu_us" in r and r["error"] <= TOLERANCE),
            key=lambda r: r["gpu_us"],
            default=None,
        )
        if copy is None or cell is None or best is None:
            rows.append((label, "not measured", "unknown"))
            return
        got = best["gpu_us"] / copy["gpu_us"]
        rows.append(
            (
                label,
                f"{got:.2f}× ({best['design']}, {best['tiles']}; chunked "
                f"{cell['gpu_us'] / copy['gpu_us']:.2f}×)",
                "yes" if got <= limit else "no",
            )
        )

    ratio_row("smoother GPU time, B=256 T=4000 ≤ 1.3× copy", [256, 4000], 1.3)
    ratio_row("smoother GPU time, B=64 T=1000 ≤ 2× copy", [64, 1000], 2.0)
    ratio_row("smoother GPU time, B=1 T=100,000 ≤ 2× copy", [1, 100_000], 2.0)
    copy = _find(floors, what="copy", shape=[256, 4000])
    cell = _find(srows, design="chunked", tiles="default plan", shape=[256, 4000])
    jax = _find(_rows(results, "jax"), fn="smoother_associative_scan", shape=[256, 4000])
    if copy and cell:
        got = cell["wall_us"] / copy["wall_us"]
        rows.append(("smoother per call ≤ 1.5× `copy_` call", f"{got:.2f}×", _met(got <= 1.5)))
    else:
        rows.append(("smoother per call ≤ 1.5× `copy_` call", "not measured", "unknown"))
    if cell and jax:
        got = jax["wall_us"] / cell["wall_us"]
        rows.append(("smoother ≥ 5× faster than JAX", f"{got:.2f}× faster", _met(got >= 5)))
    else:
        rows.append(("smoother ≥ 5× faster than JAX", "not measured", "unknown"))
    host = _find(_rows(results, "host"), what="host overhead")
    if host:
        rows.append(
            ("host overhead ≤ 30 µs", f"{host['host_us']:.1f} µs", _met(host["host_us"] <= 30))
        )
    compiles = _find(_rows(results, "host"), what="compiles after warm-up")
    if compiles and compiles.get("compiles") is not None:
        n = compiles["compiles"]
        rows.append(("zero compiles after warm-up", f"{n} in {compiles['batches']}", _met(n == 0)))
    rows += _rollout_targets(results)
    rows += _e2e_targets(results)
    return rows


def _met(ok: bool) -> str:
    return "yes" if ok else "no"


def _rollout_targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = _rows(results, "rollout")
    jax = _rows(results, "jax")
    out = []
    for (batch, steps), limit in zip(((1, 1000), (64, 500), (1024, 200)), (6, 10, 15), strict=True):
        r = _find(rows, variant="default", shape=[batch, steps])
        if r is None:
            out.append((f"rollout B={batch} ≤ {limit} µs/step", "not measured", "unknown"))
            continue
        ok = r["us_per_step"] <= limit and r["error"] <= TOLERANCE
        measured = f"{r['us_per_step']:.1f} µs/step, error {r['error']:.1e}"
        j = _find(jax, fn="traveller_rollout_scan", shape=[batch, steps])
        if j is not None:
            ratio = r["us_per_step"] / j["us_per_step"]
            measured += f", {ratio:.2f}× JAX"
            ok = ok and ratio <= 0.5
        out.append((f"rollout B={batch} ≤ {limit} µs/step, ≤ 0.5× JAX", measured, _met(ok)))
    return out


def _e2e_targets(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = _rows(results, "e2e")
    out = []
    for label, want in (("/smooth, 50–500 steps", 1.0), ("/rollout, 50–500 steps", 2.5)):
        gpu = _find(rows, workload=label, device="cuda")
        cpu = _find(rows, workload=label, device="cpu")
        if gpu is None or cpu is None:
            out.append((f"`{label}` cuda ≥ {want}× cpu", "not measured", "unknown"))
            continue
        ratio = gpu["rps"] / cpu["rps"]
        ok = ratio >= want
        measured = f"{ratio:.2f}×, p99 {gpu['p99_ms']:.0f} against {cpu['p99_ms']:.0f} ms"
        if label.startswith("/smooth"):
            ok = ok and gpu["p99_ms"] <= 1.2 * cpu["p99_ms"]
        out.append((f"`{label}` cuda ≥ {want}× cpu", measured, _met(ok)))
    return out
