"""Every rollout backend against a loop calling nn.LSTM once per step, in float64, where tanh bends.

The shipped weights keep |p| small, where tanh is nearly the identity and feedback bugs hide in
the noise; these models have their output layer scaled so positions reach |p| ≈ 0.8.
"""

from __future__ import annotations

import pytest
import torch

from rnnserve.models.packing import pack, unpack
from rnnserve.models.traveller import RolloutState, Traveller
from tests.references import available_backends, bent_model, stepwise_rollout

BACKENDS = available_backends()


def reference(model: Traveller, u: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return stepwise_rollout(model.lstm_layers, model.output_layer, model.activation, u[:, None])


def _device_dtype(backend: str) -> tuple[torch.device, torch.dtype]:
    if backend == "triton" and torch.cuda.is_available():
        return torch.device("cuda"), torch.float32
    return torch.device("cpu"), torch.float64


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_matches_the_stepwise_loop_where_tanh_bends(backend: str, layers: int) -> None:
    device, dtype = _device_dtype(backend)
    model = bent_model(layers=layers)
    gen = torch.Generator().manual_seed(layers)
    seqs = [torch.randn(n, 6, generator=gen, dtype=torch.float64) for n in (40, 1, 23, 7, 40)]
    refs = [reference(model, u) for u in seqs]
    assert max(float(r.abs().max()) for r in refs) > 0.6  # the test reaches tanh's curve
    model.to(device=device, dtype=dtype).compile_rollout(backend)  # type: ignore[arg-type]
    with torch.inference_mode():
        out = unpack(model.rollout(pack([u.to(dtype) for u in seqs], device)))
    for y, ref in zip(out, refs, strict=True):
        torch.testing.assert_close(y.cpu().double(), ref, atol=_tolerance(dtype), rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_resumes_a_rollout_exactly(backend: str) -> None:
    """Rolled out in two pieces from the state the first returns == rolled out at once."""
    device, dtype = _device_dtype(backend)
    model = bent_model(num_inputs=3, hidden=8, seed=4).to(device=device, dtype=dtype)
    model.compile_rollout(backend)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(5)
    lengths = [(9, 4), (3, 11), (6, 1), (12, 12)]  # (first piece, second piece) per sequence
    seqs = [torch.randn(a + b, 3, generator=gen, dtype=dtype).to(device) for a, b in lengths]
    with torch.inference_mode():
        whole_packed, whole_state = model.rollout_with_state(pack(seqs))
        whole = unpack(whole_packed)
        first_packed, mid = model.rollout_with_state(
            pack([u[:a] for u, (a, _) in zip(seqs, lengths, strict=True)])
        )
        second_packed, end = model.rollout_with_state(
            pack([u[a:] for u, (a, _) in zip(seqs, lengths, strict=True)]), mid
        )
    first, second = unpack(first_packed), unpack(second_packed)
    tol = _tolerance(dtype)
    for w, f, s in zip(whole, first, second, strict=True):
        torch.testing.assert_close(torch.cat([f, s]), w, atol=tol, rtol=0)
    for got, want in ((end.h, whole_state.h), (end.c, whole_state.c), (end.p, whole_state.p)):
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
    # the final p is each sequence's own last position
    torch.testing.assert_close(whole_state.p, torch.stack([w[-1] for w in whole]), atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_final_state_is_each_sequences_own(backend: str) -> None:
    """In a ragged batch, a short sequence's final state is not overwritten by later steps."""
    device, dtype = _device_dtype(backend)
    model = bent_model(num_inputs=2, hidden=4, layers=2, seed=7).to(device=device, dtype=dtype)
    model.compile_rollout(backend)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randn(n, 2, generator=gen, dtype=dtype).to(device) for n in (2, 9, 5)]
    with torch.inference_mode():
        _, together = model.rollout_with_state(pack(seqs))
        for i, u in enumerate(seqs):
            _, alone = model.rollout_with_state(pack([u]))
            tol = _tolerance(dtype)
            torch.testing.assert_close(together.h[:, i], alone.h[:, 0], atol=tol, rtol=0)
            torch.testing.assert_close(together.c[:, i], alone.c[:, 0], atol=tol, rtol=0)
            torch.testing.assert_close(together.p[i], alone.p[0], atol=tol, rtol=0)


def test_state_of_the_wrong_shape_is_refused() -> None:
    model = bent_model(num_inputs=2, hidden=4, layers=2)
    state = RolloutState.zeros(2, 3, 5, dtype=torch.float64, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"must have shape \[2, 3, 4\]"):
        model.rollout_with_state(pack([torch.zeros(2, 2, dtype=torch.float64)] * 3), state)


def test_cached_fused_weights_follow_parameter_updates() -> None:
    """The fused-weight cache never serves stale weights: in-place updates and casts refresh it."""
    model = bent_model(num_inputs=2, hidden=4, layers=2, dtype=torch.float32)
    u = [torch.randn(6, 2)]
    with torch.inference_mode():
        before = model.rollout(pack(u)).data.clone()
    with torch.no_grad():
        model.lstm_layers.weight_hh_l1.mul_(-1.0)  # an optimiser step does this in place
    with torch.inference_mode():
        after = model.rollout(pack(u)).data
    model.double()
    want = reference(model, u[0].double()).float()
    torch.testing.assert_close(after, want, atol=1e-5, rtol=0)
    assert not torch.allclose(before, after)
    with torch.inference_mode():
        y = model.rollout(pack([u[0].double()])).data
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, reference(model, u[0].double()), atol=1e-10, rtol=0)
