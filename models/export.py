"""Export your own LSTM/GRU model for rnnserve: ``rnnserve export``.

Takes a model you trained in PyTorch (an ``nn.LSTM`` or ``nn.GRU`` stack followed by an
``nn.Linear`` head, and an output activation), writes ``<out-dir>/<name>.safetensors`` with kind
``recurrent`` and its config, loads that file back with :func:`models.load`, and checks that it
answers like your modules, sequence by sequence, on random packed inputs (to ``--tolerance``,
default 1e-5). Exit status 0 and one line on success; 2 and one line when the input cannot be
exported (wrong shapes, unknown tensors, an unsupported layer); 1 when the check fails. A file
that fails the check is never written to ``--out-dir``.

Two ways to give the model:

- ``--checkpoint ckpt.pt``: a ``state_dict`` saved with ``torch.save(model.state_dict(), ...)``
  (or a ``.safetensors`` file of it). It is read with ``torch.load(weights_only=True)``, which
  unpickles only tensors and plain containers and refuses any other object, so a checkpoint
  cannot run code while it is read; a whole pickled module (``torch.save(model)``) is refused.
  The RNN's tensors are found by their ``weight_ih_l0`` key whatever its prefix (``gru.``,
  ``lstm.``, ``encoder.rnn.``, ...), the head is the one other ``<prefix>.weight`` (``fc``,
  ``linear``, ``head``, ``dense``, ...); ``--rnn-key`` / ``--head-key`` pick them when there is
  more than one. The sizes come from the tensors; ``--cell``, ``--input-size``,
  ``--hidden-size``, ``--num-layers`` and ``--head-size``, when given, must agree with them.
- ``--factory package.module:callable``: imported and called with no arguments, it returns your
  ``nn.Module`` (with ``--checkpoint``, the weights are loaded into it first). Its RNN is the
  child named ``rnn``, ``gru``, ``lstm`` or ``encoder`` (or its only LSTM/GRU), its head the
  child named ``head``, ``fc``, ``linear``, ``dense``, ``out`` or ``output_layer`` (or its only
  Linear). The check runs your own submodules, in your own ``batch_first`` layout.

The activation is not in the weights, so ``--activation`` is required (none, tanh, sigmoid,
l2_normalize): a default would serve a tanh, sigmoid or L2 head without it, and the check, which
applies the same activation to both sides, would not notice.

Files are written world-readable (0644): the server's image runs as another user than the one
who exports. The command imports ``rnnserve.models``, never a top-level ``models``, so a user's
own ``models`` package in the working folder is not imported; ``--factory`` modules are looked
up from the working folder first, as ``python -m`` would.

``--torchscript`` instead exports any module with the packed-sequence signature of
:mod:`rnnserve.models.torchscript` (``forward(data [N, F_in], batch_sizes [T]) -> [N, F_out]``),
given with ``--factory`` (``--checkpoint`` loads its weights first) and ``--input-size`` (or the
module's own ``input_size`` attribute): it is scripted with ``torch.jit.script`` (a factory may
also return a ScriptModule), written as ``<out-dir>/<name>.torchscript.pt`` with its widths in
the archive's metadata, loaded back as the server loads it, and checked on a packed batch
against your original module called on each sequence alone. The file is code: serving it needs
``RNNSERVE_TRUST_TORCHSCRIPT=true``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rnnserve import models
from rnnserve.models import torchscript
from rnnserve.models.packing import pack, unpack
from rnnserve.models.recurrent import ACTIVATIONS, CELLS, RecurrentConfig, RecurrentModel, activate

RNN_NAMES = ("rnn", "gru", "lstm", "encoder")
HEAD_NAMES = ("head", "fc", "linear", "dense", "out", "output", "output_layer", "proj")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
PROG = "rnnserve export"
FILE_MODE = 0o644  # readable by the server, which runs as its own user (UID 10001 in the image)


class ExportError(ValueError):
    """The model cannot be exported as it is; the message (one line) says why."""


class CheckFailed(AssertionError):
    """The exported file does not answer like the original."""


@dataclass(frozen=True)
class Found:
    """The user's RNN and head, as modules (factory) or as tensors under their own keys."""

    rnn: nn.LSTM | nn.GRU
    head: nn.Linear
    batch_first: bool


# -- reading the user's model -------------------------------------------------------------------


def read_checkpoint(path: str | Path) -> dict[str, Tensor]:
    """A state_dict from ``torch.save`` (read with ``weights_only=True``) or safetensors."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:
            raise ExportError(f"{path}: not a safetensors file ({_line(exc)})") from exc
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ExportError(
            f"{path}: cannot be read as a state_dict with torch.load(weights_only=True) "
            f"({_unpickler_reason(exc)}); save model.state_dict(), not the model"
        ) from exc
    if isinstance(obj, dict):  # {"state_dict": {...}}, {"model": {...}}: a training checkpoint
        for key in ("state_dict", "model_state_dict", "model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj:
        raise ExportError(f"{path}: holds a {type(obj).__name__}, not a state_dict of tensors")
    bad = [str(k) for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        raise ExportError(f"{path}: entries that are not tensors: {', '.join(bad[:5])}")
    return {str(k): v for k, v in obj.items()}


def _unpickler_reason(exc: BaseException) -> str:
    """What torch.load(weights_only=True) refused: its "WeightsUnpickler error" sentence, which
    names the class a pickled module needs, rather than the advice torch puts first."""
    for line in str(exc).splitlines():
        _, marker, reason = line.partition("WeightsUnpickler error:")
        if marker:
            return _line(ValueError(reason.split(". ", 1)[0].strip().rstrip(".")))
    return _line(exc)


def find_in_module(
    module: nn.Module, rnn_key: str | None = None, head_key: str | None = None
) -> Found:
    """The RNN and the head of a user's module (see the module docstring for the names)."""
    rnn = _pick(module, (nn.LSTM, nn.GRU), rnn_key, RNN_NAMES, "nn.LSTM or nn.GRU")
    head = _pick(module, (nn.Linear,), head_key, HEAD_NAMES, "nn.Linear head")
    assert isinstance(rnn, nn.LSTM | nn.GRU)
    assert isinstance(head, nn.Linear)
    return Found(rnn, head, bool(rnn.batch_first))


def _pick(
    module: nn.Module,
    types: tuple[type[nn.Module], ...],
    key: str | None,
    names: Sequence[str],
    what: str,
) -> nn.Module:
    found = dict(module.named_modules())
    if key is not None:
        sub = found.get(key)
        if not isinstance(sub, types):
            raise ExportError(f"{type(module).__name__}.{key} is not an {what}")
        return sub
    for name in names:
        sub = found.get(name)
        if isinstance(sub, types):
            return sub
    matches = [n for n, m in found.items() if isinstance(m, types)]
    if len(matches) == 1:
        only: nn.Module = found[matches[0]]
        return only
    owner = type(module).__name__
    if not matches:
        raise ExportError(f"{owner} has no {what} (name it with --rnn-key / --head-key)")
    raise ExportError(
        f"{owner} has several {what}s ({', '.join(matches)}); pick one with --rnn-key / --head-key"
    )


def find_in_state_dict(
    tensors: dict[str, Tensor],
    config: dict[str, Any],
    rnn_key: str | None = None,
    head_key: str | None = None,
) -> tuple[Found, RecurrentConfig]:
    """Rebuild the user's RNN and head from their tensors; ``config`` flags must agree."""
    rnn_prefix = _prefix(tensors, "weight_ih_l0", rnn_key, RNN_NAMES, "LSTM/GRU")
    rnn_t = {k[len(rnn_prefix) :]: v for k, v in tensors.items() if k.startswith(rnn_prefix)}
    rest = {k: v for k, v in tensors.items() if not k.startswith(rnn_prefix)}
    head_prefix = _prefix(rest, "weight", head_key, HEAD_NAMES, "linear head", two_d=True)
    head_t = {k[len(head_prefix) :]: v for k, v in rest.items() if k.startswith(head_prefix)}
    unused = sorted(k for k in rest if not k.startswith(head_prefix))
    if unused:
        raise ExportError(
            f"tensors the recurrent kind has no place for: {', '.join(unused[:5])}; export only "
            "an LSTM/GRU stack and its linear head"
        )
    odd = sorted(k for k in rnn_t if "reverse" in k or k.startswith("weight_hr"))
    if odd:
        raise ExportError(
            f"{rnn_prefix}{odd[0]}: bidirectional RNNs and LSTM projections (proj_size) are not "
            "supported by the recurrent kind"
        )
    w_ih, w_hh = rnn_t["weight_ih_l0"], rnn_t.get("weight_hh_l0")
    if w_hh is None or w_ih.ndim != 2 or w_hh.ndim != 2:
        raise ExportError(f"{rnn_prefix}weight_ih_l0/weight_hh_l0: missing or not matrices")
    hidden = int(w_hh.shape[1])
    gates = int(w_ih.shape[0]) // max(hidden, 1)
    inferred = {
        "cell": {4: "lstm", 3: "gru"}.get(gates, f"{gates}-gate"),
        "input_size": int(w_ih.shape[1]),
        "hidden_size": hidden,
        "num_layers": sum(1 for k in rnn_t if re.fullmatch(r"weight_ih_l\d+", k)),
        "head_size": int(head_t["weight"].shape[0]),
        "bias": "bias_ih_l0" in rnn_t,
        "head_bias": "bias" in head_t,
    }
    given = {k: v for k, v in config.items() if v is not None}
    try:
        cfg = RecurrentConfig(**{**inferred, **given})
    except (TypeError, ValueError) as exc:
        raise ExportError(f"config {given}: {_line(exc)}") from exc
    # the user's own layers, built from the config and loaded with their tensors
    rnn: nn.LSTM | nn.GRU = (nn.LSTM if cfg.cell == "lstm" else nn.GRU)(
        cfg.input_size, cfg.hidden_size, cfg.num_layers, bias=cfg.bias
    )
    head = nn.Linear(cfg.hidden_size, cfg.head_size, bias=cfg.head_bias)
    for prefix, layer, own in ((rnn_prefix, rnn, rnn_t), (head_prefix, head, head_t)):
        try:
            layer.load_state_dict(own, strict=True)
        except RuntimeError as exc:
            raise ExportError(_misfit(cfg, exc, prefix)) from exc
    return Found(rnn, head, False), cfg


def _prefix(
    tensors: dict[str, Tensor],
    suffix: str,
    key: str | None,
    names: Sequence[str],
    what: str,
    two_d: bool = False,
) -> str:
    if key is not None:
        prefix = f"{key}." if key else ""
        if f"{prefix}{suffix}" not in tensors:
            raise ExportError(f"no tensor {prefix}{suffix} for the {what} (--rnn-key / --head-key)")
        return prefix
    prefixes = [
        k[: -len(suffix)]
        for k, v in tensors.items()
        if k.endswith(suffix) and (k == suffix or k[: -len(suffix)].endswith("."))
        if not two_d or v.ndim == 2
    ]
    if len(prefixes) > 1:
        named = [p for p in prefixes if p.rstrip(".").rsplit(".", 1)[-1] in names]
        prefixes = named if len(named) == 1 else prefixes
    if len(prefixes) == 1:
        return prefixes[0]
    if not prefixes:
        raise ExportError(
            f"the checkpoint has no {what} (no <prefix>.{suffix} tensor); name it with "
            "--rnn-key / --head-key"
        )
    shown = ", ".join(p.rstrip(".") for p in prefixes)
    raise ExportError(
        f"the checkpoint has several {what}s ({shown}); pick one with --rnn-key / --head-key"
    )


def config_of(found: Found, activation: str, given: dict[str, Any]) -> RecurrentConfig:
    """The config of a user's modules; ``given`` flags must agree with them."""
    rnn, head = found.rnn, found.head
    if rnn.bidirectional or int(getattr(rnn, "proj_size", 0)):
        raise ExportError(
            f"{type(rnn).__name__}: bidirectional RNNs and LSTM projections (proj_size) are not "
            "supported by the recurrent kind"
        )
    if head.in_features != rnn.hidden_size:
        raise ExportError(
            f"the head takes {head.in_features} features; the RNN gives {rnn.hidden_size}"
        )
    actual = {
        "cell": "lstm" if isinstance(rnn, nn.LSTM) else "gru",
        "input_size": rnn.input_size,
        "hidden_size": rnn.hidden_size,
        "num_layers": rnn.num_layers,
        "head_size": head.out_features,
        "bias": bool(rnn.bias),
        "head_bias": head.bias is not None,
    }
    for key, value in given.items():
        if value is not None and key in actual and actual[key] != value:
            raise ExportError(f"--{key.replace('_', '-')} {value}: the model's is {actual[key]}")
    return RecurrentConfig(**actual, activation=activation)  # type: ignore[arg-type]


def _misfit(cfg: RecurrentConfig, exc: BaseException, prefix: str = "") -> str:
    lines = [ln.strip() for ln in str(exc).splitlines()[1:] if ln.strip()]
    detail = lines[0] if lines else _line(exc)
    if prefix:
        detail = detail.replace('"', "").replace("for ", f"for {prefix}", 1)
    cell = "an LSTM" if cfg.cell == "lstm" else "a GRU"
    return f"the tensors do not fit {cell} with {_summary(cfg)}: {detail}"


def _summary(cfg: RecurrentConfig) -> str:
    return (
        f"input size {cfg.input_size}, hidden size {cfg.hidden_size}, {cfg.num_layers} "
        f"layer(s), head size {cfg.head_size}"
    )


# -- exporting and checking ---------------------------------------------------------------------


def to_recurrent(found: Found, cfg: RecurrentConfig) -> RecurrentModel:
    """A :class:`RecurrentModel` holding copies of the user's weights."""
    model = RecurrentModel(cfg)
    tensors = {f"rnn.{k}": v for k, v in found.rnn.state_dict().items()}
    tensors.update({f"head.{k}": v for k, v in found.head.state_dict().items()})
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise ExportError(_misfit(cfg, exc)) from exc
    return model.eval().requires_grad_(False)


def reference(found: Found, activation: str, x: Tensor) -> Tensor:
    """The user's own layers on one sequence ``x`` ``[T, input_size]`` -> ``[T, head_size]``."""
    batch = x.unsqueeze(0 if found.batch_first else 1)  # [1, T, F] or [T, 1, F]
    hidden, _ = found.rnn(batch)
    y = found.head(hidden.squeeze(0 if found.batch_first else 1))
    return activate(y, activation)


def check(
    model: nn.Module,
    expected: Callable[[Tensor], Tensor],
    input_size: int,
    tolerance: float = 1e-5,
    lengths: Sequence[int] = (7, 1, 12, 3, 3, 20),
    seed: int = 0,
) -> float:
    """Max |difference| between ``model`` on one packed batch and ``expected`` per sequence."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, input_size, generator=gen) for n in lengths]
    with torch.inference_mode():
        got = unpack(model(pack(xs)))
        want = [expected(x) for x in xs]
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape:
            raise CheckFailed(f"sequence {i}: output shape {list(g.shape)}, yours {list(w.shape)}")
        diff = float((g - w).abs().max())
        if not diff <= tolerance:  # NaN fails too
            raise CheckFailed(
                f"sequence {i} (length {lengths[i]}): the exported model differs from yours by "
                f"{diff:.3g} (tolerance {tolerance:g})"
            )
        worst = max(worst, diff)
    return worst


def export(
    found: Found,
    cfg: RecurrentConfig,
    name: str,
    out_dir: str | Path,
    tolerance: float = 1e-5,
) -> tuple[Path, float]:
    """Write ``<out_dir>/<name>.safetensors``, load it back with :func:`models.load` and check
    it against the user's layers; the path and the largest difference seen."""
    if not _NAME.fullmatch(name) or name.endswith(models.PICKLE_SUFFIXES):
        raise ExportError(f"--name {name!r}: use letters, digits, '_', '-' and '.'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = to_recurrent(found, cfg)
    found.rnn.eval()
    found.head.eval()
    with tempfile.TemporaryDirectory(dir=out) as tmp:  # checked before it is put in place
        models.save(model, Path(tmp) / f"{name}.safetensors")
        loaded = models.load(name, tmp)
        worst = check(
            loaded, lambda x: reference(found, cfg.activation, x), cfg.input_size, tolerance
        )
        target = out / f"{name}.safetensors"
        _put_in_place(Path(tmp) / f"{name}.safetensors", target)
    return target, worst


def _put_in_place(written: Path, target: Path) -> None:
    # safetensors and tempfile write 0600: the server, another user, could not read the file
    written.chmod(FILE_MODE)
    written.replace(target)


def one_sequence(module: nn.Module, x: Tensor) -> Tensor:
    """``module`` (packed-sequence signature) on one sequence ``x`` ``[T, F_in]`` alone: packed,
    a sequence of one is its own rows, one per step."""
    return module(x, torch.ones(len(x), dtype=torch.int64))  # type: ignore[no-any-return]


def export_torchscript(
    user: nn.Module,
    input_size: int,
    name: str,
    out_dir: str | Path,
    tolerance: float = 1e-5,
) -> tuple[Path, int, float]:
    """Script ``user`` (unless it is already scripted), write ``<out_dir>/<name>.torchscript.pt``,
    load it back as the server does and check it against ``user`` sequence by sequence; the
    path, the output width and the largest difference seen."""
    if not _NAME.fullmatch(name) or name.endswith(models.PICKLE_SUFFIXES):
        raise ExportError(f"--name {name!r}: use letters, digits, '_', '-' and '.'")
    user.eval()
    if isinstance(user, torch.jit.ScriptModule):
        scripted = user
    else:
        params = [
            p
            for p in inspect.signature(user.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(params) != 2:
            shown = ", ".join(p.name for p in params)
            raise ExportError(
                f"{type(user).__name__}.forward takes ({shown}); rnnserve calls "
                f"{torchscript.SIGNATURE}"
            )
        try:
            scripted = torch.jit.script(user)
        except Exception as exc:  # torch.jit.frontend errors and RuntimeErrors
            raise ExportError(
                f"{type(user).__name__} cannot be scripted with torch.jit.script: "
                f"{script_error(exc)}"
            ) from exc
    try:
        output_size = _output_width(scripted, input_size)
    except torchscript.TorchScriptError as exc:
        raise ExportError(str(exc)) from exc
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:  # checked before it is put in place
        written = Path(tmp) / f"{name}{torchscript.SUFFIX}"
        torchscript.save(scripted, written, input_size, output_size)
        try:
            loaded = models.load(name, tmp, trust_torchscript=True)
        except models.ModelLoadError as exc:
            raise ExportError(str(exc).removeprefix(f"{written}: ")) from exc
        try:
            worst = check(loaded, lambda x: one_sequence(user, x), input_size, tolerance)
        except CheckFailed:
            raise
        except Exception as exc:  # the module failed on a batch of several sequences
            raise ExportError(
                f"the exported module failed on a packed batch ({torchscript.first_line(exc)}); "
                f"rnnserve calls {torchscript.SIGNATURE}"
            ) from exc
        target = out / f"{name}{torchscript.SUFFIX}"
        _put_in_place(written, target)
    return target, output_size, worst


def script_error(exc: BaseException) -> str:
    """A TorchScript compile error in one line: what, and the line of code it is about."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    what = lines[0].strip() if lines else type(exc).__name__
    where = ""
    for i, ln in enumerate(lines):
        found = re.match(r'\s*File "([^"]+)", line (\d+)', ln)
        if found:
            where = f"{Path(found[1]).name}, line {found[2]}"
        if "<--- HERE" in ln and i > 0:
            where += f": {lines[i - 1].strip()}"
    return torchscript.clip(f"{what} ({where})" if where else what)


def _output_width(module: nn.Module, input_size: int) -> int:
    problem = torchscript.signature_problem(module)
    if problem is not None:
        raise torchscript.TorchScriptError(f"{problem}; rnnserve calls {torchscript.SIGNATURE}")
    try:
        with torch.inference_mode():
            y = one_sequence(module, torch.zeros(2, input_size))
    except Exception as exc:
        raise torchscript.TorchScriptError(
            f"a call on one sequence of 2 steps of {input_size} features failed "
            f"({torchscript.first_line(exc)}); rnnserve calls {torchscript.SIGNATURE}"
        ) from exc
    if not isinstance(y, Tensor) or y.ndim != 2 or y.shape[0] != 2:
        got = list(y.shape) if isinstance(y, Tensor) else type(y).__name__
        raise torchscript.TorchScriptError(
            f"a call on 2 rows answered {got}; rnnserve calls {torchscript.SIGNATURE}"
        )
    return int(y.shape[1])


def _factory(path: str) -> nn.Module:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ExportError(f"--factory {path!r}: write it as package.module:callable")
    _search_the_working_folder()
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        made = obj if isinstance(obj, nn.Module) else obj()
    except (ImportError, AttributeError) as exc:
        raise ExportError(f"--factory {path}: {_line(exc)}") from exc
    except Exception as exc:  # the user's module or factory raised (a SyntaxError too)
        raise ExportError(f"--factory {path} raised {type(exc).__name__}: {_line(exc)}") from exc
    if not isinstance(made, nn.Module):
        raise ExportError(f"--factory {path}: returned a {type(made).__name__}, not an nn.Module")
    return made


def _search_the_working_folder() -> None:
    # the console script's sys.path starts at its own bin folder, not where the user runs it
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def _line(exc: BaseException) -> str:
    return torchscript.clip(str(exc)) or type(exc).__name__


def _refuse(where: object, exc: BaseException) -> int:
    """Print an export refusal as one line, naming ``where`` once; exit status 2."""
    message = torchscript.clip(str(exc), limit=1000)  # its parts are clipped already
    subject = str(where)
    if subject not in message:  # most messages name their file or module already
        message = f"{subject}: {message}"
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def _check_failed(exc: BaseException) -> int:
    print(f"{PROG}: check failed: {torchscript.clip(str(exc))}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Export your own LSTM/GRU + linear head model as <out-dir>/<name>.safetensors "
        "(kind recurrent) and check that it answers like yours.",
    )
    p.add_argument("--name", required=True, help="the model's name (the file's stem)")
    p.add_argument("--out-dir", required=True, type=Path, help="the model directory to write to")
    p.add_argument("--checkpoint", type=Path, help="a state_dict (torch.save or .safetensors)")
    p.add_argument("--factory", help="package.module:callable returning your nn.Module")
    p.add_argument("--cell", choices=CELLS)
    p.add_argument("--input-size", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--head-size", type=int)
    p.add_argument(
        "--activation",
        choices=ACTIVATIONS,
        help="the output activation after the head (not in the weights; required unless "
        "--torchscript)",
    )
    p.add_argument("--rnn-key", help="the RNN's name in your module or checkpoint (e.g. gru)")
    p.add_argument("--head-key", help="the head's name in your module or checkpoint (e.g. fc)")
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument(
        "--torchscript",
        action="store_true",
        help="export --factory's module (signature forward(data [N, F_in], batch_sizes [T]) -> "
        "[N, F_out]) as <name>.torchscript.pt; code: serving it needs "
        "RNNSERVE_TRUST_TORCHSCRIPT=true",
    )
    args = p.parse_args(argv)
    if args.checkpoint is None and args.factory is None:
        p.error("give --checkpoint, --factory, or both")
    if args.torchscript:
        if args.factory is None:
            p.error("--torchscript needs --factory (and --checkpoint to load its weights)")
        if args.activation is not None:
            p.error("--activation is for the recurrent kind; a TorchScript module applies its own")
        _writable_out_dir(p, args.out_dir)
        return _main_torchscript(args)
    if args.activation is None:
        p.error(
            "--activation is required (the weights do not hold it): one of "
            + ", ".join(ACTIVATIONS)
        )
    _writable_out_dir(p, args.out_dir)
    given = {
        "cell": args.cell,
        "input_size": args.input_size,
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "head_size": args.head_size,
    }
    where = args.checkpoint or args.factory
    try:
        if args.factory is not None:
            user = _user_module(args)
            found = find_in_module(user, args.rnn_key, args.head_key)
            cfg = config_of(found, args.activation, given)
        else:
            tensors = read_checkpoint(args.checkpoint)
            found, cfg = find_in_state_dict(tensors, given, args.rnn_key, args.head_key)
            cfg = replace(cfg, activation=args.activation)
        path, worst = export(found, cfg, args.name, args.out_dir, args.tolerance)
    except ExportError as exc:
        return _refuse(where, exc)
    except CheckFailed as exc:
        return _check_failed(exc)
    print(
        f"wrote {path} (recurrent: {cfg.cell}, {_summary(cfg)}, activation {cfg.activation}); "
        f"answers like yours to {worst:.2g} (tolerance {args.tolerance:g})"
    )
    return 0


def _writable_out_dir(parser: argparse.ArgumentParser, out_dir: Path) -> None:
    """Make ``out_dir`` and write in it, before anything is loaded or checked; a usage error
    (one line, exit 2) if it cannot be."""
    try:
        models.writable_folder(out_dir)
    except OSError as exc:
        parser.error(f"--out-dir {out_dir}: {exc.strerror or exc}")


def _user_module(args: argparse.Namespace) -> nn.Module:
    """The module ``--factory`` builds, with ``--checkpoint``'s weights loaded strictly if given."""
    user = _factory(args.factory)
    if args.checkpoint is not None:
        try:
            user.load_state_dict(read_checkpoint(args.checkpoint), strict=True)
        except RuntimeError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines()[1:] if ln.strip()]
            raise ExportError(f"does not fit {args.factory}: {lines[0]}") from exc
    return user


def _main_torchscript(args: argparse.Namespace) -> int:
    try:
        user = _user_module(args)
        input_size = args.input_size or getattr(user, "input_size", None)
        if isinstance(input_size, bool) or not isinstance(input_size, int) or input_size < 1:
            raise ExportError(
                "--input-size is needed: the number of features per step (F_in) your module "
                "takes (or give the module an int attribute input_size)"
            )
        path, width, worst = export_torchscript(
            user, input_size, args.name, args.out_dir, args.tolerance
        )
    except ExportError as exc:
        return _refuse(args.factory, exc)
    except CheckFailed as exc:
        return _check_failed(exc)
    print(
        f"wrote {path} (torchscript: input size {input_size}, output size {width}); answers like "
        f"yours to {worst:.2g} (tolerance {args.tolerance:g}); it is code: serve it with "
        "RNNSERVE_TRUST_TORCHSCRIPT=true"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
