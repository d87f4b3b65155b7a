"""Train a model for rnnserve on synthetic data: ``rnnserve train KIND`` (or
``python -m rnnserve.models.train KIND``).

``smoother``: multichannel denoising. Each of the ``--features`` channels is a clean AR(1) signal
``z_t = rho_c z_{t-1} + sqrt(1 - rho_c^2) e_t`` (unit variance; ``rho_c`` from fast to slow
across the channels) seen through Gaussian noise of its own level ``sigma_c`` (from faint to
strong, in another order, so the two do not line up); the target is ``tanh(z_t)``. The
smoother learns one ``alpha`` per channel: near 0 where the signal is fast and the noise faint,
near 1 where it is slow and the noise strong. Training runs the compiled CPU loss and
gradients (:meth:`LinearRecursion.mse_loss`, the mean squared error fused into the kernels), a
fresh packed batch of random lengths each step, Adam, ``alpha`` kept in ``[0, ALPHA_MAX]``
after each step.

``traveller``: dead reckoning. A 2-D agent starts at the origin facing ``+x``; at each step it
turns by ``TURN_RAD * turn_t`` and moves ``STEP * speed_t`` along its new heading. The model sees
the six commands ``(turn_t, speed_t, d1_t .. d4_t)`` (``d*``: distractors it must learn to
ignore) and answers the position squashed into ``[-1, 1]^2``, ``tanh(xy_t / SCALE)``. Training
runs the model's own autoregressive rollout (:meth:`Traveller.rollout`, each output fed back as
the next step's input, with autograd), so the error it is trained on is the free-running one the
server answers; Adam with a cosine-decayed step size and clipped gradients.

Writes ``<out>/<name>.safetensors`` (``models.save``: the kind, its config, the weights), loads
it back as the server does and checks that it answers like the trained module, and writes a
model card ``<out>/<name>.md`` and the numbers behind it, ``<out>/<name>.json`` (the loss curve
and the validation or held-out figures; ``rnnserve.models.pictures`` plots them). Serve the
folder with ``rnnserve --model-dir OUT``. Everything is drawn from ``--seed``: the same
arguments give the same file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rnnserve import models
from rnnserve.models.packing import pack
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import Traveller

ALPHA_MAX = 0.999  # alpha = 1 would ignore every input after the first
FILE_MODE = 0o644  # readable by the server, which may run as another user
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # the names rnnserve export takes


@dataclass(frozen=True)
class Channels:
    """The synthetic task: per channel, the signal's AR(1) coefficient and the noise level."""

    rho: np.ndarray  # [F], in (0, 1): near 1 = slow
    sigma: np.ndarray  # [F], noise standard deviation (the signal's is 1)

    @staticmethod
    def spread(n_feat: int) -> Channels:
        """Dynamics from fast (``rho`` 0.5) to slow (0.995) across the channels, and noise
        levels from 0.05 to 1.0 in a fixed shuffled order, so that slow channels come with
        faint noise as well as strong (and fast ones too)."""
        k = np.arange(n_feat)
        rho = 1 - 0.5 * (0.01 ** (k / max(n_feat - 1, 1)))
        shuffle = np.random.default_rng(20240).permutation(n_feat)
        sigma = np.geomspace(0.05, 1.0, n_feat)[shuffle]
        return Channels(rho, sigma)


def sequences(
    channels: Channels, lengths: Sequence[int], gen: torch.Generator
) -> tuple[list[Tensor], list[Tensor]]:
    """Noisy inputs ``[T_i, F]`` and their targets ``tanh(clean)``, float32."""
    rho = torch.from_numpy(channels.rho)
    sigma = torch.from_numpy(channels.sigma)
    shape = (max(lengths), len(lengths), len(channels.rho))  # time-major, all sequences at once
    e = torch.randn(shape, generator=gen, dtype=torch.float64)
    z = torch.empty_like(e)
    z[0] = e[0]  # started in the stationary distribution
    drive = torch.sqrt(1 - rho**2)
    for t in range(1, shape[0]):
        z[t] = rho * z[t - 1] + drive * e[t]
    x = z + sigma * torch.randn(shape, generator=gen, dtype=torch.float64)
    x, y = x.float(), torch.tanh(z).float()
    xs = [x[:n, j].contiguous() for j, n in enumerate(lengths)]
    ys = [y[:n, j].contiguous() for j, n in enumerate(lengths)]
    return xs, ys


def random_lengths(gen: torch.Generator, batch: int, length: int) -> list[int]:
    """``batch`` lengths from ``length / 2`` to ``length`` (at least 1)."""
    low = max(1, length // 2)
    return torch.randint(low, length + 1, (batch,), generator=gen).tolist()


def progress(total: int, every: int) -> Iterator[int]:
    """The step numbers, with a tqdm bar when tqdm is installed, else a line per ``every``."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield from range(total)
        return
    yield from tqdm(range(total), desc="training", unit="step", file=sys.stderr, miniters=every)


@dataclass(frozen=True)
class CurvePoint:
    """The training loss (the step's batch) and the validation loss after ``step`` steps."""

    step: int
    loss: float
    validation: float


@dataclass
class Result:
    model: LinearRecursion
    val_loss: float
    baseline_loss: float  # the untrained smoother (alpha 0.5, wx 1)
    raw_loss: float  # no smoothing: tanh(x)
    seconds: float
    curve: list[CurvePoint]


def val_loss(model: LinearRecursion, xs: list[Tensor], ys: list[Tensor]) -> float:
    with torch.no_grad():
        return float(F.mse_loss(model(pack(xs)).data, pack(ys).data))


def train_smoother(
    n_feat: int, steps: int, batch: int, length: int, lr: float, seed: int, quiet: bool = False
) -> tuple[Result, Channels]:
    channels = Channels.spread(n_feat)
    gen = torch.Generator().manual_seed(seed)
    val_x, val_y = sequences(channels, random_lengths(gen, batch, length), gen)
    model = LinearRecursion(n_feat)
    baseline = val_loss(model, val_x, val_y)
    raw = float(F.mse_loss(torch.tanh(pack(val_x).data), pack(val_y).data))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    every = max(1, steps // 10)
    curve = [CurvePoint(0, baseline, baseline)]
    start = time.perf_counter()
    for step in progress(steps, every):
        xs, ys = sequences(channels, random_lengths(gen, batch, length), gen)
        x, want = pack(xs), pack(ys).data
        opt.zero_grad(set_to_none=True)
        loss = model.mse_loss(x, want)  # F.mse_loss, fused into the compiled kernels
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.alpha_smooth.clamp_(0.0, ALPHA_MAX)
        if (step + 1) % every == 0 or step + 1 == steps:
            point = CurvePoint(step + 1, loss.item(), val_loss(model, val_x, val_y))
            curve.append(point)
            if not quiet:
                rate = point.step / (time.perf_counter() - start)
                print(
                    f"step {point.step}/{steps}: loss {point.loss:.5f}, "
                    f"validation {point.validation:.5f}, {rate:.2f} steps/s, "
                    f"ETA {_duration((steps - point.step) / rate)}",
                    file=sys.stderr,
                    flush=True,
                )
    seconds = time.perf_counter() - start
    model.eval().requires_grad_(False)
    result = Result(model, val_loss(model, val_x, val_y), baseline, raw, seconds, curve)
    return result, channels


def write_model(model: nn.Module, path: Path) -> None:
    """``models.save`` to a file beside ``path``, then renamed: a server polling the folder
    never reads half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        models.save(model, tmp)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_loaded(model: LinearRecursion, name: str, out: Path, xs: list[Tensor]) -> float:
    """The largest difference between the file, loaded as the server loads it, and ``model``."""
    loaded = models.load(name, out)
    with torch.no_grad():
        got = loaded(pack(xs)).data
        want = model(pack(xs)).data
    return float((got - want).abs().max())


def model_card(
    name: str, result: Result, channels: Channels, args: argparse.Namespace, worst: float
) -> str:
    model = result.model
    alpha = model.alpha_smooth.detach().numpy()
    wx = model.wx.detach().numpy()
    rows = [
        f"| {c} | {channels.rho[c]:.4f} | {channels.sigma[c]:.3f} | {alpha[c]:.4f} | {wx[c]:.4f} |"
        for c in range(len(alpha))
    ]
    command = (
        f"rnnserve train smoother --out {args.out} --name {name} "
        f"--features {args.features} --steps {args.steps} --batch {args.batch} "
        f"--length {args.length} --lr {args.lr:g} --seed {args.seed}"
    )
    return "\n".join(
        [
            f"# {name}: a smoother trained on synthetic denoising data",
            "",
            f"`{name}.safetensors`: kind `smoother` (`LinearRecursion(feat_dim={len(alpha)})`, "
            "`y_t = tanh(wx * s_t)`, `s_t = alpha * s_{t-1} + (1 - alpha) * x_t`, `s_0 = x_0`), "
            f"input and output `[T, {len(alpha)}]` float32.",
            "",
            "**Synthetic data only.** Each channel is a clean AR(1) signal "
            "`z_t = rho z_{t-1} + sqrt(1 - rho^2) e_t` (unit variance) plus Gaussian noise of "
            "standard deviation `sigma`; the target is `tanh(z_t)`. The weights say how much to "
            "smooth *these* channels; they carry no meaning for other data.",
            "",
            f"Trained with `{command}`: {args.steps} Adam steps (lr {args.lr:g}) on fresh batches "
            f"of {args.batch} sequences of {max(1, args.length // 2)}..{args.length} steps, "
            f"mean squared error, `alpha` kept in [0, {ALPHA_MAX}]; "
            f"{result.seconds:.1f} s on the CPU.",
            "",
            "Validation (a fixed batch drawn from the same seed), mean squared error:",
            "",
            "| | MSE |",
            "|---|---:|",
            f"| no smoothing, `tanh(x)` | {result.raw_loss:.5f} |",
            f"| untrained (`alpha` 0.5, `wx` 1) | {result.baseline_loss:.5f} |",
            f"| **this model** | **{result.val_loss:.5f}** |",
            "",
            "Per channel: the data's `rho` and `sigma`, the learned `alpha` and `wx`:",
            "",
            "| channel | rho | sigma | alpha | wx |",
            "|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Loaded back with `rnnserve.models.load`, it answers like the trained module to "
            f"{worst:.1e}. Serve it with `rnnserve --model-dir {args.out}`.",
            "",
        ]
    )


# The traveller's world: how far a command turns and moves the agent, and the squashing scale.
TURN_RAD = 0.1  # radians of heading change per unit of the turn command
STEP = 0.12  # distance per step at full speed (speed command 1)
SCALE = 2.0  # positions are tanh(xy / SCALE): the agent's typical reach maps inside (-1, 1)
COMMAND_RHO = 0.9  # every command channel is an AR(1) process: smooth, like steering
N_COMMANDS = 6  # turn, speed and four distractors
HELD_OUT_SEED_OFFSET = 1_000_003  # held-out data come from a generator no training draw shares


def _ar1(gen: torch.Generator, steps: int, shape: tuple[int, ...]) -> Tensor:
    """``steps`` draws of unit-variance AR(1) processes of coefficient ``COMMAND_RHO``."""
    e = torch.randn((steps, *shape), generator=gen, dtype=torch.float64)
    out = torch.empty_like(e)
    out[0] = e[0]  # started in the stationary distribution
    drive = math.sqrt(1 - COMMAND_RHO**2)
    for t in range(1, steps):
        out[t] = COMMAND_RHO * out[t - 1] + drive * e[t]
    return out


def commands(gen: torch.Generator, lengths: Sequence[int]) -> list[Tensor]:
    """Command sequences ``[T_i, 6]`` float32: ``turn`` (unit variance), ``speed`` in
    ``(0, 1)``, then four distractors (unit variance, as smooth as the real commands)."""
    raw = _ar1(gen, max(lengths), (len(lengths), N_COMMANDS))  # [T, B, 6]
    raw[..., 1] = torch.sigmoid(2 * raw[..., 1])
    u = raw.float()
    return [u[:n, j].contiguous() for j, n in enumerate(lengths)]


def _integrate(u: Tensor, turn_rad: float) -> Tensor:
    """Positions ``tanh(xy_t / SCALE)`` ``[T, 2]`` from commands ``[T, 6]``, turning
    ``turn_rad`` per unit of the turn command (0: the agent keeps facing ``+x``)."""
    u64 = u.double()
    heading = torch.cumsum(turn_rad * u64[:, 0], 0)
    step = STEP * u64[:, 1]
    xy = torch.stack(
        [torch.cumsum(step * torch.cos(heading), 0), torch.cumsum(step * torch.sin(heading), 0)],
        1,
    )
    return torch.tanh(xy / SCALE).float()


def true_positions(u: Tensor) -> Tensor:
    """Where the agent is after each command of ``u`` ``[T, 6]``: ``[T, 2]``, squashed."""
    return _integrate(u, TURN_RAD)


def straight_line(u: Tensor) -> Tensor:
    """The baseline that reads the speed command but not the turns: dead reckoning along the
    starting heading."""
    return _integrate(u, 0.0)


def trajectories(gen: torch.Generator, lengths: Sequence[int]) -> tuple[list[Tensor], list[Tensor]]:
    """Commands ``[T_i, 6]`` and the true squashed positions ``[T_i, 2]``."""
    us = commands(gen, lengths)
    return us, [true_positions(u) for u in us]


@dataclass(frozen=True)
class Errors:
    """A predictor's held-out errors, in the squashed ``[-1, 1]^2`` coordinates."""

    mse: float  # mean squared error per coordinate, every step
    mean_distance: float  # mean Euclidean distance, every step
    final_distance: float  # mean Euclidean distance at each sequence's last step

    @staticmethod
    def of(predicted: Sequence[Tensor], truth: Sequence[Tensor]) -> Errors:
        got = torch.cat(list(predicted)).double()
        want = torch.cat(list(truth)).double()
        last = torch.stack([p[-1] - t[-1] for p, t in zip(predicted, truth, strict=True)]).double()
        return Errors(
            float(((got - want) ** 2).mean()),
            float((got - want).norm(dim=1).mean()),
            float(last.norm(dim=1).mean()),
        )


def free_rollout(model: Traveller, us: Sequence[Tensor]) -> list[Tensor]:
    """The model's positions for each command sequence, every output fed back (no truth)."""
    with torch.no_grad():
        out = model.rollout(pack(list(us)))
    lengths = [len(u) for u in us]
    padded, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
    return [padded[j, :n] for j, n in enumerate(lengths)]


def held_out_errors(
    model: Traveller, us: Sequence[Tensor], ps: Sequence[Tensor]
) -> dict[str, Errors]:
    """The held-out errors of the model and of the baselines, by name."""
    return {
        "origin": Errors.of([torch.zeros_like(p) for p in ps], ps),
        "straight_line": Errors.of([straight_line(u) for u in us], ps),
        "model": Errors.of(free_rollout(model, us), ps),
    }


@dataclass
class TravellerResult:
    model: Traveller
    init: dict[str, Errors]  # held-out errors before training (the seeded initialisation)
    held_out: dict[str, Errors]  # after
    held_out_long: dict[str, Errors]  # after, on sequences twice the training length
    seconds: float
    curve: list[CurvePoint]


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def _rollout_mse(model: Traveller, us: Sequence[Tensor], ps: Sequence[Tensor]) -> Tensor:
    out = model.rollout(pack(list(us))).data
    return F.mse_loss(out, pack(list(ps)).data)


def train_traveller(args: argparse.Namespace) -> TravellerResult:
    """Seeded from ``args.seed``: the initialisation, every batch and the held-out set."""
    torch.manual_seed(args.seed)  # nn.LSTM and nn.Linear initialise from the global generator
    model = Traveller(N_COMMANDS, args.hidden, args.layers)
    gen = torch.Generator().manual_seed(args.seed)
    val_u, val_p = trajectories(gen, [args.length] * args.batch)
    held_gen = torch.Generator().manual_seed(args.seed + HELD_OUT_SEED_OFFSET)
    held_u, held_p = trajectories(held_gen, [args.length] * args.held_out)
    init = held_out_errors(model, held_u, held_p)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps, eta_min=args.lr / 20)
    every = max(1, args.steps // 20)
    with torch.no_grad():
        first = float(_rollout_mse(model, val_u, val_p))
    curve = [CurvePoint(0, first, first)]
    start = time.perf_counter()
    for step in range(args.steps):
        us, ps = trajectories(gen, random_lengths(gen, args.batch, args.length))
        opt.zero_grad(set_to_none=True)
        loss = _rollout_mse(model, us, ps)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        done = step + 1
        if done % every == 0 or done == args.steps:
            with torch.no_grad():
                point = CurvePoint(done, loss.item(), float(_rollout_mse(model, val_u, val_p)))
            curve.append(point)
            if not args.quiet:
                elapsed = time.perf_counter() - start
                rate = done / elapsed
                print(
                    f"step {done}/{args.steps}: loss {point.loss:.5f}, validation "
                    f"{point.validation:.5f}, {rate:.2f} steps/s, "
                    f"ETA {_duration((args.steps - done) / rate)}",
                    file=sys.stderr,
                    flush=True,
                )
    seconds = time.perf_counter() - start
    model.eval().requires_grad_(False)
    long_gen = torch.Generator().manual_seed(args.seed + HELD_OUT_SEED_OFFSET + 1)
    long_u, long_p = trajectories(long_gen, [2 * args.length] * args.held_out)
    held = held_out_errors(model, held_u, held_p)
    held_long = held_out_errors(model, long_u, long_p)
    return TravellerResult(model, init, held, held_long, seconds, curve)


def check_loaded_traveller(model: Traveller, name: str, out: Path, us: list[Tensor]) -> float:
    """The largest difference between the file, loaded as the server loads it (the eager
    rollout, which every backend is tested against), and ``model``."""
    loaded = models.load(name, out, rollout_backend="eager")
    assert isinstance(loaded, Traveller)
    got = torch.cat(free_rollout(loaded, us))
    want = torch.cat(free_rollout(model, us))
    return float((got - want).abs().max())


def _errors_row(label: str, e: Errors, bold: bool = False) -> str:
    cells = [f"{e.mse:.5f}", f"{e.mean_distance:.4f}", f"{e.final_distance:.4f}"]
    if bold:
        label, cells = f"**{label}**", [f"**{c}**" for c in cells]
    return f"| {label} | " + " | ".join(cells) + " |"


def traveller_card(
    name: str, result: TravellerResult, args: argparse.Namespace, worst: float
) -> str:
    command = (
        f"rnnserve train traveller --out {args.out} --name {name} "
        f"--hidden {args.hidden} --layers {args.layers} --steps {args.steps} "
        f"--batch {args.batch} --length {args.length} --lr {args.lr:g} --seed {args.seed}"
    )
    held, init = result.held_out, result.init
    curve_rows = [f"| {p.step} | {p.loss:.5f} | {p.validation:.5f} |" for p in result.curve]
    low = max(1, args.length // 2)
    return "\n".join(
        [
            f"# {name}: a traveller trained on synthetic dead reckoning",
            "",
            f"`{name}.safetensors`: kind `traveller` (`Traveller(num_inputs={N_COMMANDS}, "
            f"hidden_size={args.hidden}, num_layers={args.layers})`), input `[T, {N_COMMANDS}]` "
            "commands, output `[T, 2]` positions in `[-1, 1]^2`, each fed back as the next "
            "step's input.",
            "",
            "**Synthetic data only.** A 2-D agent starts at the origin facing `+x`. Each step "
            f"it turns by `{TURN_RAD:g} * turn` radians and moves `{STEP:g} * speed` along its new "
            f"heading; the answer is `tanh(xy / {SCALE:g})`. The inputs are "
            "`(turn, speed, d1, d2, d3, d4)`: every channel an AR(1) process of coefficient "
            f"{COMMAND_RHO:g} (turn and the distractors `d*` of unit variance, speed "
            "`sigmoid(2 a)` of one, in (0, 1)); the distractors do not move the agent. The "
            "weights mean something for *these* commands only.",
            "",
            f"Trained with `{command}`: {args.steps} Adam steps (lr {args.lr:g}, cosine-decayed "
            f"to {args.lr / 20:g}, gradient norm clipped to 1) on fresh batches of "
            f"{args.batch} sequences of {low}..{args.length} steps, mean squared error of the "
            "free-running rollout (the model's own outputs fed back, never the true positions); "
            f"{result.seconds:.1f} s on the CPU.",
            "",
            f"Held out: {args.held_out} sequences of {args.length} steps from a generator no "
            "training draw shares; every figure is the free-running rollout from the commands "
            "alone. MSE per coordinate, distances Euclidean, in the squashed coordinates:",
            "",
            "| predictor | MSE | mean distance | final distance |",
            "|---|---:|---:|---:|",
            _errors_row("the origin, always", held["origin"]),
            _errors_row("straight line (speed read, turns ignored)", held["straight_line"]),
            _errors_row("untrained (the seeded initialisation)", init["model"]),
            _errors_row("this model", held["model"], bold=True),
            "",
            f"Beyond the trained length the rollout drifts: on {args.held_out} held-out "
            f"sequences of {2 * args.length} steps, twice the longest it was trained on,",
            "",
            "| predictor | MSE | mean distance | final distance |",
            "|---|---:|---:|---:|",
            _errors_row("the origin, always", result.held_out_long["origin"]),
            _errors_row("straight line", result.held_out_long["straight_line"]),
            _errors_row("this model", result.held_out_long["model"], bold=True),
            "",
            "Integrating the turn and speed commands with the rule above is exact: the model "
            "is a learnt stand-in for it, a demonstration of a rollout that means something.",
            "",
            f"Loss curve (training: the step's batch; validation: a fixed batch of {args.batch} "
            f"sequences of {args.length} steps):",
            "",
            "| step | training MSE | validation MSE |",
            "|---:|---:|---:|",
            *curve_rows,
            "",
            f"Loaded back with `rnnserve.models.load`, it rolls out like the trained module to "
            f"{worst:.1e}. Serve it with `rnnserve --model-dir {args.out}`.",
            "",
        ]
    )


def write_numbers(
    path: Path, kind: str, curve: list[CurvePoint], figures: Mapping[str, object]
) -> None:
    """The card's numbers as JSON, for plots."""
    body = {
        "kind": kind,
        "curve": [vars(p) for p in curve],
        **figures,
    }
    path.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")


KIND_DEFAULTS: dict[str, dict[str, object]] = {
    "smoother": {"steps": 150, "batch": 32, "length": 256, "lr": 0.02},
    "traveller": {"steps": 2000, "batch": 32, "length": 64, "lr": 0.003},
}
ONLY_FOR = {
    "features": "smoother",
    "hidden": "traveller",
    "layers": "traveller",
    "held_out": "traveller",
}


PROG = "python -m rnnserve.models.train"  # ``rnnserve train`` runs main with its own name


def parse_args(argv: Sequence[str] | None, prog: str = PROG) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a model on synthetic data and write a folder rnnserve serves.",
    )
    parser.add_argument("kind", choices=sorted(KIND_DEFAULTS), help="the model to train")
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--name", help="the model's name (default: the kind)")
    parser.add_argument("--features", type=int, help="smoother: channels (default 16)")
    parser.add_argument("--hidden", type=int, help="traveller: LSTM width (default 128)")
    parser.add_argument("--layers", type=int, help="traveller: LSTM layers (default 2)")
    parser.add_argument("--held-out", type=int, help="traveller: held-out sequences (default 256)")
    parser.add_argument("--steps", type=int, help="training steps (smoother 150, traveller 2000)")
    parser.add_argument("--batch", type=int, help="sequences a step (default 32)")
    parser.add_argument("--length", type=int, help="longest sequence (smoother 256, traveller 64)")
    parser.add_argument(
        "--lr", type=float, help="Adam's step size (smoother 0.02, traveller 0.003)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    for flag, kind in ONLY_FOR.items():
        if getattr(args, flag) is not None and args.kind != kind:
            parser.error(f"--{flag.replace('_', '-')} applies to the {kind} only")
    defaults: dict[str, object] = {
        "name": args.kind,
        "features": 16,
        "hidden": 128,
        "layers": 2,
        "held_out": 256,
        **KIND_DEFAULTS[args.kind],
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for flag in ("features", "hidden", "layers", "held_out", "steps", "batch", "length"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error("--lr must be a positive number")
    if not _NAME.fullmatch(args.name):
        parser.error("--name: up to 128 letters, digits, '_', '.' or '-', a letter or digit first")
    if not 0 <= args.seed < 2**63:
        parser.error("--seed must be from 0 to 2**63 - 1")
    return args


def diverged(model: torch.nn.Module) -> str | None:
    """Why ``model`` must not be written (a weight that is NaN or infinite), or None."""
    for name, value in model.state_dict().items():
        if not torch.isfinite(value).all():
            return f"training diverged: {name} is not finite (NaN or infinity); lower --lr"
    return None


def main_smoother(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    result, channels = train_smoother(
        args.features, args.steps, args.batch, args.length, args.lr, args.seed, args.quiet
    )
    path = args.out / f"{args.name}.safetensors"
    why = diverged(result.model)
    if why is not None:
        print(f"{path} not written: {why}")
        return 1
    write_model(result.model, path)
    probe, _ = sequences(channels, [7, 1, 30], torch.Generator().manual_seed(args.seed + 1))
    worst = check_loaded(result.model, args.name, args.out, probe)
    if worst > 1e-6:
        print(f"{path}: loaded back, it differs from the trained model by {worst:.2e}")
        return 1
    card = args.out / f"{args.name}.md"
    card.write_text(model_card(args.name, result, channels, args, worst), encoding="utf-8")
    figures = {
        "validation": {
            "no_smoothing": result.raw_loss,
            "untrained": result.baseline_loss,
            "model": result.val_loss,
        }
    }
    write_numbers(args.out / f"{args.name}.json", "smoother", result.curve, figures)
    print(
        f"wrote {path} and {card}: validation MSE {result.val_loss:.5f} "
        f"(untrained {result.baseline_loss:.5f}, no smoothing {result.raw_loss:.5f})"
    )
    return 0


def main_traveller(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    # The step's GEMMs are a few hundred rows: one thread is fastest, and a second one spinning
    # against another process on a small machine slows training several times over.
    torch.set_num_threads(1)
    try:
        result = train_traveller(args)
    finally:
        torch.set_num_threads(threads)
    path = args.out / f"{args.name}.safetensors"
    why = diverged(result.model)
    if why is not None:
        print(f"{path} not written: {why}")
        return 1
    write_model(result.model, path)
    probe = commands(torch.Generator().manual_seed(args.seed + 1), [7, 1, 30])
    worst = check_loaded_traveller(result.model, args.name, args.out, probe)
    if worst > 1e-5:
        print(f"{path}: loaded back, it differs from the trained model by {worst:.2e}")
        return 1
    card = args.out / f"{args.name}.md"
    card.write_text(traveller_card(args.name, result, args, worst), encoding="utf-8")
    figures = {
        "length": args.length,
        "held_out": {k: vars(e) for k, e in result.held_out.items()},
        "untrained": vars(result.init["model"]),
        "held_out_twice_length": {k: vars(e) for k, e in result.held_out_long.items()},
    }
    write_numbers(args.out / f"{args.name}.json", "traveller", result.curve, figures)
    held = result.held_out
    print(
        f"wrote {path} and {card} in {_duration(result.seconds)}: held-out free-running MSE "
        f"{held['model'].mse:.5f} (untrained {result.init['model'].mse:.5f}, straight line "
        f"{held['straight_line'].mse:.5f}, origin {held['origin'].mse:.5f}); final-step "
        f"distance {held['model'].final_distance:.4f} (straight line "
        f"{held['straight_line'].final_distance:.4f})"
    )
    return 0


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    args = parse_args(argv, prog)
    try:  # before training, not after it
        models.writable_folder(args.out)
    except OSError as exc:
        print(f"{prog}: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.kind == "smoother":
        return main_smoother(args)
    return main_traveller(args)


if __name__ == "__main__":
    sys.exit(main())
