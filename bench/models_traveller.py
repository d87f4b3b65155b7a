"""The Traveller's cases of bench.bench_models: the float64 reference, the per-step rollout,
each rollout backend (and CUDA graphs of them), JAX's rollout, against nn.LSTM's bound, and the
compile times.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from bench.models_harness import (
    GRAPH_SUFFIX,
    JAX_ROLLOUT,
    STEP_LOOP_ROLLOUT,
    TRAVELLER_BOUND,
    Builder,
    Case,
    Unavailable,
    _clock,
    _fmt_s,
    _log,
    _mask,
    _nothing,
    check,
    half_spread_lengths,
    packed_to_padded,
    padded64,
    random_sequences,
    shape_label,
    spread_lengths,
)
from bench.models_suite import SuiteBase
from bench.padding import padded_time_major
from rnnserve.models.kernels import ema_packed_numba
from rnnserve.models.packing import pack
from rnnserve.models.traveller import (
    Traveller,
    TravellerConfig,
    rollout_backend_fn,
    scripted_rollout,
)
from rnnserve.options import ROLLOUT_BACKENDS, RolloutBackend

SWEEP_ROUNDS = 5  # interleaved calls of each JAX variant before the fastest is kept


def _block(out: object) -> object:
    import jax

    return jax.block_until_ready(out)


def rollout_reference(model64: Traveller, seqs: Sequence[Tensor]) -> np.ndarray:
    """float64 positions ``[B, T, 2]``: the plain loop (``nn.LSTM`` once per step, state
    carried), run on the whole padded batch at once -- the rollout is causal, so each
    sequence's real steps are exact; padded steps are zeroed."""
    u = torch.from_numpy(padded64(seqs))
    p = u.new_zeros(u.shape[0], 1, 2)
    hidden: tuple[Tensor, Tensor] | None = None
    out = np.zeros((u.shape[0], u.shape[1], 2))
    with torch.no_grad():
        for t in range(u.shape[1]):
            h, hidden = model64.lstm_layers(torch.cat([p, u[:, t : t + 1]], 2), hidden)
            p = torch.tanh(model64.output_layer(h))
            out[:, t] = p[:, 0].numpy()
    return np.where(_mask([len(q) for q in seqs], u.shape[1])[..., None], out, 0.0)


def traveller_step_loop(model: Traveller, sequences: Sequence[Tensor]) -> list[Tensor]:
    """The plain rollout: per sequence, ``nn.LSTM`` called once per step."""
    results = []
    for u in sequences:
        inputs = u.unsqueeze(1)  # [T, 1, num_inputs], Traveller.forward's layout
        hidden: tuple[Tensor, Tensor] | None = None
        prev = inputs.new_zeros(1, 1, 2)
        positions = []
        for t in range(inputs.shape[0]):
            out, hidden = model.lstm_layers(torch.cat([prev, inputs[t : t + 1]], 2), hidden)
            prev = model.activation(model.output_layer(out))
            positions.append(prev)
        results.append(torch.cat(positions, 0).squeeze(1))
    return results


def make_traveller() -> Traveller:
    torch.manual_seed(0)
    cfg = TravellerConfig()
    model = Traveller(cfg.num_inputs, cfg.hidden_size, cfg.num_layers, cfg.dropout)
    return model.eval().requires_grad_(False)


def copy_model(
    model: Traveller, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Traveller:
    """A copy on ``device``; made outside inference mode, so its parameters are normal tensors
    (as in the service, which loads models before any request runs under inference mode)."""
    with torch.inference_mode(False):
        clone = copy.deepcopy(model).to(device)
        return clone if dtype is None else clone.to(dtype)


def with_backend(model: Traveller, backend: str, device: torch.device | str = "cpu") -> Traveller:
    """A copy of ``model`` on ``device`` with rollout ``backend``; Unavailable if it is not."""
    clone = copy_model(model, device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            clone.compile_rollout(cast(RolloutBackend, backend))
    except ImportError as e:
        raise Unavailable(f"not in this checkout ({type(e).__name__}: {e})") from e
    return clone


class TravellerBench(SuiteBase):
    """The Traveller's cases, per shape of the plan, and the compile and capture times."""

    def traveller_builders(
        self, base: Traveller, seqs: Sequence[Tensor], seed: int, label: str
    ) -> list[tuple[str, Builder]]:
        plan, dev = self.plan, self.device
        lengths = [len(s) for s in seqs]
        x = pack(seqs, dev)
        base64 = copy_model(base, dtype=torch.float64)
        ref = rollout_reference(base64, seqs)

        def bound() -> Case:
            padded, _ = pad_packed_sequence(x, batch_first=True)  # [B, T, num_inputs]
            gen = torch.Generator().manual_seed(seed)
            fed_back = torch.rand(padded.shape[0], padded.shape[1], 2, generator=gen) * 2 - 1
            z = torch.cat([fed_back.to(dev), padded], 2)  # [B, T, 2 + num_inputs]
            model = copy_model(base, dev)

            def fn() -> Tensor:
                h, _ = model.lstm_layers(z)
                return torch.tanh(model.output_layer(h))

            with torch.no_grad():
                h64, _ = base64.lstm_layers(z.cpu().double())
                want = torch.tanh(base64.output_layer(h64)).numpy()
            got = fn().cpu().double().numpy()
            err = check(TRAVELLER_BOUND, got, want, [z.shape[1]] * z.shape[0])
            return Case(TRAVELLER_BOUND, fn, self.wait, err=err)

        def backend(name: str) -> tuple[str, Builder]:
            row = f'Traveller.rollout, "{name}"'

            def build() -> Case:
                if name == "numba" and self.cuda:
                    raise Unavailable("a CPU backend")
                if name == "triton" and not self.cuda:
                    raise Unavailable(
                        "Triton needs CUDA (on the CPU it runs only in Triton's interpreter, "
                        "for the tests)"
                    )
                model = with_backend(base, name, dev)
                if name in ("numba", "triton"):
                    what = f"{name} rollout backend, first call ({label})"
                    out = self.first_call(what, lambda: model.rollout(x))
                else:
                    out = model.rollout(x)
                err = check(row, packed_to_padded(cast(PackedSequence, out)), ref, lengths)
                return Case(row, lambda: model.rollout(x), self.wait, err=err)

            return row, build

        def graphed(name: str) -> tuple[str, Builder]:
            row = f'Traveller.rollout, "{name}"{GRAPH_SUFFIX}'

            def build() -> Case:
                if name == "triton":  # refused by the backend itself, before anything runs
                    raise Unavailable(
                        "it replays CUDA graphs of its own (one per chunk of steps), and a "
                        "graph's replay cannot be captured into another graph"
                    )
                model = with_backend(base, name, dev)
                try:
                    replay, out, secs = capture_graph(lambda: model.rollout(x))
                except Exception as e:
                    raise Unavailable(f"could not be captured ({type(e).__name__}: {e})") from e
                self.res.compile.append(
                    (f"CUDA graph capture, {name} rollout ({label})", _fmt_s(secs))
                )
                replay()
                torch.cuda.synchronize()
                err = check(row, packed_to_padded(cast(PackedSequence, out)), ref, lengths)
                return Case(row, replay, self.wait, err=err)

            return row, build

        def step_loop() -> Case:
            if self.cuda:
                raise Unavailable("per-step nn.LSTM calls of one row: minutes per call on CUDA")
            if x.data.shape[0] > plan.step_loop_rollout_rows:
                raise Unavailable(
                    f"{x.data.shape[0]:,} sequence steps would take ~"
                    f"{x.data.shape[0] * 320e-6:.0f} s a call; the B=1 row gives its cost per step"
                )
            got = torch.nn.utils.rnn.pad_sequence(traveller_step_loop(base, seqs), batch_first=True)
            err = check(STEP_LOOP_ROLLOUT, got.double().numpy(), ref, lengths)
            return Case(
                STEP_LOOP_ROLLOUT, lambda: traveller_step_loop(base, seqs), slow=True, err=err
            )

        def jax_rollout() -> Case:
            lstm = base.lstm_layers
            layers = range(base.num_layers)
            if self.jax_process:
                us, mask = padded_time_major([s.numpy() for s in seqs])
                arrays = {"u": us, "mask": mask, "layers": np.asarray(base.num_layers)}
                for k in layers:
                    for key, attr in (("w_ih", "weight_ih"), ("w_hh", "weight_hh")):
                        arrays[f"{key}_{k}"] = getattr(lstm, f"{attr}_l{k}").numpy()
                    for key, attr in (("b_ih", "bias_ih"), ("b_hh", "bias_hh")):
                        arrays[f"{key}_{k}"] = getattr(lstm, f"{attr}_l{k}").numpy()
                arrays["w_out"] = base.output_layer.weight.numpy()
                arrays["b_out"] = base.output_layer.bias.numpy()
                out, timing = self.jax_elsewhere("traveller_rollout_scan", arrays, label)
                got = out.astype(np.float64).transpose(1, 0, 2)
                err = check(JAX_ROLLOUT, got, ref, lengths)
                return Case(JAX_ROLLOUT, _nothing, err=err, external=timing)
            jb = self._jax()
            import jax

            weights = jb.traveller_weights(
                [getattr(lstm, f"weight_ih_l{k}").numpy() for k in layers],
                [getattr(lstm, f"weight_hh_l{k}").numpy() for k in layers],
                [getattr(lstm, f"bias_ih_l{k}").numpy() for k in layers],
                [getattr(lstm, f"bias_hh_l{k}").numpy() for k in layers],
                base.output_layer.weight.numpy(),
                base.output_layer.bias.numpy(),
                device=self.jax_device,
            )
            us, mask = jb.padded_time_major([s.numpy() for s in seqs])
            args = [jax.device_put(v, self.jax_device) for v in (us, mask)]
            kept = self.fastest_jax_rollout(jb, (*args, weights), ref, lengths, label)
            return Case(JAX_ROLLOUT, kept.fn, jax.block_until_ready, err=kept.err)

        backends = [b for b in ROLLOUT_BACKENDS if b != "auto"]
        builders: list[tuple[str, Builder]] = [
            (TRAVELLER_BOUND, bound),
            *(backend(b) for b in backends),
            (STEP_LOOP_ROLLOUT, step_loop),
            (JAX_ROLLOUT, jax_rollout),
        ]
        if self.cuda:  # last: a capture that goes wrong should not upset the others' set-up
            builders += [graphed(b) for b in backends if b != "numba"]
        return builders

    def fastest_jax_rollout(
        self, jb: Any, args: tuple[Any, ...], ref: np.ndarray, lengths: list[int], label: str
    ) -> Case:
        """Every variant of ``jb.CPU_CANDIDATES`` compiled, checked against ``ref`` and timed
        in a few interleaved rounds; the fastest as a case, and a note naming it."""
        tried: list[tuple[Case, float]] = []
        for variant in jb.CPU_CANDIDATES:
            fn, secs = jb.compile_for(jb.rollout_variant_fn(variant), *args)
            got = np.asarray(fn(*args), dtype=np.float64).transpose(1, 0, 2)
            err = check(f"{JAX_ROLLOUT}, {variant.label}", got, ref, lengths)
            call = functools.partial(fn, *args)
            tried.append((Case(variant.label, call, _block, err=err), secs))
        cases = [case for case, _ in tried]
        times: dict[str, list[float]] = {case.name: [] for case in cases}
        for r in range(SWEEP_ROUNDS):
            for case in [*cases[r % len(cases) :], *cases[: r % len(cases)]]:
                times[case.name].append(_clock(case, 1))
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        kept, secs = min(tried, key=lambda t: medians[t[0].name])
        self.res.compile.append((f"JAX jit compile, rollout {kept.name} ({label})", _fmt_s(secs)))
        others = "; ".join(f"{name} {_fmt_s(t)}" for name, t in medians.items())
        self.res.notes.append(
            f"JAX rollout at {label}: the fastest of {len(cases)} ways of writing it, "
            f"**{kept.name}**, is the JAX row (medians of {SWEEP_ROUNDS} interleaved calls: "
            f"{others})."
        )
        return kept

    def bench_traveller(self, base: Traveller) -> None:
        for i, (batch, steps) in enumerate(self.plan.traveller_shapes):
            label = shape_label(batch, steps)
            _log(f"traveller {label}")
            seqs = random_sequences(half_spread_lengths(batch, steps), base.num_inputs, 100 + i)
            builders = self.traveller_builders(base, seqs, 200 + i, label)
            n = sum(len(u) for u in seqs)
            self.run_shape(builders, self.res.traveller, batch, steps, n)
            by_name = {r.name: r for r in self.res.traveller if r.shape == label}
            numba, jax_row = by_name.get('Traveller.rollout, "numba"'), by_name.get(JAX_ROLLOUT)
            if numba is not None and jax_row is not None:
                self.res.notes.append(
                    f"numba rollout / JAX rollout at {label}: "
                    f"{numba.timing.median / jax_row.timing.median:.2f}× (medians"
                    f"{', JAX in its own process' if self.jax_process else ', same rounds'})."
                )
        try:
            auto = rollout_backend_fn("auto", self.device)[1]
            self.res.notes.append(
                f'`Traveller.compile_rollout("auto")` resolves to "{auto}" on {self.device.type}.'
            )
        except Exception as e:  # a backend module that is half there
            self.res.notes.append(f'`rollout_backend_fn("auto")` failed here: {e}')

    # -- the GRU encoder (your own model) ---------------------------------------------------

    def bench_compile(self, base: Traveller) -> None:
        """First calls, before anything else in this process has compiled them."""
        _log("compile and first-call times")
        res, plan, dev = self.res, self.plan, self.device
        if not self.cuda:
            x = pack(random_sequences(spread_lengths(4, 50), plan.feat_dim, seed=99))
            alpha = torch.full((plan.feat_dim,), 0.5)

            def numba_call() -> object:
                return ema_packed_numba(x.data, x.batch_sizes, alpha)

            first = _clock(Case("", numba_call), 1)
            again = min(_clock(Case("", numba_call), 1) for _ in range(5))
            res.compile.append(
                ("numba `ema_packed_numba`, first call (JIT compile, B=4 T=50)", _fmt_s(first))
            )
            res.compile.append(
                ("numba `ema_packed_numba`, a later call of the same size", _fmt_s(again))
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            script_s = _clock(Case("", scripted_rollout), 1)
        res.compile.append(("`torch.jit.script(rollout_packed)`", _fmt_s(script_s)))
        scripted = with_backend(base, "torchscript", dev)
        batch, steps = plan.traveller_shapes[0]
        u = pack(random_sequences([steps] * batch, base.num_inputs, seed=98), dev)
        call = Case("", lambda: scripted.rollout(u), self.wait)
        calls = [_clock(call, 1) for _ in range(4)]
        steady = statistics.median(_clock(call, 1) for _ in range(5))
        where = shape_label(batch, steps)
        for k, t in enumerate(calls, 1):
            res.compile.append((f"TorchScript rollout, call {k} ({where})", _fmt_s(t)))
        res.compile.append(
            (f"TorchScript rollout, steady state ({where}, median of 5)", _fmt_s(steady))
        )


def capture_graph(
    fn: Callable[[], object], warmup: int = 3
) -> tuple[Callable[[], object], object, float]:
    """``fn`` captured in one CUDA graph: (replay, the output it refills, capture seconds).

    Warm-up runs on a side stream first, as ``torch.cuda.graphs`` asks (TorchScript profiles and
    allocators settle there). Replays only ever run the captured shapes.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph.replay, out, time.perf_counter() - start
