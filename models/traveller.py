"""Model 2, the Traveller: an autoregressive LSTM whose output position feeds its next input.

For a sequence of exogenous inputs ``u_0 .. u_{T-1}``: ``p_{-1} = 0``, LSTM state zero; at each
step ``z_t = concat(p_{t-1}, u_t)`` goes through every LSTM layer and
``p_t = tanh(output_layer(h_top))``. The output is ``p_0 .. p_{T-1}``, shape ``[T, 2]``.

The batched rollout (:func:`rollout_packed`) is a plain function over fused weights, written in
the TorchScript subset. It runs eagerly as it is; :meth:`Traveller.compile_rollout` swaps in the
backend the settings name (the loader does that at start-up; ``auto``: numba on the CPU, Triton
on CUDA).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from rnnserve.options import ROLLOUT_BACKENDS, GemmRoutes, RolloutBackend

# (w_cat, bias, w_out, b_out): see rollout_packed's arguments
FusedWeights = tuple[list[Tensor], list[Tensor], Tensor, Tensor]
# (u, batch_sizes, w_cat, bias, w_out, b_out, h0, c0, p0) -> (positions, h_T, c_T, p_T)
RolloutFn = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class TravellerConfig:
    num_inputs: int = 6
    hidden_size: int = 128
    num_layers: int = 2
    dropout: float = 0.0


@dataclass
class RolloutState:
    """Where a batch of rollouts stands: every layer's ``h`` and ``c``, and the last position.

    Row ``i`` belongs to sequence ``i``. A fresh rollout starts from :meth:`zeros`; the state a
    rollout returns continues it exactly (a long stream can be rolled out in pieces).
    """

    h: Tensor  # [L, B, H]
    c: Tensor  # [L, B, H]
    p: Tensor  # [B, 2]: p_{t-1}, fed back at the next step

    @classmethod
    def zeros(
        cls, num_layers: int, batch: int, hidden: int, *, dtype: torch.dtype, device: torch.device
    ) -> RolloutState:
        h = torch.zeros(num_layers, batch, hidden, dtype=dtype, device=device)
        return cls(h, torch.zeros_like(h), torch.zeros(batch, 2, dtype=dtype, device=device))

    def index(self, rows: Tensor) -> RolloutState:
        """The state of sequences ``rows``, in that order."""
        return RolloutState(self.h[:, rows], self.c[:, rows], self.p[rows])


def rollout_packed(
    u: Tensor,  # [N, num_inputs]: packed rows, time-major, longest sequence first
    batch_sizes: List[int],  # [T]: active sequences per step, non-increasing
    w_cat: List[Tensor],  # per layer: [in + H, 4H]; rows (x, h_l), layer 0: (p, h_0, u)
    bias: List[Tensor],  # per layer: [4H] = b_ih + b_hh
    w_out: Tensor,  # [H, 2]
    b_out: Tensor,  # [2]
    h0: Optional[Tensor] = None,  # [L, B, H] initial h, packed (sorted) order; None: zeros
    c0: Optional[Tensor] = None,  # [L, B, H] initial c; None: zeros
    p0: Optional[Tensor] = None,  # [B, 2] position fed back at the first step; None: zeros
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Autoregressive rollout of every packed sequence at once.

    Returns the ``[N, 2]`` packed positions and the final state ``(h_T, c_T, p_T)``: for each
    sequence, its state after its own last step. Layer 0's input is ``(p_{t-1}, u_t)``; the
    ``u`` part of its projection is done for all steps in one GEMM up front, so each step costs
    one small GEMM per layer.
    """
    num_layers = len(w_cat)
    hidden = w_cat[0].shape[1] // 4
    b_max = batch_sizes[0]
    w0_rec = w_cat[0][: 2 + hidden]  # [2 + H, 4H]: layer 0's rows for (p, h_0)
    w0_u = w_cat[0][2 + hidden :]  # [num_inputs, 4H]: layer 0's rows for u
    gu = torch.addmm(bias[0], u, w0_u)  # [N, 4H]
    zeros = torch.zeros(num_layers, b_max, hidden, dtype=u.dtype, device=u.device)
    h_init = zeros if h0 is None else h0
    c_init = zeros if c0 is None else c0
    p = torch.zeros(b_max, 2, dtype=u.dtype, device=u.device) if p0 is None else p0
    h = [h_init[layer] for layer in range(num_layers)]  # the active rows, [b, H] each
    c = [c_init[layer] for layer in range(num_layers)]
    # every sequence is active at step 0, so each row of these is written before it is read
    h_fin = torch.empty_like(zeros)
    c_fin = torch.empty_like(zeros)
    p_fin = torch.empty_like(p)
    outs: list[Tensor] = []
    off = 0
    active = b_max
    for b in batch_sizes:
        if b < active:  # rows b..active finished at the previous step: keep their state
            for layer in range(num_layers):
                h_fin[layer, b:active] = h[layer][b:active]
                c_fin[layer, b:active] = c[layer][b:active]
                h[layer] = h[layer][:b]
                c[layer] = c[layer][:b]
            p_fin[b:active] = p[b:active]
            p = p[:b]
            active = b
        x = p
        for layer in range(num_layers):
            if layer == 0:
                gates = torch.addmm(gu[off : off + b], torch.cat([x, h[0]], 1), w0_rec)
            else:
                gates = torch.addmm(bias[layer], torch.cat([x, h[layer]], 1), w_cat[layer])
            i, f, g, o = gates.chunk(4, 1)
            c_new = torch.sigmoid(f) * c[layer] + torch.sigmoid(i) * torch.tanh(g)
            h_new = torch.sigmoid(o) * torch.tanh(c_new)
            c[layer] = c_new
            h[layer] = h_new
            x = h_new
        p = torch.tanh(torch.addmm(b_out, x, w_out))
        outs.append(p)
        off += b
    for layer in range(num_layers):
        h_fin[layer, :active] = h[layer]
        c_fin[layer, :active] = c[layer]
    p_fin[:active] = p
    return torch.cat(outs, 0), h_fin, c_fin, p_fin


@functools.cache
def scripted_rollout() -> RolloutFn:
    """The TorchScript-compiled :func:`rollout_packed` (compiled once per process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        fn: RolloutFn = torch.jit.script(rollout_packed)
    return fn


def _triton_rollout_imports() -> bool:
    try:
        import rnnserve.models.kernels.rollout_triton  # noqa: F401
    except ImportError:
        return False
    return True


def rollout_backend_fn(backend: str, device: torch.device) -> tuple[RolloutFn, str]:
    """The rollout function for ``backend`` on ``device``, and the backend's resolved name.

    - ``"torchscript"``: :func:`rollout_packed` compiled by TorchScript (any device);
    - ``"eager"``: :func:`rollout_packed` as plain PyTorch (any device);
    - ``"numba"``: one compiled CPU loop with fused gates
    (:mod:`rnnserve.models.kernels.rollout_cpu`);
    - ``"triton"``: fused Triton step kernels, CUDA (:mod:`rnnserve.models.kernels.rollout_triton`);
    - ``"auto"``: the fastest measured for the device (docs/BENCHMARKS.md); on CUDA devices
      ``"triton"`` when triton imports, else ``"torchscript"``.
    """
    if backend == "auto" and device.type == "cpu":
        # The numba loop beats TorchScript on one core at one row and at 64 rows
        # (docs/BENCHMARKS.md); TorchScript stays the CPU choice where numba is missing.
        try:
            import rnnserve.models.kernels.rollout_cpu  # noqa: F401
        except ImportError:
            backend = "torchscript"
        else:
            backend = "numba"
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and _triton_rollout_imports() else "torchscript"
    if backend == "torchscript":
        return scripted_rollout(), backend
    if backend == "eager":
        return rollout_packed, backend
    if backend == "numba":
        from rnnserve.models.kernels.rollout_cpu import compile_for, rollout_packed_numba

        compile_for(torch.float32)  # JIT here, at load, not in the first request (seconds)
        return rollout_packed_numba, backend
    if backend == "triton":
        from rnnserve.models.kernels.rollout_triton import check_device, rollout_packed_triton

        check_device(device)
        return rollout_packed_triton, backend
    raise ValueError(f"unknown rollout backend {backend!r}; known: {', '.join(ROLLOUT_BACKENDS)}")


class Traveller(nn.Module):
    """Autoregressive LSTM; state_dict keys ``lstm_layers.*`` and ``output_layer.*``, so a plain
    ``nn.LSTM`` + ``nn.Linear`` module with those attribute names loads the same weights."""

    def __init__(
        self, num_inputs: int, hidden_size: int, num_layers: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.num_inputs = num_inputs
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.dropout = dropout
        self.lstm_layers = nn.LSTM(
            input_size=num_inputs + 2,
            hidden_size=hidden_size,
            num_layers=num_layers,
            dropout=dropout,
            batch_first=True,
        )
        self.output_layer = nn.Linear(hidden_size, 2)
        self.activation = nn.Tanh()
        self._rollout_fn: RolloutFn = rollout_packed
        self._fused_cache: tuple[tuple[object, ...], FusedWeights] | None = None
        self.rollout_backend: str = "eager"

    @property
    def config(self) -> TravellerConfig:
        return TravellerConfig(self.num_inputs, self.hidden_size, self.num_layers, self.dropout)

    def compile_rollout(
        self, backend: RolloutBackend = "auto", gemm_routes: GemmRoutes = "measured"
    ) -> None:
        """Choose the rollout implementation (see :func:`rollout_backend_fn`). The numba
        rollout's GEMM routes: ``"measured"``, the fastest on this CPU, timed now (processes whose
        measurements differ give results that differ in the last bits); ``"fixed"``, the loop at
        one active row and MKL from two, the same bits in every process of one build on one kind of
        CPU (MKL picks its kernels by the CPU)."""
        device = next(self.parameters()).device
        self._rollout_fn, self.rollout_backend = rollout_backend_fn(backend, device)
        if self.rollout_backend == "numba":
            from rnnserve.models.kernels.rollout_cpu import NumbaRollout, plan_routes

            routes = None
            if gemm_routes == "measured":
                # each layer's fastest GEMM route at each narrow width, measured on this machine
                with torch.no_grad():
                    routes = plan_routes(self.fused_weights()[0], torch.float32)
            self._rollout_fn = NumbaRollout(routes, torch.float32)

    @property
    def rollout_routes(self) -> str | None:
        """The numba rollout's GEMM route of each layer at each narrow width, as
        :func:`compile_rollout` measured them on this machine; None for the fixed routes and for
        the other backends."""
        routes = getattr(self._rollout_fn, "routes", None)
        if routes is None:
            return None
        from rnnserve.models.kernels.rollout_cpu import describe_routes

        return describe_routes(routes)

    def fused_weights(self) -> FusedWeights:
        """Weights in the layout :func:`rollout_packed` takes (see its argument comments).

        Rebuilding them costs about a millisecond (a copy of every weight), a lot for a chunk of
        a few dozen steps, so without autograd they are cached until a parameter changes (its
        storage, device, dtype, or version counter, which in-place updates bump).
        """
        params = list(self.parameters())
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return self._fuse()  # part of the autograd graph: never cached
        try:
            key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        except RuntimeError:  # inference tensors (made under inference_mode) have no version
            return self._fuse()
        cached = self._fused_cache
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, reusable anywhere
                cached = (key, self._fuse())
            self._fused_cache = cached
        return cached[1]

    def _fuse(self) -> FusedWeights:
        w_cat: list[Tensor] = []
        bias: list[Tensor] = []
        n_pos = 2
        for layer in range(self.num_layers):
            w_ih = getattr(self.lstm_layers, f"weight_ih_l{layer}")  # [4H, in_l]
            w_hh = getattr(self.lstm_layers, f"weight_hh_l{layer}")  # [4H, H]
            b = getattr(self.lstm_layers, f"bias_ih_l{layer}") + getattr(
                self.lstm_layers, f"bias_hh_l{layer}"
            )
            if layer == 0:
                # rows ordered (p, h_0, u) so the step loop slices one contiguous block
                w = torch.cat([w_ih[:, :n_pos], w_hh, w_ih[:, n_pos:]], 1)
            else:
                w = torch.cat([w_ih, w_hh], 1)
            w_cat.append(w.t().contiguous())
            bias.append(b)
        w_out = self.output_layer.weight.t().contiguous()
        return w_cat, bias, w_out, self.output_layer.bias

    def rollout(self, inputs: PackedSequence) -> PackedSequence:
        """Batched rollout: ``[N, num_inputs]`` packed inputs -> ``[N, 2]`` packed positions."""
        return self.rollout_with_state(inputs)[0]

    def rollout_with_state(
        self, inputs: PackedSequence, state: RolloutState | None = None
    ) -> tuple[PackedSequence, RolloutState]:
        """Batched rollout from ``state`` (zeros when None); returns positions and final state.

        ``state`` and the returned state hold one row per sequence, in the order the sequences
        were packed (``sorted_indices`` maps them to the packed order and back).
        """
        if not isinstance(inputs, PackedSequence):
            raise TypeError(f"rollout takes a PackedSequence, got {type(inputs).__name__}")
        self._check_width(inputs.data)
        w_cat, bias, w_out, b_out = self.fused_weights()
        sizes: list[int] = inputs.batch_sizes.tolist()
        order = inputs.sorted_indices
        h0 = c0 = p0 = None
        if state is not None:
            self._check_state(state, sizes[0])
            sorted_state = state if order is None else state.index(order)
            h0, c0, p0 = sorted_state.h, sorted_state.c, sorted_state.p
        out, h, c, p = self._rollout_fn(inputs.data, sizes, w_cat, bias, w_out, b_out, h0, c0, p0)
        final = RolloutState(h, c, p)
        if inputs.unsorted_indices is not None:
            final = final.index(inputs.unsorted_indices)
        packed = PackedSequence(
            out, inputs.batch_sizes, inputs.sorted_indices, inputs.unsorted_indices
        )
        return packed, final

    def _check_state(self, state: RolloutState, batch: int) -> None:
        want = (self.num_layers, batch, self.hidden_size)
        if tuple(state.h.shape) != want or tuple(state.c.shape) != want:
            raise ValueError(
                f"state h and c must have shape {list(want)}, got {list(state.h.shape)} "
                f"and {list(state.c.shape)}"
            )
        if tuple(state.p.shape) != (batch, 2):
            raise ValueError(f"state p must have shape [{batch}, 2], got {list(state.p.shape)}")

    def forward(self, inputs: Tensor) -> Tensor:
        """One sequence, time-major: ``[T, 1, num_inputs]`` -> ``[T, 2]``."""
        if inputs.dim() != 3 or inputs.shape[1] != 1:
            raise ValueError(
                f"expected inputs of shape [T, 1, {self.num_inputs}], got {list(inputs.shape)}"
            )
        u = inputs[:, 0, :]
        self._check_width(u)
        if self.training and self.dropout > 0:
            return self._stepwise(inputs)  # nn.LSTM applies dropout between layers
        w_cat, bias, w_out, b_out = self.fused_weights()
        return self._rollout_fn(u, [1] * u.shape[0], w_cat, bias, w_out, b_out)[0]

    def _stepwise(self, inputs: Tensor) -> Tensor:
        hidden: tuple[Tensor, Tensor] | None = None
        prev = inputs.new_zeros(1, 1, 2)
        outs = []
        for t in range(inputs.shape[0]):
            out, hidden = self.lstm_layers(torch.cat([prev, inputs[t : t + 1]], 2), hidden)
            prev = self.activation(self.output_layer(out))
            outs.append(prev)
        return torch.cat(outs, 0).squeeze(1)

    def _check_width(self, u: Tensor) -> None:
        if u.dim() != 2 or u.shape[1] != self.num_inputs:
            raise ValueError(
                f"expected inputs with {self.num_inputs} features per step, got "
                f"shape {list(u.shape)}"
            )
