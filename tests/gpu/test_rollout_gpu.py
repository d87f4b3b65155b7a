"""The Triton rollout on CUDA: against the CPU TorchScript path, graphs against plain launches.

Shapes are the benchmark's: B=1 T=1000, B=64 T=500, B=1024 T=200 (num_inputs 6, hidden 128, two
layers), with equal and ragged lengths. The speed report and tf32x3's error come out as warnings
(in pytest's summary, even with -q).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch

from rnnserve import models
from rnnserve.models.packing import pack
from rnnserve.models.traveller import RolloutFn, RolloutState, Traveller, scripted_rollout
from rnnserve.service.engine.chunked_rollout import ChunkedRollout
from tests.helpers import Chunk, serve_schedule

rt = pytest.importorskip("rnnserve.models.kernels.rollout_triton")

CUDA = torch.device("cuda")
SHAPES = [(1, 1000), (64, 500), (1024, 200)]


def served() -> Traveller:
    model = models.load("traveller", rollout_backend="torchscript")
    assert isinstance(model, Traveller)
    return model


def bent(hidden: int = 128, seed: int = 0) -> Traveller:
    """A random model whose positions swing into tanh's curve (for short rollouts only: its
    feedback gain is high, so over long ones any rounding difference grows)."""
    torch.manual_seed(seed)
    model = Traveller(6, hidden, 2).eval()
    with torch.no_grad():
        model.output_layer.weight.mul_(40.0)
        model.output_layer.bias.mul_(4.0)
        model.lstm_layers.weight_ih_l0.mul_(3.0)
    return model


def inputs(batch: int, steps: int, ragged: bool, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if ragged:  # lengths spread steps/2 .. steps, the longest exactly steps
        lengths = torch.randint(steps // 2, steps + 1, (batch,), generator=gen).tolist()
        lengths[0] = steps
    else:
        lengths = [steps] * batch
    return [torch.randn(n, 6, generator=gen) for n in lengths]


def clone(model: Traveller, device: torch.device) -> Traveller:
    twin = Traveller(model.num_inputs, model.hidden_size, model.num_layers).eval()
    twin.load_state_dict(model.state_dict())
    return twin.to(device)


def cpu_and_cuda(
    model: Traveller, seqs: list[torch.Tensor], roll: object = None
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(positions, h, c, p) from the CPU TorchScript path and from the Triton path on CUDA."""
    cpu, gpu = clone(model, torch.device("cpu")), clone(model, CUDA)
    cpu.compile_rollout("torchscript")
    gpu.compile_rollout("triton")
    if roll is not None:
        gpu._rollout_fn = roll  # type: ignore[assignment]
    with torch.inference_mode():
        ref, ref_state = cpu.rollout_with_state(pack(seqs))
        out, state = gpu.rollout_with_state(pack(seqs, CUDA))
        torch.cuda.synchronize()
    want = (ref.data, ref_state.h, ref_state.c, ref_state.p)
    got = tuple(t.cpu() for t in (out.data, state.h, state.c, state.p))
    return want, got


def assert_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], tol: float) -> None:
    for name, g, w in zip(("positions", "h", "c", "p"), got, want, strict=True):
        err = float((g - w).abs().max())
        assert err <= tol, f"{name}: max |triton - cpu| = {err:.3g} > {tol:g}"


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize(("batch", "steps"), SHAPES)
def test_matches_cpu_torchscript(batch: int, steps: int, ragged: bool) -> None:
    if batch == 1 and ragged:
        pytest.skip("one sequence is never ragged")
    want, got = cpu_and_cuda(served(), inputs(batch, steps, ragged))
    assert_close(got, want, 1e-5)


@pytest.mark.parametrize("batch", [1, 5, 64, 300])
def test_matches_cpu_where_tanh_bends(batch: int) -> None:
    want, got = cpu_and_cuda(bent(), inputs(batch, 60, ragged=True, seed=batch))
    assert float(want[0].abs().max()) > 0.6
    assert_close(got, want, 1e-5)


def test_auto_is_triton_on_cuda_and_serves() -> None:
    model = models.load("traveller", device=CUDA)
    assert isinstance(model, Traveller)
    assert model.rollout_backend == "triton"
    seqs = inputs(3, 50, ragged=True)
    with torch.inference_mode():
        out = model.rollout(pack(seqs, CUDA)).data.cpu()
        ref = served().rollout(pack(seqs)).data
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [1, 64])
def test_graph_replay_equals_plain_launches(batch: int) -> None:
    """Graphs, graphs with programmatic dependent launch, plain launches: the same numbers."""
    seqs = inputs(batch, 100, ragged=True, seed=3)
    rolls = {
        "graphs": rt.TritonRollout(graphs=True),
        "graphs+pdl": rt.TritonRollout(graphs=True, pdl=True),
        "plain": rt.TritonRollout(graphs=False),
        "plain+pdl": rt.TritonRollout(graphs=False, pdl=True),
    }
    results = {name: cpu_and_cuda(served(), seqs, roll)[1] for name, roll in rolls.items()}
    assert rolls["graphs"].replays > 0
    assert rolls["plain"].replays == 0
    for name, got in results.items():
        for g, p in zip(got, results["plain"], strict=True):
            torch.testing.assert_close(g, p, atol=0, rtol=0, msg=name)  # same launches, order


def test_graphs_are_reused_across_batch_sizes_of_a_bucket() -> None:
    roll = rt.TritonRollout(max_chunk=16)
    model = served()
    want, got = cpu_and_cuda(model, inputs(40, 37, ragged=True, seed=4), roll)
    assert_close(got, want, 1e-5)
    (ws,) = roll._workspaces.values()
    assert ws.shape.rows == 64
    graphs = dict(ws.graphs)
    assert set(graphs) == {16, 4, 2}  # 38 steps = 16 + 16 + 4 + 2
    for batch, steps in ((33, 20), (64, 22), (50, 38)):  # steps + 1 = 21, 23, 39: 16, 4, 2, 1
        want, got = cpu_and_cuda(model, inputs(batch, steps, ragged=True, seed=batch), roll)
        assert_close(got, want, 1e-5)
    assert list(roll._workspaces.values()) == [ws]
    assert all(ws.graphs[n] is g for n, g in graphs.items())  # captured once, replayed since
    assert set(ws.graphs) == {16, 4, 2, 1}
    cpu_and_cuda(model, inputs(65, 10, ragged=False), roll)  # 65 rows: the 128-row bucket
    assert sorted(s.rows for s in roll._workspaces) == [64, 128]


def test_warm_up_captures_every_chunk() -> None:
    roll = rt.TritonRollout(max_chunk=64)
    roll.warm_up(64, 2, 128, 6, device="cuda", rows=64 * 300, steps=300)
    (ws,) = roll._workspaces.values()
    before = dict(ws.graphs)
    assert set(before) == {64, 32, 16, 8, 4, 2, 1}
    want, got = cpu_and_cuda(served(), inputs(60, 300, ragged=True, seed=5), roll)
    assert_close(got, want, 1e-5)
    assert ws.graphs == before  # no capture (and no reallocation) during the call


def _chunked(
    model: Traveller, device: torch.device, seqs: list[torch.Tensor]
) -> tuple[dict[int, list[np.ndarray]], dict[int, RolloutState]]:
    """``seqs`` served as the service runs /rollout on ``device``, 16 steps a chunk: three
    requests join at different chunks (the second from a carried state, kept at its end), a
    fourth joins and leaves while running. Returns the outputs and final states by request."""
    arrays = [u.numpy() for u in seqs]
    start = RolloutState(
        torch.full((model.num_layers, 2, model.hidden_size), 0.1),
        torch.full((model.num_layers, 2, model.hidden_size), -0.2),
        torch.tensor([[0.3, -0.3], [0.0, 0.5]]),
    )
    engine = ChunkedRollout(model, device, 16)
    schedule: list[Chunk] = [
        ([(1, arrays[0:3])], [], {}, []),
        ([(2, arrays[3:5])], [], {2: start}, [2]),
        ([(3, arrays[5:6]), (4, arrays[6:7])], [], {}, []),
        ([], [4], {}, []),
    ]
    return serve_schedule(engine, schedule)


def test_chunked_rollout_on_cuda_equals_the_cpu_path() -> None:
    """Continuous batching on CUDA: the state moved in and out of the device, the chunks packed
    longest first without a sort, joins, a leave; every output and kept state as on the CPU."""
    seqs = inputs(7, 90, ragged=True, seed=9)
    cpu, gpu = clone(served(), torch.device("cpu")), clone(served(), CUDA)
    cpu.compile_rollout("torchscript")
    gpu.compile_rollout("triton")
    want, want_states = _chunked(cpu, torch.device("cpu"), seqs)
    got, got_states = _chunked(gpu, CUDA, seqs)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for key in want:
        for g, w in zip(got[key], want[key], strict=True):
            assert g.dtype == np.float32
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
    (state,) = got_states.values()
    assert state.h.device.type == "cpu"
    want_state = want_states[2]
    for g, w in ((state.h, want_state.h), (state.c, want_state.c), (state.p, want_state.p)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_tf32x3_error_is_reported() -> None:
    """tl.dot on tensor cores in three TF32 passes; reports its error (it may replace "ieee" for
    large batches if it holds 1e-5 here; plain TF32 would not)."""
    roll = rt.TritonRollout(precision="tf32x3")
    want, got = cpu_and_cuda(served(), inputs(1024, 200, ragged=True, seed=6), roll)
    errs = [float((g - w).abs().max()) for g, w in zip(got, want, strict=True)]
    warnings.warn(f"tf32x3 B=1024 T=200: max error positions/h/c/p = {errs}", stacklevel=1)
    assert max(errs) < 1e-3


def _time(fn: Callable[[], object], repeat: int = 3) -> float:
    """Median seconds per call after one warm-up call, with the device synchronised."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def test_speed_report() -> None:
    """µs per step: Triton with graphs, with PDL, with tf32x3, and TorchScript on CUDA (targets:
    B=1 <= 6, B=64 <= 10, B=1024 <= 15). Reported as a warning, not asserted: one run is no
    benchmark."""
    model = served().to(CUDA)
    weights = model.fused_weights()
    fns: dict[str, RolloutFn] = {
        "triton": rt.TritonRollout(),
        "triton pdl": rt.TritonRollout(pdl=True),
        "triton tf32x3": rt.TritonRollout(precision="tf32x3"),
        "torchscript": scripted_rollout(),
    }
    lines = []
    for batch, steps in SHAPES:
        packed = pack(inputs(batch, steps, ragged=batch > 1, seed=7), CUDA)
        args = (packed.data, packed.batch_sizes.tolist(), *weights)
        cells = []
        with torch.inference_mode():
            for name, fn in fns.items():
                seconds = _time(functools.partial(fn, *args))
                cells.append(f"{name} {seconds / steps * 1e6:7.1f}")
        lines.append(f"B={batch:<5} T={steps:<5} µs/step: " + " | ".join(cells))
    warnings.warn("triton rollout speed:\n" + "\n".join(lines), stacklevel=1)  # shown with -q
