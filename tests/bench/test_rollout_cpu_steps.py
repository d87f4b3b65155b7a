"""bench/rollout_cpu_steps.py (rollout_cpu_probe --breakdown / --versions) on tiny shapes: it
runs the kernel's own pieces and reports every one; no figure is checked, only that it is there
and that the arrays it times are the ones the kernel's loop takes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

steps = pytest.importorskip("bench.rollout_cpu_steps")

from bench.models_harness import half_spread_lengths, random_sequences  # noqa: E402
from bench.models_traveller import make_traveller  # noqa: E402
from rnnserve.models.kernels import rollout_cpu  # noqa: E402
from rnnserve.models.packing import pack  # noqa: E402

KERNEL = Path(rollout_cpu.__file__)


def test_the_loop_on_the_probes_arrays_is_the_public_call() -> None:
    """What the breakdown times as "compiled loop" computes what rollout_packed_numba does."""
    base = make_traveller()
    x = pack(random_sequences(half_spread_lengths(5, 12), base.num_inputs, 3))
    a = steps.rollout_arrays(base, x)
    keys = ("u", "batch_sizes", "w0", "w_up", "bias", "w_out_t", "b_out", "z0", "z_up", "c")
    rollout_cpu._rollout_loop_jit(*(a[k] for k in keys), a["out"], a["routes"], a["packed"])
    want = rollout_cpu.rollout_packed_numba(x.data, x.batch_sizes.tolist(), *base.fused_weights())
    np.testing.assert_allclose(a["out"], want[0].numpy(), atol=1e-6, rtol=0)


def test_breakdown_reports_each_piece_and_the_whole(capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    steps.breakdown(4, 8, rounds=1, pads=[4], passes=1)
    out = capsys.readouterr().out
    for piece in ("gemm 0", "gemm 1", "cell 0", "cell 1", "output", "sgemm_ 0", "sgemm_ 1"):
        assert piece in out
    for line in ("pieces   all", "compiled loop", "rollout_packed_numba", "multiple of  4"):
        assert line in out


def test_versions_ab_checks_and_times_another_copy(capsys: pytest.CaptureFixture[str]) -> None:
    steps.versions_ab(3, 6, rounds=2, paths=[str(KERNEL)])
    out = capsys.readouterr().out
    assert f"{KERNEL}: max |diff| vs this tree 0.0e+00" in out
    assert out.count("paired median") == 2
