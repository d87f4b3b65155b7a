"""The smoother's cases of bench.bench_models: the float64 reference, the per-step loop, every
kernel of LinearRecursion, the Triton variants and JAX's scans, against the floor.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import typing
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

import rnnserve.models.smoothing
from bench.models_harness import (
    JAX_ASSOC,
    JAX_SCAN,
    STEP_LOOP_SMOOTHER,
    Builder,
    Case,
    Unavailable,
    _fmt_s,
    _log,
    _mask,
    _nothing,
    check,
    data_to_padded,
    half_spread_lengths,
    packed_to_padded,
    padded64,
    random_sequences,
    shape_label,
)
from bench.models_suite import SuiteBase
from bench.padding import padded_time_major
from rnnserve.models.kernels import ema_packed_numba, ema_packed_torch
from rnnserve.models.packing import pack
from rnnserve.models.smoothing import LinearRecursion

# the server's CPU path: EMA + tanh fused, on the sequences' own rows (no packing)
SMOOTH_FLAT = "LinearRecursion.smooth_flat (no packing; the server's CPU path)"
TRITON_PIECES_8 = "Triton smoother, forward in pieces of 8 steps (sub=8)"
TRITON_LOOP = "Triton smoother, forward as a loop over the steps (sub=1)"
TRITON_LOOP_LONG = "Triton smoother, loop over 256-step chunks (chunk=256, sub=1)"
TRITON_CHAINED = "Triton smoother, single-pass chained scan (scan=chained)"


def smoother_reference(
    seqs: Sequence[Tensor], alpha: Tensor, wx: Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``s`` and ``y = tanh(wx * s)``, padded ``[B, T, F]`` (zeros after each end)."""
    x = padded64(seqs)
    a = alpha.detach().double().cpu().numpy()
    s = np.empty_like(x)
    s[:, 0] = x[:, 0]
    for t in range(1, x.shape[1]):
        s[:, t] = a * s[:, t - 1] + (1 - a) * x[:, t]
    mask = _mask([len(q) for q in seqs], x.shape[1])[..., None]
    y = np.tanh(wx.detach().double().cpu().numpy() * s)
    return np.where(mask, s, 0.0), np.where(mask, y, 0.0)


def packed_sequence_indices(batch_sizes: Tensor) -> list[Tensor]:
    """Per sequence, a CPU ``LongTensor`` of its rows in the packed data."""
    sizes: list[int] = batch_sizes.tolist()
    starts = [0]
    for b in sizes[:-1]:
        starts.append(starts[-1] + b)
    return [
        torch.tensor([starts[t] + i for t in range(len(sizes)) if sizes[t] > i], dtype=torch.long)
        for i in range(sizes[0])
    ]


def smoother_step_loop(x: PackedSequence, alpha: Tensor, wx: Tensor) -> Tensor:
    """The plain layer: Python loops over sequences and steps, one row at a time."""
    data = x.data
    ydata = torch.zeros_like(data)
    for rows in packed_sequence_indices(x.batch_sizes):
        ydata[rows[0], :] = data[rows[0], :]
        for k in range(1, len(rows)):
            ydata[rows[k], :] = alpha * ydata[rows[k - 1], :] + (1 - alpha) * data[rows[k], :]
    return torch.tanh(wx * ydata)


def smoother_kernels() -> tuple[str, ...]:
    """The ``LinearRecursion.kernel`` names this checkout knows (its ``Kernel`` Literal)."""
    names = typing.get_args(getattr(rnnserve.models.smoothing, "Kernel", None))
    return tuple(str(n) for n in names) or ("auto", "numba", "torch")


def make_smoother(
    feat_dim: int, kernel: str, device: torch.device | str = "cpu"
) -> LinearRecursion:
    gen = torch.Generator().manual_seed(0)
    model = LinearRecursion(feat_dim)
    with torch.no_grad():
        model.alpha_smooth.copy_(0.05 + 0.9 * torch.rand(feat_dim, generator=gen))
        model.wx.copy_(0.2 + 1.5 * torch.rand(feat_dim, generator=gen))
    model.kernel = cast(rnnserve.models.smoothing.Kernel, kernel)
    with torch.inference_mode(False):  # parameters stay normal tensors, as when served
        return model.eval().requires_grad_(False).to(device)


class SmootherBench(SuiteBase):
    """The smoother's cases, per shape of the plan."""

    def smoother_builders(
        self, seqs: Sequence[Tensor], x: PackedSequence, label: str
    ) -> list[tuple[str, Builder]]:
        plan, dev = self.plan, self.device
        lengths = [len(s) for s in seqs]
        base = make_smoother(plan.feat_dim, "torch")
        s_ref, y_ref = smoother_reference(seqs, base.alpha_smooth, base.wx)
        data, bs = x.data, x.batch_sizes
        alpha, wx = base.alpha_smooth.to(dev), base.wx.to(dev)

        out = torch.empty_like(data)

        def copy_floor() -> Tensor:
            return out.copy_(data)

        def tanh_floor() -> Tensor:
            return torch.tanh(data)

        def floor() -> Case:
            fn = copy_floor if self.cuda else tanh_floor
            want = padded64(seqs) if self.cuda else np.tanh(padded64(seqs))
            err = check(self.smoother_floor, data_to_padded(fn(), x), want, lengths)
            return Case(self.smoother_floor, fn, self.wait, err=err)

        def ema(name: str, kernel: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Builder:
            def build() -> Case:
                if name == "ema_packed_numba" and self.cuda:
                    raise Unavailable("a CPU kernel")
                got = data_to_padded(kernel(data, bs, alpha), x)
                err = check(name, got, s_ref, lengths)
                return Case(name, lambda: kernel(data, bs, alpha), self.wait, err=err)

            return build

        def layer(kernel: str) -> tuple[str, Builder]:
            name = f'LinearRecursion, kernel "{kernel}"'

            def build() -> Case:
                if kernel == "numba" and self.cuda:
                    raise Unavailable("a CPU kernel")
                if kernel == "triton":
                    if not self.cuda:
                        raise Unavailable(
                            "Triton needs CUDA (on the CPU it runs only in Triton's "
                            "interpreter, for the tests)"
                        )
                    try:
                        importlib.import_module("rnnserve.models.kernels.smoother_triton")
                    except ImportError as e:
                        raise Unavailable(f"not in this checkout ({e})") from e
                model = make_smoother(plan.feat_dim, kernel, dev)
                if kernel == "triton":
                    out = self.first_call(
                        f"Triton smoother kernel, first call ({label})", lambda: model(x)
                    )
                else:
                    out = model(x)
                err = check(name, packed_to_padded(cast(PackedSequence, out)), y_ref, lengths)
                return Case(name, lambda: model(x), self.wait, err=err)

            return name, build

        def pieces(name: str, **tiles: Any) -> tuple[str, Builder]:
            """The Triton kernel with other tiles or another forward design: each chunk scanned
            in pieces (``sub``), or the chained single-pass scan (``scan``)."""

            def build() -> Case:
                from rnnserve.models.kernels.smoother_triton import smooth_packed_triton

                def fn() -> Tensor:
                    return smooth_packed_triton(data, bs, alpha, wx, None, **tiles)[0]

                got = self.first_call(f"Triton smoother, {name} ({label})", fn)
                err = check(name, data_to_padded(cast(Tensor, got), x), y_ref, lengths)
                return Case(name, fn, self.wait, err=err)

            return name, build

        # variants of the Triton forward to choose between by measurement (CUDA only): the
        # default scans each [chunk, block] tile as one tree in three launches; the chained scan
        # is one launch reading x once; the rest walk the default's chunks in pieces
        variants = (
            [
                pieces(TRITON_CHAINED, scan="chained"),
                pieces(TRITON_PIECES_8, sub=8),
                pieces(TRITON_LOOP, sub=1),
                pieces(TRITON_LOOP_LONG, chunk=256, sub=1),
            ]
            if self.cuda
            else []
        )

        def flat() -> Case:
            if self.cuda:
                raise Unavailable("a CPU kernel")
            model = make_smoother(plan.feat_dim, "numba", dev)
            rows = np.concatenate([s.numpy() for s in seqs])
            lens = np.array(lengths, np.int64)
            got = model.smooth_flat(rows, lens)
            padded = np.zeros_like(y_ref)
            row = 0
            for i, n in enumerate(lengths):
                padded[i, :n] = got[row : row + n]
                row += n
            err = check(SMOOTH_FLAT, padded, y_ref, lengths)
            return Case(SMOOTH_FLAT, lambda: model.smooth_flat(rows, lens), self.wait, err=err)

        def step_loop() -> Case:
            if self.cuda:
                raise Unavailable("Python loops of one-row CUDA ops: minutes per call")
            if x.data.shape[0] > plan.step_loop_smoother_rows:
                raise Unavailable(
                    f"{x.data.shape[0]:,} rows would take ~{x.data.shape[0] * 13e-6:.0f} s a call"
                )
            got = data_to_padded(smoother_step_loop(x, alpha, wx), x)
            err = check(STEP_LOOP_SMOOTHER, got, y_ref, lengths)
            return Case(
                STEP_LOOP_SMOOTHER, lambda: smoother_step_loop(x, alpha, wx), slow=True, err=err
            )

        def jax_case(name: str, fn_name: str) -> Builder:
            def build() -> Case:
                if self.jax_process:
                    xs, mask = padded_time_major([s.numpy() for s in seqs])
                    arrays = {"x": xs, "mask": mask}
                    arrays |= {"alpha": base.alpha_smooth.numpy(), "wx": base.wx.numpy()}
                    out, timing = self.jax_elsewhere(fn_name, arrays, label)
                    got = out.astype(np.float64).transpose(1, 0, 2)
                    err = check(name, got, y_ref, lengths)
                    return Case(name, _nothing, err=err, external=timing)
                jb = self._jax()
                import jax

                xs, mask = jb.padded_time_major([s.numpy() for s in seqs])
                args = [
                    jax.device_put(v, self.jax_device)
                    for v in (xs, mask, base.alpha_smooth.numpy(), base.wx.numpy())
                ]
                fn, secs = jb.compile_for(getattr(jb, fn_name), *args)
                self.res.compile.append((f"JAX jit compile, `{fn_name}` ({label})", _fmt_s(secs)))
                got = np.asarray(fn(*args), dtype=np.float64).transpose(1, 0, 2)
                err = check(name, got, y_ref, lengths)
                return Case(name, lambda: fn(*args), jax.block_until_ready, err=err)

            return build

        return [
            (self.smoother_floor, floor),
            ("ema_packed_numba", ema("ema_packed_numba", ema_packed_numba)),
            ("ema_packed_torch", ema("ema_packed_torch", ema_packed_torch)),
            *(layer(k) for k in smoother_kernels()),
            *variants,
            (SMOOTH_FLAT, flat),
            (STEP_LOOP_SMOOTHER, step_loop),
            (JAX_SCAN, jax_case(JAX_SCAN, "smoother_scan")),
            (JAX_ASSOC, jax_case(JAX_ASSOC, "smoother_associative_scan")),
        ]

    def bench_smoother(self) -> None:
        plan = self.plan
        for i, (batch, steps) in enumerate(plan.smoother_shapes):
            label = shape_label(batch, steps)
            _log(f"smoother {label}")
            seqs = random_sequences(half_spread_lengths(batch, steps), plan.feat_dim, seed=i)
            x = pack(seqs, self.device)
            builders = self.smoother_builders(seqs, x, label)
            self.run_shape(builders, self.res.smoother, batch, steps, x.data.shape[0])

    # -- the Traveller ----------------------------------------------------------------------
