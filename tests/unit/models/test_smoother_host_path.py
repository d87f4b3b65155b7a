"""The smoother's public call with less host work: the same numbers as before it.

The call that serves (no gradient) launches the inner entry without ``autograd.Function``; the
tile plan of a batch shape is computed once; the schedule is written in place into one buffer;
the chunked scan's three scratch arrays are views of one allocation. Each is checked here in
Triton's interpreter against the path it replaces or an independent computation.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - tests/conftest.py sets it
    pytest.skip("runs the kernels in Triton's interpreter", allow_module_level=True)

from rnnserve.models.kernels import smoother_triton as st
from rnnserve.models.packing import pack

TILES = {"chunk": 4, "block": 16}


def batch(lengths: list[int], feat: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    packed = pack([torch.randn(n, feat, generator=gen) for n in lengths])
    alpha = 0.05 + 0.9 * torch.rand(feat, generator=gen)
    wx = 0.2 + 1.5 * torch.rand(feat, generator=gen)
    return packed.data, packed.batch_sizes, alpha, wx


@pytest.mark.parametrize("scan", st.SCANS)
def test_the_call_without_gradients_skips_autograd_and_gives_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch, scan: str
) -> None:
    data, sizes, alpha, wx = batch([9, 6, 2], 3, seed=0)
    x = data.clone().requires_grad_()
    want_y, want_final = st.smooth_packed_triton(x, sizes, alpha, wx, scan=scan, **TILES)
    assert want_y.requires_grad  # the autograd path

    def refused(*_: object) -> None:
        raise AssertionError("autograd.Function used without a gradient to take")

    monkeypatch.setattr(st._SmootherFn, "forward", staticmethod(refused))
    for mode in (torch.inference_mode(), torch.no_grad()):
        with mode:
            y, final = st.smooth_packed_triton(x, sizes, alpha, wx, scan=scan, **TILES)
        assert torch.equal(y, want_y.detach())
        assert torch.equal(final, want_final.detach())
    y, final = st.smooth_packed_triton(data, sizes, alpha, wx, scan=scan, **TILES)  # no grad
    assert not y.requires_grad
    assert torch.equal(y, want_y.detach())


def test_a_batch_with_an_initial_state_takes_it_without_autograd_too() -> None:
    data, sizes, alpha, wx = batch([5, 5, 1], 2, seed=1)
    init = torch.randn(3, 2, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        y, final = st.smooth_packed_triton(data, sizes, alpha, wx, init, **TILES)
    want_y, want_final = st.smooth_packed_triton(
        data, sizes, alpha.clone().requires_grad_(), wx, init, **TILES
    )
    assert torch.equal(y, want_y.detach())
    assert torch.equal(final, want_final.detach())


def test_the_schedule_is_the_sizes_their_exclusive_sums_and_the_lengths() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        lengths = sorted(rng.integers(1, 30, size=int(rng.integers(1, 12))).tolist(), reverse=True)
        t = np.arange(lengths[0])
        sizes = torch.from_numpy((np.asarray(lengths)[None, :] > t[:, None]).sum(1))
        for scan in st.SCANS:
            plan = st.plan_tiles(int(sizes.numel()), len(lengths), 3, scan=scan)
            bs, off, lens = st.device_schedule(sizes, plan, torch.device("cpu"))
            assert bs.tolist() == sizes.tolist()
            assert off.tolist() == [0, *np.cumsum(sizes.numpy())[:-1].tolist()]
            if scan == "chained":
                assert lens is not None
                assert lens.tolist() == lengths
                assert lens.data_ptr() % 16 == 0
            else:
                assert lens is None
            assert bs.data_ptr() % 16 == 0
            assert off.data_ptr() % 16 == 0


@pytest.mark.parametrize("n_seqs", [1, 2, 3, 5])
def test_chunked_scratch_views_are_aligned_and_apart(n_seqs: int) -> None:
    data, sizes, alpha, wx = batch([7] * n_seqs, 3, seed=n_seqs)  # odd column counts
    buf = st.prepare_forward(data, sizes, alpha, wx, **TILES)
    carry, sum_a, sum_b = buf.scratch
    plan = buf.plan
    assert carry.shape == (plan.n_chunks + 1, plan.n_cols)
    assert sum_a.shape == sum_b.shape == (plan.n_chunks, plan.n_cols)
    spans = []
    for part in buf.scratch:
        assert part.is_contiguous()
        assert part.data_ptr() % 16 == 0
        start = part.data_ptr()
        spans.append((start, start + part.numel() * part.element_size()))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))


def test_the_plan_follows_a_switched_default_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    first = st.plan_tiles(100, 4, 16)
    assert first.scan == st.DEFAULT_SCAN
    assert st.plan_tiles(100, 4, 16) is first  # computed once per shape
    other = next(s for s in st.SCANS if s != st.DEFAULT_SCAN)
    monkeypatch.setattr(st, "DEFAULT_SCAN", other)
    assert st.plan_tiles(100, 4, 16).scan == other


def test_a_refused_plan_is_refused_every_time() -> None:
    for _ in range(2):
        with pytest.raises(ValueError, match="chunk must be a power of two, got 3"):
            st.plan_tiles(10, 1, 3, chunk=3)
