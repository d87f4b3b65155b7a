"""The numba rollout's GEMM routes: each route's results, the route table, and the plan that
measures the routes and keeps the fastest (see the kernel module's docstring)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from rnnserve.models.traveller import rollout_packed
from tests.unit.models.kernels.test_rollout_cpu import (
    assert_same,
    bent_weights,
    packed_inputs,
    random_state,
)

rollout_cpu = pytest.importorskip("rnnserve.models.kernels.rollout_cpu")
LOOP, MKL, OPENBLAS = rollout_cpu.ROUTE_LOOP, rollout_cpu.ROUTE_MKL, rollout_cpu.ROUTE_OPENBLAS

needs_openblas = pytest.mark.skipif(
    rollout_cpu._OPENBLAS is None, reason="this numpy bundles no OpenBLAS"
)


def every_route(layers: int, widths: int, route: int) -> np.ndarray:
    return np.full((layers, widths + 1), route, dtype=np.int8)


@needs_openblas
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("route", ["loop", "mkl", "openblas", "mixed"])
def test_every_route_computes_the_rollout(dtype: torch.dtype, route: str) -> None:
    """A ragged batch falling from 6 rows to 1 (so a one-row gemv too), with state."""
    hidden, layers = 20, 2
    weights = bent_weights(hidden, layers, dtype)
    u, sizes = packed_inputs([30, 25, 12, 12, 5, 2], dtype)
    state = random_state(layers, sizes[0], hidden, dtype)
    if route == "mixed":  # layer 0 and layer 1 take different routes, which change with width
        routes = np.array([[LOOP, OPENBLAS, MKL, OPENBLAS, LOOP], [LOOP, MKL, OPENBLAS, LOOP, MKL]])
    else:
        routes = every_route(layers, 6, rollout_cpu.ROUTE_NAMES.index(route))
    with torch.inference_mode():
        want = rollout_packed(u, sizes, *weights, *state)
        got = rollout_cpu.rollout_packed_numba(u, sizes, *weights, *state, routes=routes)
    assert_same(got, want, dtype)


@needs_openblas
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("b", "k", "n"), [(1, 256, 512), (3, 40, 80), (16, 256, 512)])
def test_each_route_writes_its_own_product_of_the_active_rows(
    dtype: type, b: int, k: int, n: int
) -> None:
    """The OpenBLAS route is numpy's own OpenBLAS: bit for bit what numpy's ``@`` gives (a gemv
    at one row), which MKL's rounding is not; rows past ``b`` are left alone."""
    rng = np.random.default_rng(b)
    z = rng.standard_normal((b + 2, k)).astype(dtype)
    w = rng.standard_normal((k, n)).astype(dtype)
    out = {}
    for route, name in enumerate(rollout_cpu.ROUTE_NAMES):
        g = np.zeros((b + 2, n), dtype)
        scratch = (np.zeros(8, np.int32), np.zeros(9, np.int64), np.zeros(2, dtype))
        rollout_cpu._gemm_route_jit(np.int8(route), z, w, np.zeros(0, np.uint8), b, g, *scratch)
        assert not g[b:].any(), name
        out[name] = g[:b]
        np.testing.assert_allclose(g[:b], z[:b] @ w.astype(np.float64), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out["openblas"], z[:b] @ w)
    assert not np.array_equal(out["openblas"], out["mkl"])
    assert not np.array_equal(out["loop"], out["mkl"])


@needs_openblas
def test_the_routes_say_which_gemm_each_step_runs() -> None:
    """One float32 sequence, 32 hidden units: OpenBLAS's gemv, MKL's gemm and the hand-written
    loop round differently here (checked), so the bits say which route ran."""
    weights = bent_weights(32, 2, torch.float32)
    u, sizes = packed_inputs([9], torch.float32)

    def run(**how: Any) -> torch.Tensor:
        return rollout_cpu.rollout_packed_numba(u, sizes, *weights, **how)[0]

    runs = {
        name: run(routes=every_route(2, 1, route))
        for route, name in enumerate(rollout_cpu.ROUTE_NAMES)
    }
    for a, b in (("loop", "mkl"), ("loop", "openblas"), ("mkl", "openblas")):
        assert not torch.equal(runs[a], runs[b]), (a, b)
        torch.testing.assert_close(runs[a], runs[b], atol=1e-5, rtol=0)
    assert torch.equal(run(gemm_from=2), runs["loop"])
    assert torch.equal(run(gemm_from=1), runs["mkl"])
    mixed = np.array([[LOOP, MKL], [LOOP, OPENBLAS]], dtype=np.int8)  # layer by layer
    assert not torch.equal(run(routes=mixed), runs["mkl"])
    assert not torch.equal(run(routes=mixed), runs["openblas"])


def test_the_route_table_without_a_plan_is_the_loop_then_mkl() -> None:
    table = rollout_cpu.route_table(2, 5, gemm_from=3)
    assert table.dtype == np.int8
    assert table.tolist() == [[LOOP, LOOP, LOOP, MKL, MKL, MKL]] * 2
    assert rollout_cpu.route_table(1, 2, gemm_from=0).tolist() == [[LOOP, MKL, MKL]]
    default = rollout_cpu.route_table(1, 4)
    assert default.tolist() == [
        [LOOP] * rollout_cpu.GEMM_FROM + [MKL] * (5 - rollout_cpu.GEMM_FROM)
    ]


@needs_openblas
def test_a_plan_holds_for_its_widths_and_mkl_takes_the_wider_steps() -> None:
    plan = np.array([[LOOP, OPENBLAS, LOOP], [LOOP, LOOP, OPENBLAS]], dtype=np.int8)
    assert rollout_cpu.route_table(2, 4, routes=plan).tolist() == [
        [LOOP, OPENBLAS, LOOP, MKL, MKL],
        [LOOP, LOOP, OPENBLAS, MKL, MKL],
    ]
    assert rollout_cpu.route_table(2, 1, routes=plan).tolist() == [[LOOP, OPENBLAS], [LOOP, LOOP]]


def test_a_wrong_plan_is_refused_before_the_loop() -> None:
    plan = every_route(2, 3, LOOP)
    with pytest.raises(ValueError, match=r"^give routes or gemm_from, not both$"):
        rollout_cpu.route_table(2, 3, gemm_from=2, routes=plan)
    with pytest.raises(ValueError, match=r"shape \[3, W \+ 1\]"):
        rollout_cpu.route_table(3, 3, routes=plan)
    for wrong in (plan + 3, plan - 1):
        with pytest.raises(ValueError, match="only loop, mkl, openblas"):
            rollout_cpu.route_table(2, 3, routes=wrong)
    weights = bent_weights(8, 3, torch.float32)
    u, sizes = packed_inputs([4, 2], torch.float32)
    with pytest.raises(ValueError, match=r"shape \[3, W \+ 1\]"):
        rollout_cpu.rollout_packed_numba(u, sizes, *weights, routes=plan)


def test_a_plan_naming_a_missing_openblas_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_cpu, "_OPENBLAS", None)
    with pytest.raises(ValueError, match=r"^this numpy bundles no OpenBLAS: no openblas route$"):
        rollout_cpu.route_table(1, 3, routes=every_route(1, 3, OPENBLAS))


def seconds(loop: list[float], mkl: list[float], openblas: list[float]) -> np.ndarray:
    """[3, 1, W + 1] times of one layer (column 0 unused)."""
    return np.array([[[0.0, *loop]], [[0.0, *mkl]], [[0.0, *openblas]]])


def test_the_fastest_route_replaces_the_unplanned_one_only_beyond_the_margin() -> None:
    assert rollout_cpu.GEMM_FROM == 2
    assert rollout_cpu.PLAN_MARGIN == 0.9
    times = seconds(
        loop=[10.0, 30, 30, 30, 30, 8.0],
        mkl=[20.0, 10, 10, 10, 10, 10.0],
        openblas=[8.0, 9.5, 8.9, 20, 9.0, np.inf],
    )
    # width 1: 8 vs the loop's 10 (0.8x): OpenBLAS; 2: 9.5 vs MKL's 10 (0.95x): MKL stays;
    # 3: 8.9 (0.89x): OpenBLAS; 4: MKL fastest; 5: 9 (0.9x, the margin's edge): MKL stays;
    # 6: the loop at 0.8x MKL
    assert rollout_cpu.fastest_routes(times).tolist() == [
        [LOOP, OPENBLAS, MKL, OPENBLAS, MKL, MKL, LOOP]
    ]


def test_a_plan_of_several_layers_is_made_layer_by_layer() -> None:
    times = np.concatenate(
        [seconds([5.0, 9], [9.0, 9], [9.0, 1]), seconds([1.0, 9], [9.0, 9], [0.5, 9])], axis=1
    )
    assert rollout_cpu.fastest_routes(times).tolist() == [
        [LOOP, LOOP, OPENBLAS],
        [LOOP, OPENBLAS, MKL],
    ]


@needs_openblas
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_measure_routes_times_every_route_of_every_layer_shape(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    timed: list[tuple[Any, ...]] = []
    real = rollout_cpu._fastest_seconds_per_call

    def spy(fns: dict[int, Any]) -> dict[int, float]:
        calls.append((len(fns), fns[LOOP].args[4]))  # routes timed, width
        timed.extend((key, *fn.args) for key, fn in fns.items())
        return real(fns)

    monkeypatch.setattr(rollout_cpu, "_fastest_seconds_per_call", spy)
    dims = [(16, 32), (16, 32), (14, 32)]  # layers 0 and 1 share a shape: measured once
    times = rollout_cpu.measure_routes(dims, dtype, widths=3)
    assert times.shape == (3, 3, 4)
    assert calls == [(3, 1), (3, 2), (3, 3)] * 2
    assert np.isinf(times[:, :, 0]).all()
    assert np.isfinite(times[:, :, 1:]).all()
    assert (times[:, :, 1:] > 0).all()
    np.testing.assert_array_equal(times[:, 0], times[:, 1])
    # each route is timed as the loop calls it: its number as int8, the layer's weights and
    # three rows of inputs in the plan's dtype, and the scratch arrays the loop passes
    want = np.float32 if dtype == torch.float32 else np.float64
    packs = want == np.float32 and rollout_cpu._MKL_PACK is not None
    for key, route, z, w, packed, _b, g, ints, longs, scalars in timed:
        assert isinstance(route, np.int8)
        assert route == key
        assert (z.dtype, w.dtype, g.dtype, scalars.dtype) == (want,) * 4
        assert (z.shape[0], g.shape, scalars.shape) == (3, (3, 32), (2,))
        assert w.shape in {(16, 32), (14, 32)}
        assert z.shape[1] == w.shape[0]
        assert (ints.dtype, ints.shape) == (np.int32, (8,))
        assert (longs.dtype, longs.shape) == (np.int64, (9,))
        assert packed.dtype == np.uint8
        assert (packed.size > 0) == packs  # MKL timed on packed weights where it can pack


def test_only_the_routes_this_build_has_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_cpu, "_OPENBLAS", object())
    monkeypatch.setattr(rollout_cpu, "BLAS", "mkl")
    assert rollout_cpu._available_routes() == (LOOP, MKL, OPENBLAS)
    monkeypatch.setattr(rollout_cpu, "BLAS", "none")
    assert rollout_cpu._available_routes() == (LOOP, OPENBLAS)
    monkeypatch.setattr(rollout_cpu, "_OPENBLAS", None)
    assert rollout_cpu._available_routes() == (LOOP,)


def test_the_timer_keeps_the_fastest_sample_of_each_route(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.1, 4.0, 4.8, 5.0, 5.2, 6.0, 6.3, 7.0, 8.0])
    monkeypatch.setattr(rollout_cpu.time, "perf_counter", lambda: next(clock))
    ran: list[tuple[str, int]] = []

    def route(name: str) -> Any:
        return lambda n: ran.append((name, n))

    best = rollout_cpu._fastest_seconds_per_call({0: route("a"), 1: route("b")})
    # each route: one untimed call, one sample of 1 call that already lasts >= _SAMPLE_S, then
    # _SAMPLES samples in turns (a: 0.5, 0.8, 0.3 s; b: 0.1, 0.2, 1.0 s)
    assert rollout_cpu._SAMPLES == 3
    assert best == {0: pytest.approx(0.3), 1: pytest.approx(0.1)}
    assert ran == [("a", 1), ("a", 1), ("b", 1), ("b", 1)] + [("a", 1), ("b", 1)] * 3


def test_a_fast_route_is_sampled_over_doubling_calls_and_timed_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A route whose call is shorter than a sample is timed over 1, 2, 4... calls until a
    sample lasts _SAMPLE_S; its time is then a sample's over its number of calls."""

    def fast(n: int) -> None: ...

    def slow(n: int) -> None: ...

    per_call = {fast: 0.3 * rollout_cpu._SAMPLE_S, slow: 2.5 * rollout_cpu._SAMPLE_S}
    sampled: list[tuple[Any, int]] = []

    def sample(fn: Any, n: int) -> float:
        assert len(sampled) < 20, "the number of calls never grew to a sample's length"
        sampled.append((fn, n))
        return n * per_call[fn]

    monkeypatch.setattr(rollout_cpu, "_sample", sample)
    best = rollout_cpu._fastest_seconds_per_call({0: fast, 1: slow})
    # 0.3, 0.6, then 1.2 samples' length at 4 calls; the slow route's one call is long enough
    assert sampled[:4] == [(fast, 1), (fast, 2), (fast, 4), (slow, 1)]
    assert sampled[4:] == [(fast, 4), (slow, 1)] * rollout_cpu._SAMPLES
    assert best == {0: pytest.approx(per_call[fast]), 1: pytest.approx(per_call[slow])}


@needs_openblas
def test_the_openblas_route_runs_on_one_thread_and_puts_the_count_back() -> None:
    set_threads = rollout_cpu._OPENBLAS_THREADS
    before = set_threads(2)
    try:
        with rollout_cpu._one_openblas_thread(every_route(1, 1, OPENBLAS)):
            assert set_threads(1) == 1
        assert set_threads(2) == 2
        with rollout_cpu._one_openblas_thread(every_route(1, 1, MKL)):  # no OpenBLAS: untouched
            assert set_threads(2) == 2
    finally:
        set_threads(before)


@needs_openblas
def test_plan_routes_measures_once_per_shape_and_the_plan_cannot_be_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[tuple[tuple[int, int], ...]] = []

    def fake(dims: Any, dtype: torch.dtype, widths: int) -> np.ndarray:
        measured.append(tuple(dims))
        assert dtype == torch.float32  # timed in the dtype it was asked for
        return seconds([1.0] * widths, [2.0] * widths, [0.5] * widths)

    monkeypatch.setattr(rollout_cpu, "measure_routes", fake)
    rollout_cpu._plan.cache_clear()
    try:
        w_cat = bent_weights(4, 1, torch.float32)[0]
        plan = rollout_cpu.plan_routes(w_cat, widths=2)
        assert rollout_cpu.plan_routes(w_cat, widths=2) is plan
        assert measured == [((12, 16),)]  # layer 0: p (2) + h (4) + 6 inputs rows, 4H columns
        assert plan.tolist() == [[LOOP, OPENBLAS, OPENBLAS]]
        with pytest.raises(ValueError, match="read-only"):
            plan[0, 1] = MKL
    finally:
        rollout_cpu._plan.cache_clear()


@needs_openblas
def test_a_bound_rollout_runs_its_plan_for_calls_in_its_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The route table that reaches the compiled loop: the plan's for calls in the plan's
    dtype, the fixed one for another dtype, and a call's own ``gemm_from`` over the plan."""
    tables: list[list[list[int]]] = []
    real = rollout_cpu._run_loop

    def spy(args: dict[str, Any]) -> Any:
        tables.append(args["routes"].tolist())
        return real(args)

    monkeypatch.setattr(rollout_cpu, "_run_loop", spy)
    plan = every_route(2, 4, OPENBLAS)
    bound = rollout_cpu.NumbaRollout(plan, torch.float32)
    for dtype in (torch.float32, torch.float64):
        weights = bent_weights(8, 2, dtype)
        u, sizes = packed_inputs([3, 2], dtype)
        with torch.inference_mode():
            want = rollout_packed(u, sizes, *weights)
            assert_same(bound(u, sizes, *weights), want, dtype)
    weights = bent_weights(8, 2, torch.float32)
    u, sizes = packed_inputs([3, 2], torch.float32)
    bound(u, sizes, *weights, gemm_from=1)
    assert tables == [
        [[OPENBLAS] * 3] * 2,  # the plan, up to the 2 rows of the batch
        [[LOOP, LOOP, MKL]] * 2,  # float64: the fixed routes (GEMM_FROM = 2)
        [[LOOP, MKL, MKL]] * 2,  # its own choice wins
    ]


def test_a_plan_reads_as_runs_of_widths() -> None:
    routes = np.array([[LOOP, LOOP, OPENBLAS, OPENBLAS, MKL], [LOOP, OPENBLAS, MKL, LOOP, LOOP]])
    assert rollout_cpu.describe_routes(routes) == (
        "layer 0: loop 1, openblas 2-3, mkl 4-; layer 1: openblas 1, mkl 2, loop 3-4, mkl 5-"
    )


def test_a_bound_rollout_names_its_routes_and_dtype() -> None:
    routes = np.array([[LOOP, LOOP, MKL], [LOOP, OPENBLAS, MKL]], dtype=np.int8)
    planned = rollout_cpu.NumbaRollout(routes, torch.float32)
    want = "NumbaRollout(layer 0: loop 1, mkl 2-; layer 1: openblas 1, mkl 2-, torch.float32)"
    assert repr(planned) == want
    fixed = rollout_cpu.NumbaRollout(None, torch.float64)
    assert repr(fixed) == "NumbaRollout(fixed routes, torch.float64)"
