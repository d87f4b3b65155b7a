"""The smoother's compiled CPU training path: forward values and gradients against autograd
through the torch step loop (the reference), numerical gradients, and training with it."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import rnnserve.models.smoothing
from rnnserve.models.kernels import ema_packed_torch, last_step_rows
from rnnserve.models.kernels.smoother_cpu import smooth_mse_packed_numba, smooth_packed_numba
from rnnserve.models.packing import pack
from rnnserve.models.smoothing import LinearRecursion

F = 3
LENGTH_SETS = {
    "one sequence of one step": [1],
    "all of length one": [1, 1, 1],
    "equal lengths": [6, 6, 6, 6],
    "mixed, with length one": [7, 1, 3, 7, 2],
    "random": None,  # drawn below, lengths 1..40
}


def lengths_for(name: str) -> list[int]:
    fixed = LENGTH_SETS[name]
    if fixed is not None:
        return fixed
    rng = np.random.default_rng(5)
    return [int(n) for n in rng.integers(1, 41, size=9)] + [1]


def inputs(
    lengths: list[int], with_init: bool, dtype: torch.dtype = torch.float64, seed: int = 0
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    packed = pack([torch.randn(n, F, generator=gen, dtype=torch.float64) for n in lengths])
    n_seqs = len(lengths)
    return {
        "x": packed.data.to(dtype),
        "bs": packed.batch_sizes,
        "alpha": (0.05 + 0.9 * torch.rand(F, generator=gen, dtype=torch.float64)).to(dtype),
        "wx": (2 * torch.rand(F, generator=gen, dtype=torch.float64) - 1).to(dtype) * 1.5,
        "init": torch.randn(n_seqs, F, generator=gen, dtype=torch.float64).to(dtype)
        if with_init
        else None,
        # weights of the loss, so every row and every final state gets its own gradient
        "gy": torch.randn(packed.data.shape, generator=gen, dtype=torch.float64).to(dtype),
        "gfin": torch.randn(n_seqs, F, generator=gen, dtype=torch.float64).to(dtype),
    }


def reference(
    x: Tensor, bs: Tensor, alpha: Tensor, wx: Tensor, init: Tensor | None
) -> tuple[Tensor, Tensor]:
    s = ema_packed_torch(x, bs, alpha, init)
    return torch.tanh(wx * s), s.index_select(0, last_step_rows(bs))


def compiled(
    x: Tensor, bs: Tensor, alpha: Tensor, wx: Tensor, init: Tensor | None
) -> tuple[Tensor, Tensor]:
    return smooth_packed_numba(x, bs, alpha, wx, init)


def values_and_grads(fn: Any, case: dict[str, Any]) -> dict[str, Tensor]:
    """``y``, the final state and the gradients of ``sum(gy * y) + sum(gfin * final)``."""
    leaves = {k: case[k].clone().requires_grad_(True) for k in ("x", "alpha", "wx")}
    if case["init"] is not None:
        leaves["init"] = case["init"].clone().requires_grad_(True)
    y, final = fn(leaves["x"], case["bs"], leaves["alpha"], leaves["wx"], leaves.get("init"))
    loss = (case["gy"] * y).sum() + (case["gfin"] * final).sum()
    loss.backward()
    out = {"y": y.detach(), "final": final.detach()}
    for name, leaf in leaves.items():
        # autograd gives None to a leaf the loss does not reach (alpha, when every sequence
        # is one step long and starts at x_0); the compiled backward gives zeros
        out[f"d{name}"] = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
    return out


@pytest.mark.parametrize("with_init", [False, True], ids=["s0=x0", "init"])
@pytest.mark.parametrize("name", list(LENGTH_SETS))
def test_values_and_gradients_equal_autograd_through_the_step_loop(
    name: str, with_init: bool
) -> None:
    case = inputs(lengths_for(name), with_init)
    want = values_and_grads(reference, case)
    got = values_and_grads(compiled, case)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-12, rtol=1e-12, msg=key)


@pytest.mark.parametrize("with_init", [False, True], ids=["s0=x0", "init"])
def test_gradients_pass_a_numerical_gradcheck(with_init: bool) -> None:
    case = inputs([5, 1, 3, 5, 2], with_init)
    bs = case["bs"]
    args = [case[k].clone().requires_grad_(True) for k in ("x", "alpha", "wx")]
    if with_init:
        args.append(case["init"].clone().requires_grad_(True))

    def fn(*a: Tensor) -> tuple[Tensor, Tensor]:
        return smooth_packed_numba(a[0], bs, a[1], a[2], a[3] if with_init else None)

    assert torch.autograd.gradcheck(fn, tuple(args), eps=1e-6, atol=1e-8)


def test_float32_gradients_follow_the_float64_ones_over_a_long_sequence() -> None:
    """Per-step partial sums in float32, totals in float64: thousands of steps stay close."""
    case64 = inputs([3000, 2000, 1], with_init=True)
    case32 = {
        k: (v.float() if isinstance(v, Tensor) and v.is_floating_point() else v)
        for k, v in case64.items()
    }
    want = values_and_grads(reference, case64)
    got = values_and_grads(compiled, case32)
    for key in want:
        scale = float(want[key].abs().max())
        torch.testing.assert_close(
            got[key].double(), want[key], atol=2e-5 * max(scale, 1.0), rtol=1e-4, msg=key
        )


def test_an_unused_output_has_no_gradient_to_give() -> None:
    """Only ``y`` in the loss (the final state unused), and only ``final`` in another."""
    case = inputs([4, 2, 4], with_init=True)
    for use in ("y", "final"):
        got, want = ({}, {})
        for fn, into in ((compiled, got), (reference, want)):
            alpha = case["alpha"].clone().requires_grad_(True)
            init = case["init"].clone().requires_grad_(True)
            y, final = fn(case["x"], case["bs"], alpha, case["wx"], init)
            ((y if use == "y" else final) * 1.7).sum().backward()
            into["alpha"], into["init"] = alpha.grad, init.grad
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-12, rtol=1e-12)


def test_rows_that_need_no_gradient_get_none_and_the_rest_are_unchanged() -> None:
    case = inputs([5, 3, 1], with_init=False)
    alpha = case["alpha"].clone().requires_grad_(True)
    x = case["x"].clone()
    y, _ = smooth_packed_numba(x, case["bs"], alpha, case["wx"])
    (case["gy"] * y).sum().backward()
    assert x.grad is None
    want = values_and_grads(reference, case | {"gfin": torch.zeros_like(case["gfin"])})["dalpha"]
    assert alpha.grad is not None
    torch.testing.assert_close(alpha.grad, want, atol=1e-12, rtol=1e-12)


def test_float32_parameters_on_float64_rows_get_float32_gradients() -> None:
    case = inputs([4, 2], with_init=False)
    alpha = case["alpha"].float().requires_grad_(True)
    wx = case["wx"].float().requires_grad_(True)
    y, _ = smooth_packed_numba(case["x"], case["bs"], alpha, wx)
    assert y.dtype == torch.float64
    y.sum().backward()
    assert alpha.grad is not None
    assert alpha.grad.dtype == torch.float32
    assert wx.grad is not None
    assert wx.grad.dtype == torch.float32


def test_a_backward_after_the_output_changed_in_place_is_refused() -> None:
    case = inputs([3, 2], with_init=False)
    alpha = case["alpha"].clone().requires_grad_(True)
    y, _ = smooth_packed_numba(case["x"], case["bs"], alpha, case["wx"])
    y.mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_rows_that_do_not_fit_the_batch_sizes_are_refused() -> None:
    case = inputs([3, 2], with_init=False)
    with pytest.raises(ValueError, match="batch_sizes sum to 5, not 4 rows"):
        smooth_packed_numba(case["x"][:4], case["bs"], case["alpha"], case["wx"])
    with pytest.raises(ValueError, match=r"state of shape \[2, 3\]"):
        smooth_packed_numba(case["x"], case["bs"], case["alpha"], case["wx"], torch.zeros(3, 3))
    with pytest.raises(ValueError, match="float32 or float64"):
        smooth_packed_numba(case["x"].half(), case["bs"], case["alpha"], case["wx"])


# --------------------------------------------------------------------------- the model


def denoising_batch(seed: int) -> tuple[list[Tensor], list[Tensor]]:
    """Noisy inputs and targets ``tanh(0.8 * clean)``: slow features, fast ones, mixed lengths."""
    gen = torch.Generator().manual_seed(seed)
    xs, targets = [], []
    for n in (40, 25, 1, 33):
        t = torch.arange(n, dtype=torch.float32)[:, None]
        clean = torch.sin(t * torch.tensor([0.05, 0.2, 0.6]))
        xs.append(clean + 0.4 * torch.randn(n, F, generator=gen))
        targets.append(torch.tanh(0.8 * clean))
    return xs, targets


def train(kernel: str, steps: int, calls: list[str] | None = None) -> tuple[list[float], Tensor]:
    model = LinearRecursion(F, alpha_smooth=0.3)
    model.kernel = kernel  # type: ignore[assignment]
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    xs, targets = denoising_batch(0)
    packed, want = pack(xs), pack(targets).data
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.mean((model(packed).data - want) ** 2)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.alpha_smooth.clamp_(0.0, 0.999)
        losses.append(loss.item())
    return losses, torch.cat([model.alpha_smooth.detach(), model.wx.detach()])


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = rnnserve.models.smoothing.smooth_packed_numba

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append("smooth_packed_numba")
        return real(*args, **kwargs)

    monkeypatch.setattr(rnnserve.models.smoothing, "smooth_packed_numba", spy)
    return seen


def test_auto_trains_through_the_compiled_backward_on_the_cpu(calls: list[str]) -> None:
    """A few Adam steps: the loss falls, and the parameters follow the torch loop's path."""
    losses, params = train("auto", 8)
    assert calls == ["smooth_packed_numba"] * 8
    assert losses[-1] < 0.8 * losses[0]
    ref_losses, ref_params = train("torch", 8)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    torch.testing.assert_close(params, ref_params, atol=1e-4, rtol=1e-4)


def test_forward_with_state_trains_the_state_through_the_compiled_backward(
    calls: list[str],
) -> None:
    """Original-order state in, original-order final state out: the gradients equal torch's."""
    xs, _ = denoising_batch(1)
    grads = {}
    for kernel in ("auto", "torch"):
        model = LinearRecursion(F, alpha_smooth=0.6).double()
        model.kernel = kernel  # type: ignore[assignment]
        init = torch.linspace(-1, 1, 4 * F, dtype=torch.float64).reshape(4, F)
        init.requires_grad_(True)
        out, final = model.forward_with_state(pack([x.double() for x in xs]), init)
        (
            out.data.sum() + (final * torch.arange(4.0, dtype=torch.float64)[:, None]).sum()
        ).backward()
        assert init.grad is not None
        assert model.alpha_smooth.grad is not None
        grads[kernel] = (init.grad, model.alpha_smooth.grad, model.wx.grad)
    assert calls == ["smooth_packed_numba"]
    for got, want in zip(grads["auto"], grads["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_training_recovers_the_alpha_and_wx_that_made_the_targets() -> None:
    """Targets made by a smoother with known per-feature constants: training finds them."""
    gen = torch.Generator().manual_seed(3)
    true_alpha = torch.tensor([0.1, 0.6, 0.95])
    true_wx = torch.tensor([0.5, 1.5, -1.0])
    xs = [torch.randn(n, F, generator=gen) for n in (300, 120, 1, 250, 64)]
    packed = pack(xs)
    with torch.no_grad():
        s = ema_packed_torch(packed.data, packed.batch_sizes, true_alpha)
        want = torch.tanh(true_wx * s)
    model = LinearRecursion(F, alpha_smooth=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(600):
        opt.zero_grad()
        loss = torch.mean((model(packed).data - want) ** 2)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.alpha_smooth.clamp_(0.0, 0.999)
    torch.testing.assert_close(model.alpha_smooth.detach(), true_alpha, atol=1e-2, rtol=0)
    torch.testing.assert_close(model.wx.detach(), true_wx, atol=2e-2, rtol=0)


def test_a_second_derivative_is_refused_not_silently_wrong() -> None:
    """d(dL/dalpha)/dc for a loss weighted by a trainable ``c``: the compiled backward is not
    differentiable, so asking must raise rather than give 0."""
    case = inputs([4, 2], with_init=False)
    alpha = case["alpha"].clone().requires_grad_(True)
    c = torch.ones(F, dtype=torch.float64, requires_grad=True)
    y, _ = smooth_packed_numba(case["x"], case["bs"], alpha, case["wx"])
    (grad,) = torch.autograd.grad((y * c).sum(), alpha, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


# --------------------------------------------------------------------------- the fused loss


def fused_case(lengths: list[int], dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    case = inputs(lengths, with_init=False, dtype=dtype, seed=seed)
    case["target"] = torch.tanh(case["gy"])  # a target in tanh's range
    return case


def loss_and_grads(fused: bool, case: dict[str, Any], scale: float = 1.0) -> dict[str, Tensor]:
    """The mean squared error, times ``scale``, and its gradients: fused, or F.mse_loss of
    the compiled forward."""
    leaves = {k: case[k].clone().requires_grad_(True) for k in ("x", "alpha", "wx")}
    args = (leaves["x"], case["bs"], leaves["alpha"], leaves["wx"])
    if fused:
        loss = smooth_mse_packed_numba(*args, case["target"])
    else:
        loss = torch.nn.functional.mse_loss(smooth_packed_numba(*args)[0], case["target"])
    (loss * scale).backward()
    return {"loss": loss.detach()} | {f"d{k}": v.grad for k, v in leaves.items()}  # type: ignore[misc]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(LENGTH_SETS))
def test_the_fused_loss_has_the_gradients_of_mse_loss_bit_for_bit(
    name: str, dtype: torch.dtype
) -> None:
    """The trainer's weights do not change with the fused loss: same gradients, same bits."""
    case = fused_case(lengths_for(name), dtype)
    got, want = loss_and_grads(True, case), loss_and_grads(False, case)
    for key in ("dx", "dalpha", "dwx"):
        assert got[key].dtype == dtype
        assert torch.equal(got[key], want[key]), key
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-6, atol=0)


def test_the_fused_loss_equals_autograd_through_the_step_loop() -> None:
    case = fused_case(lengths_for("random"), torch.float64)
    got = loss_and_grads(True, case, scale=2.5)
    leaves = {k: case[k].clone().requires_grad_(True) for k in ("x", "alpha", "wx")}
    y, _ = reference(leaves["x"], case["bs"], leaves["alpha"], leaves["wx"], None)
    loss = torch.mean((y - case["target"]) ** 2)
    (2.5 * loss).backward()
    torch.testing.assert_close(got["loss"], loss.detach(), atol=1e-14, rtol=1e-14)
    for k, leaf in leaves.items():
        torch.testing.assert_close(got[f"d{k}"], leaf.grad, atol=1e-12, rtol=1e-12, msg=k)


def test_the_fused_loss_passes_a_numerical_gradcheck() -> None:
    case = fused_case([5, 1, 3, 5, 2], torch.float64)
    args = tuple(case[k].clone().requires_grad_(True) for k in ("x", "alpha", "wx"))

    def fn(x: Tensor, alpha: Tensor, wx: Tensor) -> Tensor:
        return smooth_mse_packed_numba(x, case["bs"], alpha, wx, case["target"])

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8)


def test_the_fused_loss_reuses_its_scratch_across_shapes_and_threads() -> None:
    """A large batch, then a small one, then two batches at once in two threads, over and
    over: each call its own answer."""
    big = fused_case([300, 200, 7, 90], torch.float32, seed=1)
    small = fused_case([4, 1, 3], torch.float32, seed=2)
    other = fused_case([280, 260, 40], torch.float32, seed=3)
    want = {k: loss_and_grads(False, c) for k, c in (("big", big), ("small", small))}
    for label, case in (("big", big), ("small", small), ("big", big)):
        got = loss_and_grads(True, case)
        assert torch.equal(got["dalpha"], want[label]["dalpha"]), label
    want["other"] = loss_and_grads(False, other)
    wrong: list[tuple[str, int]] = []
    barrier = threading.Barrier(2)

    def run(label: str, case: dict[str, Any]) -> None:
        barrier.wait()
        for i in range(100):
            got = loss_and_grads(True, case)
            if not all(torch.equal(got[k], want[label][k]) for k in ("dx", "dalpha", "dwx")):
                wrong.append((label, i))

    threads = [threading.Thread(target=run, args=item) for item in (("big", big), ("other", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_the_fused_loss_refuses_a_graph_of_its_gradients() -> None:
    """Its gradients are the compiled loop's constants: a gradient penalty on them would
    silently add nothing, so ``create_graph=True`` raises instead."""
    case = fused_case([4, 2], torch.float64)
    alpha = case["alpha"].clone().requires_grad_(True)
    loss = smooth_mse_packed_numba(case["x"], case["bs"], alpha, case["wx"], case["target"])
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(loss, alpha, create_graph=True)
    (grad,) = torch.autograd.grad(loss, alpha)  # the graph is still there, and it answers
    torch.testing.assert_close(grad, loss_and_grads(False, case)["dalpha"], rtol=0, atol=0)


def test_the_fused_loss_refuses_a_target_that_does_not_fit() -> None:
    case = fused_case([3, 2], torch.float32)
    args = (case["x"], case["bs"], case["alpha"], case["wx"])
    with pytest.raises(ValueError, match="a target of its shape"):
        smooth_mse_packed_numba(*args, case["target"][:4])
    with pytest.raises(ValueError, match=r"torch\.float32 CPU tensor that needs no gradient"):
        smooth_mse_packed_numba(*args, case["target"].double())
    with pytest.raises(ValueError, match="needs no gradient"):
        smooth_mse_packed_numba(*args, case["target"].clone().requires_grad_(True))


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = rnnserve.models.smoothing.smooth_mse_packed_numba

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append("smooth_mse_packed_numba")
        return real(*args, **kwargs)

    monkeypatch.setattr(rnnserve.models.smoothing, "smooth_mse_packed_numba", spy)
    return seen


def test_mse_loss_is_fused_only_where_the_compiled_training_path_runs(
    fused_calls: list[str],
) -> None:
    """Fused on the CPU training path; F.mse_loss of the forward under no_grad, with the torch
    kernel, or for a target that takes a gradient, each with the same value."""
    xs, targets = denoising_batch(2)
    packed, want = pack(xs), pack(targets).data
    model = LinearRecursion(F, alpha_smooth=0.4)
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(model(packed).data, want))
    assert model.mse_loss(packed, want).item() == pytest.approx(expected, rel=1e-6)
    assert fused_calls == ["smooth_mse_packed_numba"]
    with torch.no_grad():
        assert model.mse_loss(packed, want).item() == pytest.approx(expected, rel=1e-6)
    learnt = want.clone().requires_grad_(True)
    model.mse_loss(packed, learnt).backward()
    assert learnt.grad is not None
    model.kernel = "torch"
    assert model.mse_loss(packed, want).item() == pytest.approx(expected, rel=1e-6)
    assert fused_calls == ["smooth_mse_packed_numba"]
