"""Your own TorchScript model (kind ``torchscript``): any scripted module with the packed-sequence
signature, served on the packed path.

**A TorchScript file is code.** ``torch.jit.load`` runs the archive's code (``__setstate__`` at
load time, ``forward`` on every batch) in the server process, with the server's rights; PyTorch's
security policy treats TorchScript models as executable code. rnnserve therefore loads one only
when the operator says the files are trusted (``trust=True`` here; the server's
``RNNSERVE_TRUST_TORCHSCRIPT=true``), and otherwise refuses it without opening it, like a pickle.

The file is ``<name>.torchscript.pt`` (what ``torch.jit.save`` writes; the double suffix tells it
from a pickle ``.pt``, which is always refused). The stated signature::

    forward(data: Tensor, batch_sizes: Tensor) -> Tensor

- ``data`` ``[N, F_in]`` float32 on the serving device: the rows of a ``PackedSequence`` of the
  batch's sequences, sorted packing (time-major; at step ``t`` the ``batch_sizes[t]`` sequences
  still running, longest first);
- ``batch_sizes`` ``[T]`` int64 on the CPU (as in every ``PackedSequence``), ``T`` the longest
  length;
- the result ``[N, F_out]`` (float32, or any float dtype: it is cast), one row per input row, in
  the same packed order. A scripted ``nn.GRU``/``nn.LSTM`` takes
  ``PackedSequence(data, batch_sizes, None, None)`` as it is.

Rows of different sequences must not mix (each output row depends only on its own sequence's
rows up to that step): the server batches many clients' sequences together. ``python -m
rnnserve.models.export --torchscript`` checks this by comparing the exported file on a packed batch
with the original module called on each sequence alone.

``F_in`` comes from the archive's metadata (``extra/rnnserve.json``, written by
``rnnserve export --torchscript``: ``{"input_size": F_in, "output_size": F_out}``)
or a sidecar ``<name>.torchscript.json`` holding the same; ``F_out`` is also found by a probe call
at load time, which must agree with it when it is given. A module whose ``forward`` does not take
two tensors, or whose answer to the probe is not ``[N, F_out]``, is refused at load time.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

SUFFIX = ".torchscript.pt"
SIDECAR = ".torchscript.json"
META = "rnnserve.json"  # the archive's extra file (torch.jit.save(_extra_files=...))
SIGNATURE = (
    "forward(data: Tensor [N, F_in] float32, batch_sizes: Tensor [T] int64 on the CPU) "
    "-> Tensor [N, F_out]"
)
PROBE_LENGTHS = (3, 1, 2)  # the probe call's packed batch: three sequences, sorted packing


class TorchScriptError(ValueError):
    """A TorchScript file that cannot be served; the message (one line) says why."""


def is_torchscript(path: Path) -> bool:
    """``<name>.torchscript.pt``."""
    return path.name.endswith(SUFFIX) and len(path.name) > len(SUFFIX)


def name_of(path: Path) -> str:
    return path.name[: -len(SUFFIX)]


def looks_like_archive(path: Path) -> bool:
    """A zip holding TorchScript code (read as a zip only; nothing in it runs)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any("/code/" in n for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def read_meta(path: Path) -> dict[str, Any]:
    """The archive's ``extra/rnnserve.json``, else the sidecar ``<name>.torchscript.json``, else
    ``{}``. Read as a zip and JSON: no code runs."""
    text: str | None = None
    try:
        with zipfile.ZipFile(path) as z:
            for n in z.namelist():
                if n.endswith(f"/extra/{META}"):
                    text = z.read(n).decode()
                    break
    except zipfile.BadZipFile:
        raise TorchScriptError("not a TorchScript archive (not a zip file)") from None
    except OSError as exc:
        raise TorchScriptError(f"cannot read the file: {exc.strerror or exc}") from exc
    where = f"its {META}"
    if text is None:
        sidecar = path.with_name(name_of(path) + SIDECAR)
        if not sidecar.is_file():
            return {}
        text, where = sidecar.read_text(), str(sidecar)
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise TorchScriptError(f"{where} is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise TorchScriptError(f"{where} is not a JSON object")
    for key in ("input_size", "output_size"):
        value = meta.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise TorchScriptError(f"{where}: {key} must be a positive integer, not {value!r}")
    return meta


class TorchScriptModel(nn.Module):
    """A loaded TorchScript module behind the packed interface of the other kinds:
    ``PackedSequence`` ``[N, input_size]`` in, ``PackedSequence`` ``[N, output_size]`` out."""

    def __init__(self, module: torch.jit.ScriptModule, input_size: int, output_size: int) -> None:
        super().__init__()
        self.module = module
        self.input_size = input_size
        self.output_size = output_size

    @property
    def head_size(self) -> int:
        return self.output_size

    def config(self) -> dict[str, Any]:
        return {"input_size": self.input_size, "output_size": self.output_size}

    def forward(self, x: PackedSequence) -> PackedSequence:
        y = self.module(x.data, x.batch_sizes)
        if not isinstance(y, Tensor) or y.shape != (x.data.shape[0], self.output_size):
            got = list(y.shape) if isinstance(y, Tensor) else type(y).__name__
            raise TypeError(
                f"the TorchScript module answered {got} for {x.data.shape[0]} rows; "
                f"expected [{x.data.shape[0]}, {self.output_size}]"
            )
        if y.dtype != torch.float32:
            y = y.float()
        return PackedSequence(y, x.batch_sizes, x.sorted_indices, x.unsorted_indices)


def signature_problem(module: nn.Module) -> str | None:
    forward: Any = getattr(module, "forward", None)
    try:
        schema = forward.schema
    except (AttributeError, RuntimeError):
        return "it has no scripted forward"
    args = [a for a in schema.arguments if a.name != "self"]
    shown = ", ".join(f"{a.name}: {a.type}" for a in args)
    returns = ", ".join(str(r.type) for r in schema.returns)
    if len(args) != 2 or any(str(a.type) != "Tensor" for a in args) or returns != "Tensor":
        return f"its forward is ({shown}) -> {returns}"
    return None


def load(path: Path, device: torch.device | str = "cpu") -> TorchScriptModel:
    """Load (this runs the file's code: only for trusted files), check the signature with a
    probe call, and wrap. Raises :class:`TorchScriptError` with one line."""
    meta = read_meta(path)
    input_size = meta.get("input_size")
    if input_size is None:
        raise TorchScriptError(
            f"no input width: write the file with rnnserve export --torchscript, or put "
            f'{{"input_size": F_in}} in {path.with_name(name_of(path) + SIDECAR)}'
        )
    try:
        module = torch.jit.load(str(path), map_location=torch.device(device))
    except Exception as exc:  # torch raises RuntimeError or its own errors for bad archives
        raise TorchScriptError(f"torch.jit.load failed: {first_line(exc)}") from exc
    problem = signature_problem(module)
    if problem is not None:
        raise TorchScriptError(f"{problem}; rnnserve calls {SIGNATURE}")
    module.eval()
    gen = torch.Generator().manual_seed(0)
    n = sum(PROBE_LENGTHS)
    data = torch.randn(n, int(input_size), generator=gen).to(device)
    batch_sizes = torch.tensor(
        [sum(1 for k in PROBE_LENGTHS if k > t) for t in range(max(PROBE_LENGTHS))]
    )
    try:
        with torch.inference_mode():
            y = module(data, batch_sizes)
    except Exception as exc:
        raise TorchScriptError(
            f"the probe call failed ({first_line(exc)}); rnnserve calls {SIGNATURE} with F_in "
            f"{input_size}"
        ) from exc
    if not isinstance(y, Tensor) or y.ndim != 2 or y.shape[0] != n or not y.is_floating_point():
        got = f"{list(y.shape)} {y.dtype}" if isinstance(y, Tensor) else type(y).__name__
        raise TorchScriptError(
            f"the probe call answered {got} for {n} rows of {input_size}; rnnserve calls "
            f"{SIGNATURE} (one float row per input row)"
        )
    output_size = int(y.shape[1])
    declared = meta.get("output_size")
    if declared is not None and declared != output_size:
        raise TorchScriptError(
            f"the metadata says output_size {declared}; the probe call answered {output_size}"
        )
    model = TorchScriptModel(module, int(input_size), output_size)
    model.eval().requires_grad_(False)
    return model


def save(module: torch.jit.ScriptModule, path: Path, input_size: int, output_size: int) -> None:
    """``torch.jit.save`` with the widths as the archive's ``extra/rnnserve.json``."""
    meta = json.dumps({"input_size": input_size, "output_size": output_size})
    torch.jit.save(module, str(path), _extra_files={META: meta})


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")  # CSI sequences, then 2-byte ones


def clip(text: str, limit: int = 300) -> str:
    """``text`` as one line for a terminal: ANSI escapes (torch colours some errors) removed,
    whitespace collapsed, and at most ``limit`` characters, cut between words ("...")."""
    line = " ".join(_ANSI.sub("", text).split())
    if len(line) <= limit:
        return line
    cut = line[: limit - 3]
    if line[limit - 3] != " " and " " in cut:  # the cut fell inside a word: drop that word
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip() + "..."


def first_line(exc: BaseException) -> str:
    """The telling line of an error (TorchScript's carry a traceback of the script)."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(exc)).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(("RuntimeError:", "ValueError:", "TypeError:", "IndexError:")):
            return clip(ln)
    return clip(lines[0] if lines else type(exc).__name__)
