"""Train a model for rnnserve on synthetic data: ``python -m rnnserve.models.train smoother``.

``smoother``: multichannel denoising. Each of the ``--features`` channels is a clean AR(1) signal
``z_t = rho_c z_{t-1} + sqrt(1 - rho_c^2) e_t`` (unit variance; ``rho_c`` from fast to slow
across the channels) seen through Gaussian noise of its own level ``sigma_c`` (from faint to
strong, in another order, so the two do not line up); the target is ``tanh(z_t)``. The
smoother learns one ``alpha`` per channel: near 0 where the signal is fast and the noise faint,
near 1 where it is slow and the noise strong. Training runs the compiled CPU backward
(:func:`rnnserve.models.kernels.smoother_cpu.smooth_packed_numba`), a fresh packed batch of
random lengths each step, Adam, ``alpha`` kept in ``[0, ALPHA_MAX]`` after each step.

Writes ``<out>/<name>.safetensors`` (``models.save``: kind ``smoother``, its config, the
weights), loads it back as the server does and checks that it answers like the trained module,
and writes a model card ``<out>/<name>.md``. Serve the folder with ``rnnserve --model-dir OUT``.
Everything is drawn from ``--seed``: the same arguments give the same file.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from rnnserve import models
from rnnserve.models.packing import pack
from rnnserve.models.smoothing import LinearRecursion

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


@dataclass
class Result:
    model: LinearRecursion
    val_loss: float
    baseline_loss: float  # the untrained smoother (alpha 0.5, wx 1)
    raw_loss: float  # no smoothing: tanh(x)
    seconds: float


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
    start = time.perf_counter()
    for step in progress(steps, every):
        xs, ys = sequences(channels, random_lengths(gen, batch, length), gen)
        x, want = pack(xs), pack(ys).data
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).data, want)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.alpha_smooth.clamp_(0.0, ALPHA_MAX)
        if not quiet and (step + 1) % every == 0:
            print(
                f"step {step + 1}/{steps}: loss {loss.item():.5f}, "
                f"validation {val_loss(model, val_x, val_y):.5f}",
                file=sys.stderr,
                flush=True,
            )
    seconds = time.perf_counter() - start
    model.eval().requires_grad_(False)
    result = Result(model, val_loss(model, val_x, val_y), baseline, raw, seconds)
    return result, channels


def write_model(model: LinearRecursion, path: Path) -> None:
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
        f"python -m rnnserve.models.train smoother --out {args.out} --name {name} "
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rnnserve.models.train",
        description="Train a model on synthetic data and write a folder rnnserve serves.",
    )
    parser.add_argument("kind", choices=["smoother"], help="the model to train")
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--name", default="smoother", help="the model's name (default smoother)")
    parser.add_argument("--features", type=int, default=16, help="channels (default 16)")
    parser.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    parser.add_argument("--batch", type=int, default=32, help="sequences a step (default 32)")
    parser.add_argument("--length", type=int, default=256, help="longest sequence (default 256)")
    parser.add_argument("--lr", type=float, default=0.02, help="Adam's step size (default 0.02)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    for flag in ("features", "steps", "batch", "length"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error("--lr must be a positive number")
    if not _NAME.fullmatch(args.name):
        parser.error("--name: up to 128 letters, digits, '_', '.' or '-', a letter or digit first")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    result, channels = train_smoother(
        args.features, args.steps, args.batch, args.length, args.lr, args.seed, args.quiet
    )
    path = args.out / f"{args.name}.safetensors"
    write_model(result.model, path)
    probe, _ = sequences(channels, [7, 1, 30], torch.Generator().manual_seed(args.seed + 1))
    worst = check_loaded(result.model, args.name, args.out, probe)
    if worst > 1e-6:
        print(f"{path}: loaded back, it differs from the trained model by {worst:.2e}")
        return 1
    card = args.out / f"{args.name}.md"
    card.write_text(model_card(args.name, result, channels, args, worst), encoding="utf-8")
    print(
        f"wrote {path} and {card}: validation MSE {result.val_loss:.5f} "
        f"(untrained {result.baseline_loss:.5f}, no smoothing {result.raw_loss:.5f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
