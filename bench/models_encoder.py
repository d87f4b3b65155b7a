"""The GRU encoder of examples/gru_encoder.py served as your own model: its cases (the plain
module as the floor, the served kinds, the unbatched ways), their paragraph and their section.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from bench.models_harness import (
    BEGIN,
    BEGIN_CUDA,
    BEGIN_ENCODER,
    BEGIN_ENCODER_CUDA,
    ENCODER_CELL_LOOP,
    ENCODER_COMPILE,
    ENCODER_FLOOR,
    ENCODER_NAMES,
    ENCODER_PER_SEQUENCE,
    ENCODER_RECURRENT,
    ENCODER_TORCHSCRIPT,
    END,
    END_CUDA,
    END_ENCODER,
    END_ENCODER_CUDA,
    TOLERANCE,
    Builder,
    Case,
    Plan,
    Results,
    Row,
    Unavailable,
    _detail_table,
    _fmt_ratio,
    _fmt_s,
    _log,
    _skipped_lines,
    _summary_table,
    _verdict,
    check,
    half_spread_lengths,
    packed_to_padded,
    random_sequences,
    shape_label,
    write_section,
)
from bench.models_suite import SuiteBase
from rnnserve.models.packing import pack


class EncoderBench(SuiteBase):
    """The GRU encoder's cases, per shape of the plan."""

    def encoder_builders(self, seqs: Sequence[Tensor], label: str) -> list[tuple[str, Builder]]:
        from examples.gru_encoder import GRUEncoder, PackedGRUEncoder, gru_cell_loop, make
        from rnnserve.models import export, torchscript

        plan, dev = self.plan, self.device
        lengths = [len(s) for s in seqs]
        with torch.inference_mode(False):  # parameters stay normal tensors, as when served
            user: GRUEncoder = make().eval().requires_grad_(False)
            user64 = copy.deepcopy(user).double()
        with torch.no_grad():  # the float64 reference: the user's module, one sequence a call
            ref = np.zeros((len(seqs), max(lengths), 4))
            for i, seq in enumerate(seqs):
                ref[i, : len(seq)] = user64(seq.double()[:, None])[:, 0].numpy()
        x = pack(seqs, dev)

        def floor() -> Case:
            padded, _ = pad_packed_sequence(
                x
            )  # [T, B, 6], time-major as the user's module takes it
            model = copy.deepcopy(user).to(dev)

            def fn() -> Tensor:
                out: Tensor = model(padded)
                return out

            got = fn().transpose(0, 1).cpu().double().numpy()
            return Case(ENCODER_FLOOR, fn, self.wait, err=check(ENCODER_FLOOR, got, ref, lengths))

        def recurrent() -> Case:
            found = export.find_in_module(user)
            with torch.inference_mode(False):
                model = export.to_recurrent(found, export.config_of(found, "l2_normalize", {}))
                model = model.to(dev)
            out = cast(PackedSequence, model(x))
            err = check(ENCODER_RECURRENT, packed_to_padded(out), ref, lengths)
            return Case(ENCODER_RECURRENT, lambda: model(x), self.wait, err=err)

        def scripted() -> Case:
            with torch.inference_mode(False):
                start = time.perf_counter()
                module = torch.jit.script(PackedGRUEncoder(copy.deepcopy(user)).to(dev))
                script_s = time.perf_counter() - start
            if label == shape_label(*plan.encoder_shapes[0]):
                self.res.encoder_compile.append((ENCODER_COMPILE, _fmt_s(script_s)))
            model = torchscript.TorchScriptModel(module, 6, 4)
            self.wait(None)
            start = time.perf_counter()
            out = cast(PackedSequence, model(x))
            self.wait(out)
            first = _fmt_s(time.perf_counter() - start)
            self.res.encoder_compile.append((f"kind torchscript, first call ({label})", first))
            err = check(ENCODER_TORCHSCRIPT, packed_to_padded(out), ref, lengths)
            return Case(ENCODER_TORCHSCRIPT, lambda: model(x), self.wait, err=err)

        def per_sequence() -> Case:
            model = copy.deepcopy(user).to(dev)
            on_dev = [s.to(dev)[:, None] for s in seqs]  # [T_i, 1, 6] each

            def fn() -> list[Tensor]:
                return [model(s) for s in on_dev]

            got = torch.nn.utils.rnn.pad_sequence([y[:, 0].cpu() for y in fn()], batch_first=True)
            err = check(ENCODER_PER_SEQUENCE, got.double().numpy(), ref, lengths)
            return Case(ENCODER_PER_SEQUENCE, fn, self.wait, err=err)

        def cell_loop() -> Case:
            if self.cuda:
                raise Unavailable("per-step GRUCell calls of one row: minutes per call on CUDA")
            if sum(lengths) > plan.cell_loop_rows:
                raise Unavailable(
                    f"{sum(lengths):,} sequence steps in one call; the B=1 row gives its cost "
                    "per step"
                )

            def fn() -> list[Tensor]:
                return [gru_cell_loop(user, s) for s in seqs]

            got = torch.nn.utils.rnn.pad_sequence(fn(), batch_first=True)
            err = check(ENCODER_CELL_LOOP, got.double().numpy(), ref, lengths)
            return Case(ENCODER_CELL_LOOP, fn, slow=True, err=err)

        return [
            (ENCODER_FLOOR, floor),
            (ENCODER_RECURRENT, recurrent),
            (ENCODER_TORCHSCRIPT, scripted),
            (ENCODER_PER_SEQUENCE, per_sequence),
            (ENCODER_CELL_LOOP, cell_loop),
        ]

    def bench_encoder(self) -> None:
        for i, (batch, steps) in enumerate(self.plan.encoder_shapes):
            label = shape_label(batch, steps)
            _log(f"GRU encoder {label}")
            seqs = random_sequences(half_spread_lengths(batch, steps), 6, seed=300 + i)
            builders = self.encoder_builders(seqs, label)
            self.run_shape(builders, self.res.encoder, batch, steps, sum(len(s) for s in seqs))

    # -- compile times ----------------------------------------------------------------------


def _expectations_encoder(rows: Sequence[Row]) -> list[str]:
    out = []
    for shape in dict.fromkeys(r.shape for r in rows):
        by = {r.name: r for r in rows if r.shape == shape}
        floor = by.get(ENCODER_FLOOR)
        if floor is None:
            continue
        active = floor.packed_rows / (floor.batch * floor.steps)
        rec, ts = by.get(ENCODER_RECURRENT), by.get(ENCODER_TORCHSCRIPT)
        per, loop = by.get(ENCODER_PER_SEQUENCE), by.get(ENCODER_CELL_LOOP)
        expect = (
            "about 1× (the same GRU kernels on the same rows, plus the packing bookkeeping)"
            if floor.batch == 1
            else f"at most 1× and down to {active:.2f}× (the packed batch runs the "
            f"{floor.packed_rows:,} real steps; the padded floor runs all "
            f"{floor.batch * floor.steps:,})"
        )
        if rec is not None:
            out.append(
                f"- {shape}: kind recurrent {_fmt_ratio(rec.ratio)} the floor; expected "
                f"{expect} — {_verdict(rec.ratio, 1.0 if floor.batch == 1 else active)} it."
            )
        if rec is not None and ts is not None:
            out.append(
                f"- {shape}: kind torchscript {_fmt_ratio(ts.ratio)} the floor, "
                f"{ts.timing.median / rec.timing.median:.2f}× kind recurrent's time (expected "
                "about 1×: the same ATen GRU call, behind TorchScript's interpreter)."
            )
        if per is not None and floor.batch > 1:
            out.append(
                f"- {shape}: one call per sequence {_fmt_ratio(per.ratio)} the floor: what "
                f"batching {floor.batch} sequences into one call saves."
            )
        if loop is not None:
            us = loop.timing.median / loop.packed_rows * 1e6
            out.append(
                f"- {shape}: the GRUCell loop {_fmt_ratio(loop.ratio)} the floor "
                f"({us:.0f} µs per sequence step: Python and per-call overhead, not arithmetic)."
            )
    return out or ["- no GRU encoder row was measured."]


def render_encoder(
    res: Results, plan: Plan, separate: str | None = None, cuda: bool = False
) -> list[str]:
    """The GRU encoder's subsection, between its own markers; ``separate`` says when and where
    it was measured if not in the same run as the rest of the section."""
    begin, end = (BEGIN_ENCODER_CUDA, END_ENCODER_CUDA) if cuda else (BEGIN_ENCODER, END_ENCODER)
    rows = res.encoder
    shapes = list(dict.fromkeys(r.shape for r in rows))
    heads = [
        f"{r.shape} (N={r.packed_rows:,}; padded {r.batch * r.steps:,})"
        for r in rows
        if r.name == ENCODER_FLOOR
    ]
    lib = "cuDNN" if cuda else "oneDNN"
    lines = [
        begin,
        "### GRU encoder: your own model (`examples/gru_encoder.py`)",
        "",
        "`examples/gru_encoder.py`: `nn.GRU(6, 200, num_layers=2)` → `nn.Linear(200, 4)` → each "
        "output step divided by its L2 norm, served as your own model. Floor: the user's plain "
        f"`nn.Module` over the same padded batch `[T, B, 6]` in one call ({lib}). The served "
        "kinds run the packed batch: `recurrent` (the weights exported by `python -m "
        "rnnserve.models.export`: one packed `nn.GRU` call, the head on the packed rows) and "
        "`torchscript` (`PackedGRUEncoder` scripted, called as `forward(data, batch_sizes)`). "
        "Each cell: × floor · median per call · µs per step; lengths T/2..T. Checked against "
        f"the user's module in float64 (≤ {TOLERANCE:g}).",
        "",
    ]
    if separate:
        lines += [separate, ""]
    if rows:
        lines += [
            *_summary_table(rows, shapes, heads),
            "",
            *_detail_table(rows, ref="floor"),
            "",
        ]
    else:
        lines += ["Not measured in this run.", ""]
    if res.encoder_compile:
        lines += [
            "Compile and first calls: "
            + "; ".join(f"{what}: {fig}" for what, fig in res.encoder_compile)
            + ".",
            "",
        ]
    failed = [f for f in res.failed if f[0] in ENCODER_NAMES]
    if failed:
        lines += [f"- FAILED {name} ({shape}): {why}" for name, shape, why in failed] + [""]
    skipped = _skipped_lines(res, only=ENCODER_NAMES)
    if skipped:
        lines += ["Not measured:", "", *skipped, ""]
    if rows:
        lines += ["What we expected / what we got:", "", *_expectations_encoder(rows), ""]
    lines.append(end)
    return lines


def write_encoder(path: Path, block: str, cuda: bool = False) -> None:
    """Put the GRU encoder's subsection into the section of an earlier run in ``path``
    (replacing its earlier rows), or, with no such section, write a section of its own."""
    begin, end = (BEGIN_CUDA, END_CUDA) if cuda else (BEGIN, END)
    sub_begin, sub_end = (
        (BEGIN_ENCODER_CUDA, END_ENCODER_CUDA) if cuda else (BEGIN_ENCODER, END_ENCODER)
    )
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        section, tail = rest.split(end, 1)
        if sub_begin in section and sub_end in section:
            before, after = section.split(sub_begin, 1)
            section = before + block.rstrip("\n") + after.split(sub_end, 1)[1]
        else:  # before the compile table, where a full run puts it
            marker = "### Compile, first-call and capture times"
            if marker in section:
                before, after = section.split(marker, 1)
                section = before + block + "\n" + marker + after
            else:
                section = section.rstrip("\n") + "\n\n" + block
        path.write_text(head + begin + section + end + tail, encoding="utf-8")
        return
    title = f"## Model kernels{' on CUDA' if cuda else ''} (`python -m bench.bench_models`)"
    write_section(path, f"{begin}\n{title}\n\n{block}{end}\n", begin, end)
