"""PyTorch models served by rnnserve, their weights, and the loader.

A model directory holds one ``<name>.safetensors`` file per model. The file's metadata names the
model's ``kind`` (``smoother``, ``traveller`` or ``recurrent``: your own LSTM/GRU stack with a
linear head, see :mod:`rnnserve.models.recurrent` and ``rnnserve export``) and its
constructor ``config`` as JSON; the tensors are the module's ``state_dict`` (:func:`save` writes
such a file; ``rnnserve export`` writes one from your own checkpoint). The default models ship
inside this package (``models/weights``).

A model directory may also hold ``<name>.torchscript.pt`` files (kind ``torchscript``, see
:mod:`rnnserve.models.torchscript`): TorchScript archives are code, so they are loaded only when the
caller trusts them (``trust_torchscript=True``); otherwise reading one raises
:class:`ModelLoadError` without opening it. Pickles (``.pt``, ``.pth``, ...) are never loaded.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from rnnserve.models import torchscript
from rnnserve.models.recurrent import RecurrentConfig, RecurrentModel
from rnnserve.models.smoothing import LinearRecursion, SmootherConfig
from rnnserve.models.torchscript import TorchScriptModel
from rnnserve.models.traveller import Traveller, TravellerConfig
from rnnserve.options import GemmRoutes, RolloutBackend

__all__ = [
    "DEFAULT_MODEL_DIR",
    "KINDS",
    "LinearRecursion",
    "ModelLoadError",
    "ModelNotFound",
    "RecurrentModel",
    "TorchScriptModel",
    "Traveller",
    "available",
    "build",
    "describe",
    "load",
    "pickles",
    "read",
    "save",
    "torchscript_files",
]

DEFAULT_MODEL_DIR = Path(__file__).parent / "weights"
KINDS = ("smoother", "traveller", "recurrent")  # safetensors kinds; also "torchscript" files


class ModelNotFound(LookupError):
    """No weights file for the requested model name."""


class ModelLoadError(ValueError):
    """A weights file that cannot be served; the message names the file and what to do."""


# Files that hold pickles: loading one can run arbitrary code, so rnnserve refuses them by name.
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt")


def pickles(model_dir: str | Path | None = None) -> list[Path]:
    """Pickle-format weight files in ``model_dir`` (they are refused, never loaded).

    ``<name>.torchscript.pt`` files are not counted here: see :func:`torchscript_files`."""
    root = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.suffix in PICKLE_SUFFIXES and not torchscript.is_torchscript(p)
    )


def torchscript_files(model_dir: str | Path | None = None) -> list[Path]:
    """``<name>.torchscript.pt`` files in ``model_dir``: code, served only when trusted."""
    root = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if torchscript.is_torchscript(p))


def build(kind: str, config: dict[str, Any]) -> nn.Module:
    """A freshly initialised model of ``kind`` from its constructor arguments."""
    if kind == "smoother":
        return LinearRecursion(**asdict(SmootherConfig(**config)))
    if kind == "traveller":
        return Traveller(**asdict(TravellerConfig(**config)))
    if kind == "recurrent":
        return RecurrentModel(RecurrentConfig(**config))
    raise ValueError(f"unknown model kind {kind!r}; known kinds: {', '.join(KINDS)}")


def kind_of(model: nn.Module) -> str:
    if isinstance(model, LinearRecursion):
        return "smoother"
    if isinstance(model, Traveller):
        return "traveller"
    if isinstance(model, RecurrentModel):
        return "recurrent"
    if isinstance(model, TorchScriptModel):
        return "torchscript"
    raise TypeError(f"not an rnnserve model: {type(model).__name__}")


def _config(model: nn.Module) -> dict[str, Any]:
    """Constructor arguments that rebuild ``model``'s architecture."""
    if isinstance(model, LinearRecursion):
        config = asdict(model.config)
        config.pop("alpha_smooth")  # an initial value only; the weights carry alpha
        return config
    if isinstance(model, Traveller | RecurrentModel):
        return asdict(model.config)
    if isinstance(model, TorchScriptModel):
        return model.config()
    raise TypeError(f"not an rnnserve model: {type(model).__name__}")


def save(model: nn.Module, path: str | Path) -> None:
    """Write ``model``'s weights, kind and config to a safetensors file."""
    if isinstance(model, TorchScriptModel):
        raise TypeError(
            "a TorchScript model is code, not a safetensors file: write it with "
            "rnnserve export --torchscript (rnnserve.models.torchscript.save)"
        )
    config = _config(model)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    meta = {"kind": kind_of(model), "config": json.dumps(config)}
    save_file(tensors, str(path), metadata=meta)


def writable_folder(path: Path) -> None:
    """Make ``path`` (and its parents) and write a file in it, so that a command that writes
    a model there fails before its work, not after; raises ``OSError``."""
    path.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=path).close()


def available(model_dir: str | Path | None = None) -> list[str]:
    """Names of the models in ``model_dir`` (default: the weights shipped with rnnserve)."""
    root = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    names = {p.stem for p in root.glob("*.safetensors")}
    names |= {torchscript.name_of(p) for p in torchscript_files(root)}
    return sorted(names)


def _torchscript_path(root: Path, name: str) -> Path | None:
    """The model's ``<name>.torchscript.pt``, if that is its file (one file per name)."""
    ts = root / f"{name}{torchscript.SUFFIX}"
    if not ts.is_file():
        return None
    if (root / f"{name}.safetensors").is_file():
        raise ModelLoadError(
            f"{ts}: model {name!r} has two files ({name}.safetensors and {ts.name}); keep one"
        )
    return ts


def _read_torchscript(path: Path, trust: bool, device: torch.device | str) -> TorchScriptModel:
    if not trust:
        raise ModelLoadError(
            f"{path}: a TorchScript file is code that runs when it is loaded; refused unless "
            "trusted (trust_torchscript)"
        )
    try:
        return torchscript.load(path, device)
    except torchscript.TorchScriptError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def read(
    name: str, model_dir: str | Path | None = None, *, trust_torchscript: bool = False
) -> nn.Module:
    """The named model with its weights, in eval mode on the CPU, not compiled.

    Every way a file can fail to be a servable model raises :class:`ModelLoadError` (or
    :class:`ModelNotFound`) with a one-line message naming the file. A ``<name>.torchscript.pt``
    file is loaded (its code runs) only with ``trust_torchscript``.
    """
    root = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    ts = _torchscript_path(root, name)
    if ts is not None:
        return _read_torchscript(ts, trust_torchscript, "cpu")
    path = root / f"{name}.safetensors"
    if not path.is_file():
        known = ", ".join(available(root)) or "none"
        raise ModelNotFound(f"no model {name!r} in {root} (available: {known})")
    try:
        # safetensors reports every failure to open as "No such file or directory"; opening
        # the file here first gives the real reason (a permission the server's user lacks)
        with open(path, "rb"):
            pass
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read the file: {_os_reason(exc)}") from exc
    except Exception as exc:  # safetensors raises its own error type for bad headers
        raise ModelLoadError(
            f"{path}: not a valid safetensors file ({_first_line(exc)}); {_NOT_A_MODEL}"
        ) from exc
    if "kind" not in meta or "config" not in meta:
        raise ModelLoadError(f"{path}: no rnnserve metadata (kind, config); {_NOT_A_MODEL}")
    try:
        config = json.loads(meta["config"])
        if not isinstance(config, dict):
            raise TypeError("config is not a JSON object")
        model = build(meta["kind"], config)
    except (ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: torch refuses a size
        raise ModelLoadError(
            f"{path}: bad metadata (kind {meta['kind']!r}, config {meta['config']!r}): "
            f"{_first_line(exc)}"
        ) from exc
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split("\n", 2)[1:]).strip() or _first_line(exc)
        raise ModelLoadError(
            f"{path}: the tensors do not fit a {meta['kind']} with config {meta['config']}: "
            f"{' '.join(detail.split())}"
        ) from exc
    model.eval().requires_grad_(False)
    return model


def load(
    name: str,
    model_dir: str | Path | None = None,
    *,
    device: torch.device | str = "cpu",
    rollout_backend: RolloutBackend = "auto",
    rollout_gemm_routes: GemmRoutes = "measured",
    trust_torchscript: bool = False,
) -> nn.Module:
    """The named model with its weights, in eval mode on ``device``.

    Traveller models get their rollout compiled (``rollout_backend``, ``rollout_gemm_routes``:
    see :meth:`Traveller.compile_rollout`) here, at load time;
    TorchScript files (only with ``trust_torchscript``) are loaded straight onto ``device``.
    """
    root = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    ts = _torchscript_path(root, name)
    if ts is not None:
        return _read_torchscript(ts, trust_torchscript, device)
    model = read(name, model_dir)
    model.to(device)
    if isinstance(model, Traveller):
        model.compile_rollout(rollout_backend, rollout_gemm_routes)
    return model


# what to do about a .safetensors file in a model directory that is not an rnnserve model
_NOT_A_MODEL = (
    "write your model with rnnserve export (or rnnserve.models.save), or move this file out of "
    "the model directory"
)


def _os_reason(exc: OSError) -> str:
    if isinstance(exc, PermissionError):
        return (
            "permission denied (the server's user cannot read it: make it readable, e.g. chmod 644)"
        )
    return (exc.strerror or str(exc)).lower()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe(model: nn.Module) -> dict[str, Any]:
    """Kind, config, tensor shapes and parameter count, as ``GET /models`` shows them."""
    kind = kind_of(model)
    config = _config(model)
    if isinstance(model, LinearRecursion):
        shapes = {"input": ["T", model.feat_dim], "output": ["T", model.feat_dim]}
    elif isinstance(model, RecurrentModel | TorchScriptModel):
        shapes = {"input": ["T", model.input_size], "output": ["T", model.head_size]}
    else:
        assert isinstance(model, Traveller)
        shapes = {"input": ["T", model.num_inputs], "output": ["T", 2]}
        config["rollout_backend"] = model.rollout_backend
        if model.rollout_routes is not None:
            config["rollout_routes"] = model.rollout_routes
    # a TorchScript module may hold no parameters at all (only buffers or constants)
    first = next(iter([*model.parameters(), *model.buffers()]), torch.empty(0))
    return {
        "kind": kind,
        "config": config,
        "shapes": shapes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(first.device),
        "dtype": str(first.dtype).removeprefix("torch."),
    }
