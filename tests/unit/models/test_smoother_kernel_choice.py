"""The smoother's kernel choice and state handling.

Every kernel gives the same numbers, so a model that runs the wrong one still matches the
references; these tests watch which kernel runs (spies that call the real kernel, or a stand-in
for triton whose output no real kernel could give), and check the values that only one
path can get right: an initial state of another dtype, a gradient that flows to the state alone,
the PackedSequence metadata that ``forward_with_state`` hands back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

import rnnserve.models.kernels.smoother_triton as triton_mod
import rnnserve.models.smoothing
from rnnserve.models.packing import pack, unpack
from rnnserve.models.smoothing import LinearRecursion

LENGTHS = [3, 6, 1, 4]  # out of sorted order, so sorted and original order differ


def make_model(kernel: str, dtype: torch.dtype = torch.float32) -> LinearRecursion:
    model = LinearRecursion(3).to(dtype)
    with torch.no_grad():
        model.alpha_smooth.copy_(torch.tensor([0.2, 0.5, 0.9]))
        model.wx.copy_(torch.tensor([0.7, 1.3, -0.4]))
    model.kernel = kernel  # type: ignore[assignment]
    return model.eval()


def seqs(dtype: torch.dtype = torch.float32) -> list[Tensor]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randn(n, 3, generator=gen, dtype=torch.float64).to(dtype) for n in LENGTHS]


def reference(
    xs: list[Tensor], model: LinearRecursion, init: Tensor | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """fp64 loop: ``tanh(wx * s)`` per sequence, and the final states (original order)."""
    a = model.alpha_smooth.detach().double().numpy()
    w = model.wx.detach().double().numpy()
    ys, finals = [], []
    for i, x in enumerate(xs):
        x64 = x.double().numpy()
        s = x64[0] if init is None else a * init[i].double().numpy() + (1 - a) * x64[0]
        out = [s]
        for t in range(1, len(x64)):
            s = a * s + (1 - a) * x64[t]
            out.append(s)
        ys.append(np.tanh(w * np.stack(out)))
        finals.append(s)
    return ys, np.stack(finals)


def check(out: PackedSequence, want: list[np.ndarray], atol: float = 1e-6) -> None:
    for got, w in zip(unpack(out), want, strict=True):
        np.testing.assert_allclose(got.double().numpy(), w, atol=atol, rtol=0)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kernels the model runs, in order; numba and torch still compute, triton is faked."""
    seen: list[str] = []

    def spy(name: str, real: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(
        rnnserve.models.smoothing,
        "ema_packed_numba",
        spy("numba", rnnserve.models.smoothing.ema_packed_numba),
    )
    monkeypatch.setattr(
        rnnserve.models.smoothing,
        "ema_packed_torch",
        spy("torch", rnnserve.models.smoothing.ema_packed_torch),
    )

    def fake_triton(data: Tensor, batch_sizes: Tensor, *rest: Any) -> tuple[Tensor, Tensor]:
        seen.append("triton")
        return torch.full_like(data, 7.0), torch.full((int(batch_sizes[0]), 3), 8.0)

    monkeypatch.setattr(triton_mod, "smooth_packed_triton", fake_triton)
    return seen


def test_auto_runs_numba_on_the_cpu_without_a_gradient(calls: list[str]) -> None:
    model = make_model("auto")
    xs = seqs()
    init = torch.linspace(-1, 1, 12).reshape(4, 3)
    with torch.inference_mode():
        out = model(pack(xs))
        assert calls == ["numba"]
        out2, final = model.forward_with_state(pack(xs), init)
    assert calls == ["numba", "numba"]
    check(out, reference(xs, model)[0])
    want, want_final = reference(xs, model, init)
    check(out2, want)
    np.testing.assert_allclose(final.double().numpy(), want_final, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_the_chosen_cpu_kernel_is_the_one_that_runs(kernel: str, calls: list[str]) -> None:
    model = make_model(kernel)
    xs = seqs()
    with torch.inference_mode():
        out = model(pack(xs))
        out2, final = model.forward_with_state(pack(xs))
    assert calls == [kernel, kernel]
    want, want_final = reference(xs, model)
    check(out, want)
    check(out2, want)
    np.testing.assert_allclose(final.double().numpy(), want_final, atol=1e-6, rtol=0)


def test_the_triton_kernel_answers_for_itself(calls: list[str]) -> None:
    """``kernel = "triton"`` hands the rows to the triton kernel; the epilogue is its own."""
    model = make_model("triton")
    packed = pack(seqs())
    with torch.inference_mode():
        out = model(packed)
        out2, final = model.forward_with_state(packed)
    assert calls == ["triton", "triton"]
    assert torch.equal(out.data, torch.full_like(packed.data, 7.0))  # not tanh'ed again
    assert torch.equal(out2.data, torch.full_like(packed.data, 7.0))
    assert torch.equal(final, torch.full((4, 3), 8.0))  # only reordered (a constant)


@pytest.mark.parametrize("kernel", ["numba", "torch", "auto"])
def test_a_float64_state_on_float32_rows_is_cast(kernel: str) -> None:
    model = make_model(kernel)
    xs = seqs()
    init = torch.tensor(
        [[0.1, -0.2, 0.3], [1.0, 0.5, -1.5], [0.25, 0.0, 2.0], [-0.7, 0.9, 0.4]],
        dtype=torch.float64,
    )
    with torch.inference_mode():
        out, final = model.forward_with_state(pack(xs), init)
    assert out.data.dtype == torch.float32
    assert final.dtype == torch.float32
    want, want_final = reference(xs, model, init)
    check(out, want)
    np.testing.assert_allclose(final.double().numpy(), want_final, atol=1e-6, rtol=0)


def test_a_gradient_reaches_the_state_when_only_the_state_needs_one() -> None:
    """alpha and wx frozen, the state trainable: ``auto`` must take the differentiable kernel.

    ``d s_{T-1} / d init = alpha ** T`` per feature, for a sequence of ``T`` steps.
    """
    model = make_model("auto", torch.float64)
    model.alpha_smooth.requires_grad_(False)
    model.wx.requires_grad_(False)
    xs = seqs(torch.float64)
    init = torch.zeros(4, 3, dtype=torch.float64, requires_grad=True)
    out, final = model.forward_with_state(pack(xs), init)
    assert final.requires_grad
    assert out.data.requires_grad
    final.sum().backward()
    assert init.grad is not None
    alpha = model.alpha_smooth.detach()
    want = torch.stack([alpha**n for n in LENGTHS])
    torch.testing.assert_close(init.grad, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_forward_with_state_keeps_the_packed_metadata(kernel: str) -> None:
    model = make_model(kernel)
    packed = pack(seqs())
    assert packed.sorted_indices is not None
    assert packed.unsorted_indices is not None
    with torch.inference_mode():
        out, _ = model.forward_with_state(packed)
    assert torch.equal(out.batch_sizes, packed.batch_sizes)
    assert out.sorted_indices is not None
    assert out.unsorted_indices is not None
    assert torch.equal(out.sorted_indices, packed.sorted_indices)
    assert torch.equal(out.unsorted_indices, packed.unsorted_indices)


def test_auto_runs_numba_when_nothing_needs_a_gradient(calls: list[str]) -> None:
    """Gradients enabled (no ``no_grad``) but every parameter frozen: the compiled loop runs."""
    model = make_model("auto")
    model.requires_grad_(False)
    xs = seqs()
    assert torch.is_grad_enabled()
    out = model(pack(xs))
    assert calls == ["numba"]
    assert not out.data.requires_grad
    check(out, reference(xs, model)[0])


def test_auto_runs_torch_for_half_precision_rows_on_the_cpu(calls: list[str]) -> None:
    """numba takes float32 and float64 only; float16 rows go to the torch loop."""
    model = make_model("auto")
    xs = [x.half() for x in seqs()]
    with torch.inference_mode():
        out = model(pack(xs))
    assert calls == ["torch"]
    check(out, reference(xs, model)[0], atol=1e-3)


def test_a_new_smoother_starts_from_alpha_one_half_and_unit_weights() -> None:
    model = LinearRecursion(4)
    assert model.alpha_smooth.tolist() == [0.5] * 4
    assert model.wx.tolist() == [1.0] * 4
    x = torch.tensor([[1.0, -2.0, 0.0, 4.0], [3.0, 2.0, 1.0, 0.0]])
    with torch.inference_mode():
        y = model(pack([x])).data
    s1 = 0.5 * x[0] + 0.5 * x[1]
    torch.testing.assert_close(y, torch.tanh(torch.stack([x[0], s1])))


def test_a_plain_tensor_is_refused_with_its_type_and_the_fix() -> None:
    with pytest.raises(TypeError) as info:
        make_model("auto")(torch.zeros(2, 3))  # type: ignore[arg-type]
    for words in ("PackedSequence", "got Tensor", "pack_sequence"):
        assert words in str(info.value)


def test_a_state_on_the_cpu_follows_rows_on_another_device() -> None:
    """The state and the last-step index are moved to the rows' device ("meta" stands in for a
    GPU here: it has shapes and devices but no values)."""
    model = make_model("torch").to("meta")
    packed = pack(seqs())
    rows = PackedSequence(
        packed.data.to("meta"), packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices
    )
    with torch.inference_mode():
        out, final = model.forward_with_state(rows, torch.zeros(4, 3))
        out2, final2 = model.forward_with_state(rows)
    for t in (out.data, final, out2.data, final2):
        assert t.device.type == "meta"
    assert tuple(final.shape) == tuple(final2.shape) == (4, 3)
