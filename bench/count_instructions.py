"""Instructions a request costs, counted by callgrind in a real rnnserve server: work, not time.

Timed A/Bs on a shared machine move a few percent from run to run; an instruction count does not
depend on the load beside it. The server runs under ``valgrind --tool=callgrind`` with counting
off; after it is ready and has answered ``--warm`` untimed requests, counting is switched on
(``callgrind_control -i on``) for exactly ``--requests`` requests sent ``--concurrency`` at a time,
then off, and the counts are dumped. Every thread of the server is counted, the compiled code
included. Reported per request: all instructions, those in compiled code without a symbol (numba's
functions: the JSON codec and the models' kernels) and the rest (the interpreter, uvicorn,
asyncio, numpy, libc). The counts vary by about a percent with how requests fall into batches.

Run: ``.venv/bin/python -m bench.count_instructions --command .venv/bin/rnnserve --workload
rollout --requests 100`` (a server under callgrind takes one to two minutes to become ready and
runs ~50x slower than natively). Needs ``valgrind`` (Debian package ``valgrind``).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.bench_ab import Side, absolute, start
from bench.load import closed_loop
from bench.load_workloads import WORKLOADS, make_bodies

# a function's line in `callgrind_annotate --inclusive=no`: "1,234,567 (12.3%)  file:function"
# A server under callgrind runs ~50x slower: its request deadlines are lifted so that a slow
# answer is counted, not cut off with a 504.
UNHURRIED = ["--request-timeout-s", "0", "--body-timeout-s", "600", "--header-timeout-s", "600"]
_FUNCTION_LINE = re.compile(r"^\s*([\d,]+)\s+(?:\(\s*[\d.]+%\)\s+)?(\S.*)$")


@dataclass(frozen=True)
class Count:
    """Instructions per request, split into code without a symbol (JIT-compiled) and the rest."""

    total: float
    compiled: float

    @property
    def rest(self) -> float:
        return self.total - self.compiled


def split_by_origin(annotated: str) -> tuple[int, int]:
    """(all, compiled) instructions from ``callgrind_annotate --inclusive=no`` output: JIT code
    has neither a symbol nor an object file, so callgrind names it ``???:0x... [???]``."""
    total = compiled = 0
    for line in annotated.splitlines():
        m = _FUNCTION_LINE.match(line)
        if not m:
            continue
        ir, where = int(m.group(1).replace(",", "")), m.group(2)
        if where.startswith("PROGRAM TOTALS"):
            total = ir
        elif where.startswith("???:0x") and where.endswith("[???]"):
            compiled += ir
    if total == 0:
        raise ValueError("no PROGRAM TOTALS line in callgrind_annotate's output")
    return total, compiled


def count(
    command: list[str],
    workload: str,
    requests: int,
    warm: int,
    concurrency: int,
    keep: Path | None = None,
) -> Count:
    """Start ``command`` under callgrind, load it, and count ``requests`` requests' instructions;
    ``keep``: where to write callgrind_annotate's per-function table."""
    with tempfile.TemporaryDirectory(prefix="callgrind-") as tmp:
        out = Path(tmp) / "callgrind.out"
        valgrind = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
        ]
        proc, url = start(
            Side("counted", [*valgrind, *absolute(command), *UNHURRIED], None), timeout_s=600
        )
        try:
            spec = WORKLOADS[workload]
            bodies = make_bodies(spec, 64)

            def load(n: int) -> None:
                r = asyncio.run(
                    closed_loop(
                        url,
                        spec,
                        bodies,
                        clients=concurrency,
                        seconds=1e9,
                        max_requests=n,
                        timeout_s=600,
                    )
                )
                if r.errors or r.ok != n:
                    raise RuntimeError(f"{r.ok} of {n} answered, errors: {r.errors}")

            load(warm)
            control = ["callgrind_control"]
            subprocess.run([*control, "-i", "on", str(proc.pid)], check=True, capture_output=True)
            load(requests)
            subprocess.run([*control, "-i", "off", str(proc.pid)], check=True, capture_output=True)
            subprocess.run([*control, "-d", str(proc.pid)], check=True, capture_output=True)
            dumped = sorted(Path(tmp).glob("callgrind.out.*"))
            if not dumped:
                raise RuntimeError("callgrind wrote no dump")
            annotated = subprocess.run(
                ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(dumped[-1])],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    if keep is not None:
        keep.write_text(annotated)
    total, compiled = split_by_origin(annotated)
    return Count(total / requests, compiled / requests)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--command", required=True, help="starts rnnserve; --port is added")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="smooth")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--keep", type=Path, help="write the per-function table to this file")
    args = ap.parse_args(argv)
    c = count(
        args.command.split(), args.workload, args.requests, args.warm, args.concurrency, args.keep
    )
    print(
        f"| {args.command} | {args.workload} | {c.total / 1e6:.3f} | {c.compiled / 1e6:.3f} "
        f"| {c.rest / 1e6:.3f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
