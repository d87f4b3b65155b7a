"""The Triton rollout's own edges, on the CPU under TRITON_INTERPRET=1 (or on CUDA).

Tiles are given explicitly where they matter: the interpreter's default tiles put every hidden
unit in one program, the GPU's split rows and units over many programs, and masks at block
edges are where kernels break. Shapes are small: the interpreter pays per operation.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
import warnings
from typing import Any, List, Optional, Tuple  # noqa: UP035 - TorchScript reads these

import pytest
import torch
from torch import Tensor

rt = pytest.importorskip("rnnserve.models.kernels.rollout_triton")

from rnnserve.models.traveller import Traveller, rollout_backend_fn, rollout_packed  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.float32 if DEVICE.type == "cuda" else torch.float64
TOL = 1e-5 if DEVICE.type == "cuda" else 1e-12

GEMV = rt.KernelConfig(block_b=2, block_h=8, block_k=16, use_dot=False)  # rows < 16 path
DOT = rt.KernelConfig(block_b=16, block_h=16, block_k=16, use_dot=True)


def weights(
    num_inputs: int, hidden: int, layers: int, seed: int = 0
) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    """Fused weights of a random Traveller whose positions reach tanh's curve."""
    torch.manual_seed(seed)
    model = Traveller(num_inputs, hidden, layers).to(DTYPE)
    with torch.no_grad():
        model.output_layer.weight.mul_(12.0)
        model.output_layer.bias.mul_(4.0)
        model.lstm_layers.weight_ih_l0.mul_(3.0)
    w_cat, bias, w_out, b_out = model.fused_weights()
    move = [t.detach().to(DEVICE) for t in (*w_cat, *bias, w_out, b_out)]
    return move[:layers], move[layers : 2 * layers], move[-2], move[-1]


def packed(sizes: list[int], num_inputs: int, seed: int = 1) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(sizes), num_inputs, generator=gen, dtype=DTYPE).to(DEVICE)


def assert_same(got: tuple[Tensor, ...], want: tuple[Tensor, ...], tol: float = TOL) -> None:
    for name, g, w in zip(("positions", "h", "c", "p"), got, want, strict=True):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, atol=tol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


# batch sizes dropping inside chunks, to a single row, and B not a multiple of any block
RAGGED = [5, 5, 4, 2, 2, 1, 1]
RAGGED_WIDE = [19, 19, 17, 17, 9, 2]


@pytest.mark.parametrize(
    ("config", "sizes", "hidden", "num_inputs", "layers"),
    [
        (GEMV, RAGGED, 12, 3, 2),  # H not a power of two: a partial hidden block
        (GEMV, RAGGED, 8, 1, 3),
        (DOT, RAGGED_WIDE, 20, 6, 2),  # 2 row blocks (rows 19..31 masked), 2 hidden blocks
        (DOT, [16, 16, 16], 16, 17, 1),  # num_inputs over one K tile; one layer: h_top == h_0
    ],
)
def test_matches_rollout_packed_at_block_edges(
    config: object, sizes: list[int], hidden: int, num_inputs: int, layers: int
) -> None:
    w = weights(num_inputs, hidden, layers)
    u = packed(sizes, num_inputs)
    want = rollout_packed(u, sizes, *w)
    assert float(want[0].abs().max()) > 0.5  # tanh bends
    got = rt.TritonRollout(max_chunk=4, config=config)(u, sizes, *w)  # type: ignore[arg-type]
    assert_same(got, want)


@pytest.mark.parametrize("given", ["h0", "c0", "p0", "all"])
def test_given_state_is_used(given: str) -> None:
    sizes, hidden, layers = [5, 4, 4, 2], 8, 2
    w = weights(2, hidden, layers, seed=3)
    u = packed(sizes, 2, seed=4)
    gen = torch.Generator().manual_seed(5)
    state = {
        "h0": torch.randn(layers, 5, hidden, generator=gen, dtype=DTYPE).to(DEVICE),
        "c0": torch.randn(layers, 5, hidden, generator=gen, dtype=DTYPE).to(DEVICE),
        "p0": torch.rand(5, 2, generator=gen, dtype=DTYPE).to(DEVICE) - 0.5,
    }
    kwargs = state if given == "all" else {given: state[given]}
    want = rollout_packed(u, sizes, *w, **kwargs)
    assert not torch.allclose(want[0], rollout_packed(u, sizes, *w)[0])  # the state matters
    roll = rt.TritonRollout(config=GEMV)
    assert_same(roll(u, sizes, *w, **kwargs), want)
    if given == "all":  # the workspace keeps the last call's state; a call without starts at 0
        assert_same(roll(u, sizes, *w), rollout_packed(u, sizes, *w))


@pytest.mark.parametrize("max_chunk", [1, 2, 4, 64])
def test_steps_run_in_power_of_two_chunks(max_chunk: int) -> None:
    """T + 1 steps = full chunks + the binary digits of the rest; the counter ends at T + 1."""
    sizes, layers = [3, 3, 2, 2, 2, 1], 2  # 7 steps with the virtual last one
    w = weights(2, 4, layers)
    u = packed(sizes, 2)
    roll = rt.TritonRollout(max_chunk=max_chunk, graphs=False)
    got = roll(u, sizes, *w)
    assert_same(got, rollout_packed(u, sizes, *w))
    steps = len(sizes) + 1
    chunks = {1: 7, 2: 4, 4: 3, 64: 3}[max_chunk]  # 7 = 1+1+..., 2+2+2+1, 4+2+1, 4+2+1
    assert roll.launches == steps * layers + chunks + (layers + 1)  # + the compile step
    assert roll.replays == 0
    (ws,) = roll._workspaces.values()
    assert int(ws.base.item()) == steps


def test_one_workspace_per_bucket_and_no_stale_rows() -> None:
    """Batches of 5 and 7 share the 8-row bucket; rows a smaller batch leaves alone are not read."""
    w = weights(3, 8, 2, seed=6)
    roll = rt.TritonRollout(config=GEMV, graphs=False)  # launches counted one by one
    big, small = [7, 7, 5, 1], [5, 3, 3]
    u_big, u_small = packed(big, 3, seed=7), packed(small, 3, seed=8)
    assert_same(roll(u_big, big, *w), rollout_packed(u_big, big, *w))
    assert_same(roll(u_small, small, *w), rollout_packed(u_small, small, *w))
    assert [s.rows for s in roll._workspaces] == [8]
    assert roll.launches == 2 * (5 + 4) + 2 + 1 + 3  # steps * layers + advances + compile


def test_workspace_grows_and_drops_its_graphs() -> None:
    """More packed rows or steps than reserved: buffers grow, graphs on the old ones go."""
    w = weights(1, 4, 1, seed=9)
    roll = rt.TritonRollout(config=rt.KernelConfig(1, 8, 16, use_dot=False))
    sizes = [1, 1, 1]
    u = packed(sizes, 1, seed=10)
    assert_same(roll(u, sizes, *w), rollout_packed(u, sizes, *w))
    (ws,) = roll._workspaces.values()
    rows, steps = ws.u.shape[0], ws.sched.shape[1]
    ws.graphs[1] = object()  # type: ignore[assignment]
    ws.reserve(rows, steps)
    assert 1 in ws.graphs  # enough room: nothing moves
    ws.reserve(rows + 1, steps + 1)
    assert ws.graphs == {}
    assert ws.u.shape[0] == ws.out.shape[0] == 2 * rows
    assert ws.sched.shape[1] == 2 * steps
    assert_same(roll(u, sizes, *w), rollout_packed(u, sizes, *w))


def test_warm_up_reserves_the_bucket() -> None:
    roll = rt.TritonRollout()
    roll.warm_up(3, 1, 4, 2, dtype=DTYPE, device=DEVICE, rows=300, steps=200)
    (ws,) = roll._workspaces.values()
    assert ws.shape.rows == 4
    assert ws.u.shape[0] >= 300
    assert ws.sched.shape[1] >= 201
    w = weights(2, 4, 1)
    sizes = [4, 2]  # the same bucket: no new workspace
    u = packed(sizes, 2)
    assert_same(roll(u, sizes, *w), rollout_packed(u, sizes, *w))
    assert list(roll._workspaces.values()) == [ws]


def test_module_warm_up_covers_every_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = rt.TritonRollout()
    monkeypatch.setattr(rt, "_DEFAULT", shared)
    rt.warm_up(5, 1, 4, 2, dtype=DTYPE, device=DEVICE, max_steps=10)
    assert sorted(s.rows for s in shared._workspaces) == [1, 2, 4, 8]
    assert {s.dtype for s in shared._workspaces} == {DTYPE}  # the served dtype's buckets


@pytest.mark.slow  # hundreds of interpreted rollout steps
@pytest.mark.parametrize("steps", [255, 256])
def test_a_warm_bucket_takes_its_longest_rollout_without_growing(steps: int) -> None:
    """After ``warm_up(steps=S)`` a rollout of S steps (S + 1 launches) fits the workspace as
    it is: growing it would drop the CUDA graphs captured at start-up."""
    roll = rt.TritonRollout(config=GEMV)
    roll.warm_up(2, 1, 4, 2, dtype=DTYPE, device=DEVICE, rows=2 * steps, steps=steps)
    (ws,) = roll._workspaces.values()
    u_buffer, sched = ws.u, ws.sched
    sizes = [2] * steps
    u = packed(sizes, 2)
    w = weights(2, 4, 1)
    assert_same(roll(u, sizes, *w), rollout_packed(u, sizes, *w))
    assert ws.u is u_buffer
    assert ws.sched is sched


def test_module_warm_up_leaves_room_for_full_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bucket of ``rt.warm_up`` takes a full batch of ``max_steps`` steps as it is."""
    shared = rt.TritonRollout(config=GEMV)
    monkeypatch.setattr(rt, "_DEFAULT", shared)
    rt.warm_up(3, 1, 4, 2, dtype=DTYPE, device=DEVICE, max_steps=64)
    buffers = {shape.rows: (ws.u, ws.sched) for shape, ws in shared._workspaces.items()}
    assert sorted(buffers) == [1, 2, 4]
    w = weights(2, 4, 1)
    for rows in buffers:
        sizes = [rows] * 64
        u = packed(sizes, 2, seed=rows)
        assert_same(rt.rollout_packed_triton(u, sizes, *w), rollout_packed(u, sizes, *w))
    for shape, ws in shared._workspaces.items():
        assert (ws.u, ws.sched) == buffers[shape.rows]


def test_the_shared_rollout_passes_every_state_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rt, "_DEFAULT", rt.TritonRollout(config=GEMV))
    sizes, hidden, layers = [3, 3, 1], 8, 2
    w = weights(2, hidden, layers, seed=6)
    u = packed(sizes, 2, seed=7)
    gen = torch.Generator().manual_seed(8)
    h0, c0 = (torch.randn(layers, 3, hidden, generator=gen, dtype=DTYPE) for _ in range(2))
    p0 = torch.rand(3, 2, generator=gen, dtype=DTYPE) - 0.5
    state = {"h0": h0.to(DEVICE), "c0": c0.to(DEVICE), "p0": p0.to(DEVICE)}
    want = rollout_packed(u, sizes, *w, **state)
    for name in state:  # each part of the state changes the result
        without = {k: v for k, v in state.items() if k != name}
        assert not torch.allclose(want[0], rollout_packed(u, sizes, *w, **without)[0])
    assert_same(rt.rollout_packed_triton(u, sizes, *w, **state), want)


def test_a_capture_into_another_graph_is_refused_on_cuda_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its own graph replays cannot be captured into a caller's CUDA graph (the H200 run of
    2026-11-30: the attempt failed halfway, and later calls hit an illegal memory access)."""
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with pytest.raises(
        RuntimeError,
        match=r"^the triton rollout replays CUDA graphs of its own and cannot be captured into "
        r"another CUDA graph; call it outside torch.cuda.graph \(it needs no outer graph\)$",
    ):
        rt._refuse_capture(torch.device("cuda", 0))
    rt._refuse_capture(torch.device("cpu"))  # the interpreter captures nothing
    capturing[0] = False
    rt._refuse_capture(torch.device("cuda", 0))


def test_a_refused_call_touches_no_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(device: torch.device) -> None:
        raise RuntimeError(f"capturing on {device}")

    roll = rt.TritonRollout()
    monkeypatch.setattr(rt, "_refuse_capture", refuse)
    w = weights(2, 4, 1)
    sizes = [2, 1]
    with pytest.raises(RuntimeError, match="capturing on"):
        roll(packed(sizes, 2), sizes, *w)
    with pytest.raises(RuntimeError, match="capturing on"):
        roll.warm_up(2, 1, 4, 2, dtype=DTYPE, device=DEVICE)
    assert roll._workspaces == {}
    assert roll.launches == 0


def test_float32_matches_to_1e5() -> None:
    sizes = [3, 3, 2, 1]
    torch.manual_seed(11)
    w_cat, bias, w_out, b_out = Traveller(6, 16, 2).fused_weights()
    u = torch.randn(sum(sizes), 6)
    want = rollout_packed(u, sizes, w_cat, bias, w_out, b_out)
    on = [t.detach().to(DEVICE) for t in (u, *w_cat, *bias, w_out, b_out)]
    got = rt.rollout_packed_triton(on[0], sizes, on[1:3], on[3:5], on[5], on[6])
    for g, x in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), x, atol=1e-5, rtol=0)


def test_bad_arguments_are_refused() -> None:
    w = weights(2, 4, 1)
    u = packed([2, 1], 2)
    roll = rt.TritonRollout()
    with pytest.raises(ValueError, match="non-increasing"):
        roll(u, [1, 2], *w)
    with pytest.raises(ValueError, match="sum to 2 but u has 3 rows"):
        roll(u, [1, 1], *w)
    with pytest.raises(ValueError, match="non-empty"):
        roll(u[:0], [], *w)
    with pytest.raises(ValueError, match=r"h0 must have shape \[1, 2, 4\]"):
        roll(u, [2, 1], *w, h0=torch.zeros(1, 3, 4, dtype=DTYPE, device=DEVICE))
    with pytest.raises(ValueError, match=r"u must be \[N, 2\]"):
        roll(u[:, :1], [2, 1], *w)
    with pytest.raises(ValueError, match="share dtype"):
        roll(u.double() if DEVICE.type == "cuda" else u.float(), [2, 1], *w)
    with pytest.raises(TypeError, match="float32 or float64"):
        roll(u.half(), [2, 1], *w)
    with pytest.raises(ValueError, match="power of two"):
        rt.TritonRollout(max_chunk=48)
    with pytest.raises(ValueError, match="precision"):
        rt.TritonRollout(precision="tf16")


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rt.check_device(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rollout_backend_fn("triton", torch.device("cpu"))
    rt.check_device(torch.device("cuda"))  # no error: where it is meant to run


def test_auto_picks_triton_on_cuda() -> None:
    assert rollout_backend_fn("auto", torch.device("cuda"))[1] == "triton"


def test_tiles() -> None:
    assert [rt.bucket_rows(b) for b in (1, 2, 3, 16, 17, 1000)] == [1, 2, 4, 16, 32, 1024]
    for rows in (1, 2, 8, 16, 64, 1024):
        for interpret in (False, True):
            cfg = rt.kernel_config(rows, 128, interpret=interpret)
            assert cfg.use_dot == (rows >= 16)
            if cfg.use_dot:
                assert min(cfg.block_b, cfg.block_h, cfg.block_k) >= 16  # tl.dot's minimum
            assert cfg.block_b <= rows
    assert rt.kernel_config(1024, 128).block_h == 16  # 128 programs a layer on the GPU


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@pytest.mark.parametrize("hidden", [4, 8, 16, 100, 128, 256])
def test_tiles_are_powers_of_two_for_every_bucket(hidden: int) -> None:
    """tl.arange needs powers of two: every tile of every bucket, on the GPU and interpreted."""
    for rows in (1 << i for i in range(12)):
        for interpret in (False, True):
            cfg = rt.kernel_config(rows, hidden, interpret=interpret)
            tiles = (cfg.block_b, cfg.block_h, cfg.block_k)
            assert all(_pow2(t) for t in tiles), (rows, hidden, interpret, tiles)


def test_tiles_follow_the_documented_policy() -> None:
    """Under 16 rows: broadcast-and-sum, 8 hidden units a program on the GPU (more programs
    stream the weights), all units in one program interpreted (up to 64), and K tiles of about
    2048 elements (16 to 128); from 16 rows: tl.dot with 16-row tiles up to 128 rows, 32 up to
    512, 64 (on 8 warps) from 1024, 16 hidden units on the GPU."""
    sizes = (1, 2, 4, 8, 16, 128, 256, 512, 1024, 2048)
    gpu = {rows: rt.kernel_config(rows, 128) for rows in sizes}
    assert [(c.block_b, c.block_h, c.block_k, c.use_dot, c.num_warps) for c in gpu.values()] == [
        (1, 8, 128, False, 4),
        (2, 8, 128, False, 4),
        (4, 8, 64, False, 4),
        (8, 8, 32, False, 4),
        (16, 16, 32, True, 4),
        (16, 16, 32, True, 4),
        (32, 16, 32, True, 4),
        (32, 16, 32, True, 4),
        (64, 16, 32, True, 8),
        (64, 16, 32, True, 8),
    ]
    interpreted = [rt.kernel_config(rows, 128, interpret=True) for rows in (1, 2, 8, 16, 256, 1024)]
    assert [(c.block_b, c.block_h, c.block_k) for c in interpreted] == [
        (1, 64, 32),
        (2, 64, 16),
        (8, 64, 16),
        (16, 64, 32),
        (32, 64, 32),
        (64, 64, 32),
    ]
    assert rt.kernel_config(4, 4, interpret=True).block_h == 8  # at least 8 units
    assert rt.kernel_config(32, 8, interpret=True).block_h == 16  # tl.dot's minimum


def _scripted_caller(
    u: Tensor,
    batch_sizes: List[int],  # noqa: UP006
    w_cat: List[Tensor],  # noqa: UP006
    bias: List[Tensor],  # noqa: UP006
    w_out: Tensor,
    b_out: Tensor,
    h0: Optional[Tensor],  # noqa: UP045
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:  # noqa: UP006
    return torch.ops.rnnserve.rollout_triton(u, batch_sizes, w_cat, bias, w_out, b_out, h0)


def test_custom_op_is_callable_from_torchscript() -> None:
    op = rt.rollout_op()
    assert rt.rollout_op() is op  # registered once
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(_scripted_caller)
    sizes = [2, 2, 1]
    w_cat, bias, w_out, b_out = weights(3, 8, 2)
    u = packed(sizes, 3)
    h0 = torch.full((2, 2, 8), 0.1, dtype=DTYPE, device=DEVICE)
    got = scripted(u, sizes, w_cat, bias, w_out, b_out, h0)
    assert_same(tuple(got), rollout_packed(u, sizes, w_cat, bias, w_out, b_out, h0))


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    ("device", "want"),
    [(None, torch.device("cuda", 3)), ("cuda", torch.device("cuda", 3)), ("cuda:1", "cuda:1")],
)
def test_warm_up_keys_its_bucket_by_the_device_tensors_name(
    monkeypatch: pytest.MonkeyPatch, device: str | None, want: Any
) -> None:
    """A bucket is keyed by the device as the request tensors name it (``cuda:N``, never a bare
    ``cuda``, else the warm bucket is never found again); CUDA by default, with room for 1024
    rows and 1024 steps (1025 launches) unless told. Checked here without a GPU: the CUDA calls
    it makes are stood in for."""
    reserved: list[tuple[int, int]] = []

    class Workspace:
        lock = threading.Lock()

        def reserve(self, rows: int, steps: int) -> None:
            reserved.append((rows, steps))
            raise _Stop

    shapes: list[Any] = []
    roll = rt.TritonRollout()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(rt, "_on", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(rt, "_refuse_capture", lambda dev: None)
    monkeypatch.setattr(roll, "workspace", lambda shape: shapes.append(shape) or Workspace())
    kwargs = {} if device is None else {"device": device}
    with pytest.raises(_Stop):
        roll.warm_up(5, 2, 16, 3, **kwargs)
    (shape,) = shapes
    assert shape.device == torch.device(want)
    assert (shape.rows, shape.layers, shape.hidden, shape.num_inputs) == (8, 2, 16, 3)
    assert shape.dtype == torch.float32
    assert reserved == [(1024, 1025)]


def test_module_warm_up_defaults_to_cuda_and_1024_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    class Recorder:
        def warm_up(self, *args: Any, **kwargs: Any) -> None:
            calls.append((*args, kwargs))

    monkeypatch.setattr(rt, "_DEFAULT", Recorder())
    rt.warm_up(3, 2, 16, 6)
    assert calls == [
        (
            rows,
            2,
            16,
            6,
            {"dtype": torch.float32, "device": "cuda", "rows": rows * 1024, "steps": 1024},
        )
        for rows in (1, 2, 4)
    ]


class _FakeGraph:
    """A stand-in for torch.cuda.CUDAGraph: what was captured runs again at each replay."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.captures = 0

    def replay(self) -> None:
        for call in self.calls:
            call()


@pytest.fixture
def fake_graphs(monkeypatch: pytest.MonkeyPatch) -> list[_FakeGraph]:
    """CUDA graphs on the CPU: capture records each chunk's launches instead of running them
    (as a real capture queues nothing), replay runs them; returns every graph captured."""
    made: list[_FakeGraph] = []
    capturing: list[_FakeGraph] = []

    @contextlib.contextmanager
    def capture(graph: _FakeGraph, capture_error_mode: str = "global") -> Any:
        assert capture_error_mode == "thread_local"  # other threads may use CUDA meanwhile
        graph.captures += 1
        made.append(graph)
        capturing.append(graph)
        try:
            yield
        finally:
            capturing.pop()

    real_launch = rt.TritonRollout._launch

    def launch(self: Any, ws: Any, steps: int) -> None:
        if capturing:
            capturing[-1].calls.append(lambda: real_launch(self, ws, steps))
        else:
            real_launch(self, ws, steps)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(rt.TritonRollout, "_launch", launch)
    monkeypatch.setattr(rt.TritonRollout, "_use_graphs", lambda self, ws: True)
    return made


def test_graph_replays_compute_the_rollout_once_captured(fake_graphs: list[_FakeGraph]) -> None:
    """The CUDA-graph path, run on the CPU with graphs stood in for: 10 steps run as 11
    launches, chunks of 4 + 4 + 2 + 1 replayed from one graph per chunk size, each captured
    once and reused by the next call."""
    roll = rt.TritonRollout(config=GEMV, max_chunk=4)
    sizes = [3] * 6 + [1] * 4
    u = packed(sizes, 2, seed=12)
    w = weights(2, 8, 2, seed=12)
    want = rollout_packed(u, sizes, *w)
    assert_same(roll(u, sizes, *w), want)
    (ws,) = roll._workspaces.values()
    assert sorted(ws.graphs) == [1, 2, 4]
    assert roll.replays == 4
    assert [g.captures for g in fake_graphs] == [1, 1, 1]
    assert [len(g.calls) for g in fake_graphs] == [1, 1, 1]  # one chunk launch each
    assert_same(roll(u, sizes, *w), want)  # replayed, not captured again
    assert len(fake_graphs) == 3
    assert roll.replays == 8


def test_warm_up_captures_each_chunk_size_once(fake_graphs: list[_FakeGraph]) -> None:
    roll = rt.TritonRollout(config=GEMV, max_chunk=8)
    roll.warm_up(3, 1, 8, 2, dtype=DTYPE, device=DEVICE, rows=40, steps=20)
    (ws,) = roll._workspaces.values()
    assert sorted(ws.graphs) == [1, 2, 4, 8]
    assert [g.captures for g in fake_graphs] == [1, 1, 1, 1]
    captured = {steps: graph for steps, graph in ws.graphs.items()}
    sizes = [3] * 20
    u = packed(sizes, 2, seed=13)
    w = weights(2, 8, 1, seed=13)
    assert_same(roll(u, sizes, *w), rollout_packed(u, sizes, *w))  # 21 launches: 8+8+4+1
    assert ws.graphs == captured  # the warm graphs, none captured again
    assert len(fake_graphs) == 4
    assert roll.replays == 4


def test_options_are_kept_and_defaults_are_the_measured_ones() -> None:
    """Defaults: 64-step graphs, graphs on CUDA, ``ieee`` (1e-5 against the CPU), tiles by
    ``kernel_config``, PDL off (on the H200 it helped at B=1 and halved B=1024's speed)."""
    roll = rt.TritonRollout()
    assert (roll.max_chunk, roll.graphs, roll.precision, roll.config, roll.pdl) == (
        64, None, "ieee", None, False,
    )  # fmt: skip
    for precision in ("ieee", "tf32x3", "tf32"):
        roll = rt.TritonRollout(
            max_chunk=8, graphs=False, precision=precision, config=GEMV, pdl=True
        )
        assert (roll.max_chunk, roll.graphs, roll.precision, roll.config, roll.pdl) == (
            8, False, precision, GEMV, True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="precision must be ieee, tf32x3 or tf32, got 'bf16'"):
        rt.TritonRollout(precision="bf16")


def test_refusals_say_exactly_what_is_wrong() -> None:
    """Each refusal's whole message (anchored: a message with text around it is another one)."""
    w = weights(2, 4, 1)
    u = packed([2, 1], 2)
    roll = rt.TritonRollout()
    cases: list[tuple[Any, str]] = [
        (lambda: roll(u, [1, 2], *w), r"^batch_sizes must be non-increasing and positive$"),
        (lambda: roll(u[:0], [], *w), r"^batch_sizes must be non-empty and start >= 1$"),
        (
            lambda: roll(u, [2, 1], *w, c0=torch.zeros(1, 3, 4, dtype=DTYPE, device=DEVICE)),
            r"^c0 must have shape \[1, 2, 4\], got \[1, 3, 4\]$",
        ),
        (
            lambda: roll(u, [2, 1], *w, p0=torch.zeros(2, 3, dtype=DTYPE, device=DEVICE)),
            r"^p0 must have shape \[2, 2\], got \[2, 3\]$",
        ),
        (
            lambda: roll(u.double() if DEVICE.type == "cuda" else u.float(), [2, 1], *w),
            r"^weights and inputs must share dtype and device$",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_every_layer_weight_shape_is_checked() -> None:
    w_cat, bias, w_out, b_out = weights(2, 4, 2)
    u = packed([2, 1], 2)
    bad = [w_cat[0], w_cat[1][:-1]]  # layer 1 takes [h_0, h_1]: 8 rows, not 7
    with pytest.raises(ValueError, match=r"^weight of shape \[7, 16\], expected \[8, 16\]$"):
        rt.TritonRollout()(u, [2, 1], bad, bias, w_out, b_out)


def test_the_int32_index_bound_counts_the_two_output_columns() -> None:
    """u [N, NI] and the positions [N, 2] are indexed with int32: refused from 2**31 elements
    of the larger (checked on views that hold no memory)."""
    one = torch.zeros(1, 1)
    fits = 2**30 - 1  # 2 * fits < 2**31: the positions fit
    assert rt._check_sizes([fits], one.expand(fits, 1)) == [fits]
    with pytest.raises(ValueError, match=r"^more than 2\*\*31 input elements \(the kernels"):
        rt._check_sizes([2**30], one.expand(2**30, 1))
    assert rt._check_sizes([2**28 - 1], one.expand(2**28 - 1, 8)) == [2**28 - 1]
    with pytest.raises(ValueError, match="more than 2"):
        rt._check_sizes([2**28], one.expand(2**28, 8))


def test_the_cpu_refusal_names_the_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"^the triton rollout runs on CUDA tensors \(or on"):
        rt.check_device(torch.device("cpu"))


def test_pdl_is_ignored_on_the_cpu() -> None:
    """Programmatic dependent launch is a CUDA launch option: asked for on the CPU (the
    interpreter has no gdc_wait), the rollout runs without it."""
    sizes = [2, 2, 1]
    u = packed(sizes, 2, seed=14)
    w = weights(2, 4, 1, seed=14)
    assert_same(rt.TritonRollout(pdl=True)(u, sizes, *w), rollout_packed(u, sizes, *w))


def test_schedules_hold_t_plus_one_steps_and_no_stale_tail() -> None:
    """T steps run T + 1 launches: the schedule needs T + 1 entries, and a shorter call after a
    longer one reads only its own (a stale tail would miscount the lengths and so pick the
    wrong plane of h)."""
    roll = rt.TritonRollout(config=GEMV, max_chunk=64)
    w = weights(2, 4, 1, seed=15)
    # 130 entries, past the first schedule's 128; the short call below leaves 125 stale ones,
    # an odd number, so counting them would flip a row's h plane
    long_sizes = [2] * 129
    u = packed(long_sizes, 2, seed=15)
    assert_same(roll(u, long_sizes, *w), rollout_packed(u, long_sizes, *w))
    short = [2, 2, 1]
    u2 = packed(short, 2, seed=16)
    assert_same(roll(u2, short, *w), rollout_packed(u2, short, *w))


def test_the_workspace_precision_is_the_asked_one_for_float32_only() -> None:
    roll = rt.TritonRollout(precision="tf32x3", config=GEMV)
    w64 = weights(2, 4, 1)
    for dtype, want in ((torch.float32, "tf32x3"), (torch.float64, "ieee")):
        w = [[t.to(dtype) for t in w64[0]], [t.to(dtype) for t in w64[1]]]
        w += [w64[2].to(dtype), w64[3].to(dtype)]
        roll(packed([1], 2).to(dtype), [1], *w)
        (ws,) = [ws for shape, ws in roll._workspaces.items() if shape.dtype == dtype]
        assert ws.precision == want


def test_graphs_are_used_on_cuda_unless_turned_off() -> None:
    def ws(device: str) -> Any:
        return types.SimpleNamespace(shape=types.SimpleNamespace(device=torch.device(device)))

    for graphs, on_cuda in ((None, True), (True, True), (False, False)):
        roll = rt.TritonRollout(graphs=graphs)
        assert bool(roll._use_graphs(ws("cuda"))) is on_cuda
        assert not roll._use_graphs(ws("cpu"))  # the interpreter captures nothing


def test_a_traveller_without_inputs_runs_free() -> None:
    """num_inputs = 0: the rollout is driven by its fed-back position alone (u is [N, 0])."""
    sizes = [2, 2, 1]
    w = weights(0, 8, 2, seed=17)
    u = torch.zeros(sum(sizes), 0, dtype=DTYPE, device=DEVICE)
    got = rt.TritonRollout(config=GEMV)(u, sizes, *w)
    want = rollout_packed(u, sizes, *w)
    assert_same(got, want)
    assert float(want[0].abs().max()) > 0.05  # it moves


# H and NI off powers of two pad the K axes the broadcast path holds whole (H_PAD, NI_PAD);
# rows past the live ones make programs that load nothing before the dependency wait
@pytest.mark.parametrize(
    ("config", "sizes", "hidden", "num_inputs", "layers"),
    [
        (GEMV, [3, 3, 3, 1], 12, 5, 1),  # one layer: layer 0's h_0 is also the top
        (GEMV, [7, 6, 3, 3, 1], 20, 3, 3),  # 4 row blocks, the last 3 dropping out
        (rt.KernelConfig(4, 8, 16, use_dot=False), [5, 5, 2], 12, 9, 2),  # B = 5 on 4-row tiles
        (DOT, [17, 17, 3], 20, 6, 3),  # 2 row blocks, the second empty after step 1
        # the 64-row tiles of large batches: B = 70, a second block of 6 rows, then of 1
        (rt.KernelConfig(64, 16, 16, use_dot=True, num_warps=8), [70, 70, 65, 3], 20, 6, 2),
    ],
)
def test_hoisted_weights_match_rollout_packed(
    config: object, sizes: list[int], hidden: int, num_inputs: int, layers: int
) -> None:
    w = weights(num_inputs, hidden, layers, seed=21)
    u = packed(sizes, num_inputs, seed=22)
    want = rollout_packed(u, sizes, *w)
    assert float(want[0].abs().max()) > 0.5  # tanh bends
    got = rt.TritonRollout(max_chunk=2, config=config)(u, sizes, *w)  # type: ignore[arg-type]
    assert_same(got, want)


class _KernelRecorder:
    """A stand-in for a Triton kernel: records each launch's keyword arguments."""

    def __init__(self) -> None:
        self.launches: list[dict[str, Any]] = []

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self.launches.append(kwargs)


def test_with_pdl_a_chunks_first_launch_is_a_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step kernels read the step counter before their dependency wait, and the first
    launch of a chunk follows the counter's advance: only that launch is not a dependent one
    (checked without a GPU: the kernels are stood in for)."""
    step, advance = _KernelRecorder(), _KernelRecorder()
    monkeypatch.setattr(rt, "_layer_step_kernel", step)
    monkeypatch.setattr(rt, "_advance_kernel", advance)
    shape = rt._Shape(4, 3, 8, 2, torch.float32, torch.device("cuda", 0))
    ws = types.SimpleNamespace(
        shape=shape, config=GEMV, precision="ieee", sched=torch.zeros(2, 8, dtype=torch.int32),
        h=None, c=None, p=None, out=None, u=None, w=[None] * 3, b=[None] * 3, w_out=None,
        b_out=None, base=None,
    )  # fmt: skip
    rt.TritonRollout(pdl=True)._launch(ws, 2)  # type: ignore[arg-type]
    plan = [(kw["FIRST"], kw["PDL"], kw.get("launch_pdl", False)) for kw in step.launches]
    assert plan == [
        (True, True, False), (False, True, True), (False, True, True),  # step 0: layer 0 plain
        (True, True, True), (False, True, True), (False, True, True),
    ]  # fmt: skip
    assert len(advance.launches) == 1
    assert {(kw["H_PAD"], kw["NI_PAD"]) for kw in step.launches} == {(8, 2)}
    step.launches.clear()
    rt.TritonRollout()._launch(ws, 1)  # type: ignore[arg-type]
    assert [(kw["PDL"], "launch_pdl" in kw) for kw in step.launches] == [(False, False)] * 3


def test_with_pdl_the_compile_step_meets_both_kinds_of_first_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compiling a bucket runs 2 no-op steps with PDL on CUDA (layer 0 launched plain, then as a
    dependent launch: two binaries), 1 otherwise."""
    ran: list[int] = []
    monkeypatch.setattr(rt.TritonRollout, "_launch", lambda self, ws, steps: ran.append(steps))
    cuda = types.SimpleNamespace(
        shape=types.SimpleNamespace(device=torch.device("cuda", 0)), base=torch.zeros(1)
    )
    cpu = types.SimpleNamespace(shape=types.SimpleNamespace(device=DEVICE), base=torch.zeros(1))
    rt.TritonRollout(pdl=True)._compile(cuda)  # type: ignore[arg-type]
    rt.TritonRollout(pdl=False)._compile(cuda)  # type: ignore[arg-type]
    rt.TritonRollout(pdl=True)._compile(cpu)  # type: ignore[arg-type]
    assert ran == [2, 1, 1 if DEVICE.type == "cpu" else 2]
