"""The smoother's capturable inner entry, ``launch_forward``: kernel launches on preallocated
tensors only, the same numbers as the public call, and launchable again on new inputs.

Run in Triton's interpreter on the CPU. "Allocates nothing" is checked with a torch function
mode that sees every torch call the host code makes (the interpreter's own work, which stands in
for the GPU, is left out): a call that returns a tensor on storage none of its arguments had is
an allocation, and the only call allowed at all is an in-place clear of the look-back's flags.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - tests/conftest.py sets it
    pytest.skip("runs the kernels in Triton's interpreter", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction

from rnnserve.models.kernels import smoother_triton as st
from rnnserve.models.packing import pack

TILES = {"chunk": 4}  # several chunks (and look-back windows) on a small batch
IN_PLACE = {"TensorBase.zero_"}  # the look-back clears its flags and ticket counter


class HostCalls(TorchFunctionMode):
    """Every torch call made outside kernel launches, and which of them allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.allocations: list[str] = []
        self.in_kernel = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.in_kernel or getattr(func, "__name__", "") == "__get__":  # attribute reads
            return out
        name = getattr(func, "__qualname__", repr(func))
        self.calls.append(name)
        known = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        if any(t.untyped_storage().data_ptr() not in known for t in _tensors(out)):
            self.allocations.append(name)
        return out


def _tensors(tree: Any) -> list[Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, Tensor)]


@pytest.fixture
def host_calls(monkeypatch: pytest.MonkeyPatch) -> HostCalls:
    spy = HostCalls()
    run = InterpretedFunction.run

    def launch(self: InterpretedFunction, *args: Any, **kwargs: Any) -> Any:
        spy.in_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            spy.in_kernel -= 1

    monkeypatch.setattr(InterpretedFunction, "run", launch)
    return spy


def batch(seed: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """Packed rows of three sequences (9, 6 and 2 steps, 3 features), their step sizes, and an
    initial state."""
    gen = torch.Generator().manual_seed(seed)
    packed = pack([torch.randn(n, 3, generator=gen, dtype=dtype) for n in (9, 6, 2)])
    return packed.data, packed.batch_sizes, torch.randn(3, 3, generator=gen, dtype=dtype)


def params(dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    return torch.tensor([0.3, 0.6, 0.9], dtype=dtype), torch.tensor([0.5, 1.0, 2.0], dtype=dtype)


@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
@pytest.mark.parametrize("scan", st.SCANS)
def test_inner_entry_gives_the_public_calls_numbers_and_allocates_nothing(
    host_calls: HostCalls, scan: str, with_state: bool
) -> None:
    data, sizes, state = batch(0)
    alpha, wx = params()
    init = state if with_state else None
    want_y, want_final = st.smooth_packed_triton(data, sizes, alpha, wx, init, scan=scan, **TILES)
    buf = st.prepare_forward(data, sizes, alpha, wx, init, scan=scan, **TILES)
    buf.y.fill_(float("nan"))
    buf.final.fill_(float("nan"))
    with host_calls:
        st.launch_forward(buf)
    assert host_calls.allocations == []
    assert set(host_calls.calls) <= IN_PLACE
    assert torch.equal(buf.y, want_y)
    assert torch.equal(buf.final, want_final)


@pytest.mark.parametrize("scan", st.SCANS)
def test_inner_entry_launched_again_on_new_inputs_computes_them(
    host_calls: HostCalls, scan: str
) -> None:
    """What a CUDA graph replay over rotating inputs does: the same buffers, new rows."""
    data, sizes, _ = batch(1)
    other, _, _ = batch(2)
    alpha, wx = params()
    buf = st.prepare_forward(data, sizes, alpha, wx, scan=scan, **TILES)
    st.launch_forward(buf)
    buf.x.copy_(other)
    with host_calls:
        st.launch_forward(buf)
    assert host_calls.allocations == []
    want_y, want_final = st.smooth_packed_triton(other, sizes, alpha, wx, scan=scan, **TILES)
    assert torch.equal(buf.y, want_y)
    assert torch.equal(buf.final, want_final)


def test_inner_entry_keeps_the_states_when_asked(host_calls: HostCalls) -> None:
    data, sizes, _ = batch(3, torch.float64)
    alpha, wx = params(torch.float64)
    buf = st.prepare_forward(data, sizes, alpha, wx, store_s=True, **TILES)
    with host_calls:
        st.launch_forward(buf)
    assert host_calls.allocations == []
    assert buf.s is not buf.y
    # y is the epilogue of the states the forward kept
    assert torch.allclose(buf.y, torch.tanh(wx * buf.s), atol=1e-12)


def test_the_public_call_runs_the_inner_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[st.ForwardBuffers] = []
    real = st.launch_forward

    def spy(buf: st.ForwardBuffers) -> None:
        launched.append(buf)
        real(buf)

    monkeypatch.setattr(st, "launch_forward", spy)
    data, sizes, _ = batch(4)
    alpha, wx = params()
    y, final = st.smooth_packed_triton(data, sizes, alpha, wx, **TILES)
    assert len(launched) == 1
    assert launched[0].y is y
    assert launched[0].final is final


def test_schedule_parts_start_on_16_byte_boundaries_for_any_step_count() -> None:
    for steps in range(1, 9):
        sizes = torch.ones(steps, dtype=torch.int64)
        for scan in st.SCANS:
            plan = st.plan_tiles(steps, 1, 3, scan=scan)
            parts = st.device_schedule(sizes, plan, torch.device("cpu"))
            assert [p is None for p in parts] == [False, False, scan != "chained"]
            for part in parts:
                if part is not None:
                    assert part.data_ptr() % 16 == 0, (steps, scan)
            bs, off, _ = parts
            assert bs.tolist() == [1] * steps
            assert off.tolist() == list(range(steps))


def test_an_unaligned_view_of_the_rows_is_copied_to_an_aligned_one() -> None:
    base = torch.arange(3 * 18, dtype=torch.float32).reshape(18, 3)
    _, sizes, _ = batch(0)
    data = base.view(-1)[1 : 1 + 17 * 3].view(17, 3)  # 4 bytes past an aligned start
    assert data.data_ptr() % 16 != 0
    alpha, wx = params()
    buf = st.prepare_forward(data, sizes, alpha, wx, **TILES)
    assert buf.x.data_ptr() % 16 == 0
    assert torch.equal(buf.x, data)
