"""Helpers of scripts/mutation.sh, run inside a module's work copy.

    python mutation_tools.py prepare MODULE           # before mutmut: see prepare()
    python mutation_tools.py report MODULE SECONDS TEST...
    python mutation_tools.py rerun TEST... -- MUTANT...  # in .mutation/<module>/mutants

``rerun`` runs each named mutant (mutmut's ``MUTANT_UNDER_TEST``) against the given test files,
one pytest session per mutant in one process, and prints ``name: killed`` or ``name: survived``:
how survivors are judged against tests written after a run (copy them into ``mutants/tests``
first), without running the whole module again.

``report`` prints the score, then every mutant that was not killed with its diff. Mutants that
docs/TESTING.md names are counted as equivalent (left out of the score) and marked so; the
others are the ones still to kill or to explain there.
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from collections import Counter
from pathlib import Path

MUTMUT = str(Path(sys.executable).with_name("mutmut"))
CAUGHT = {"killed", "timeout", "caught by type check", "segfault"}
NAME = re.compile(r"[\w.ǁ]+__mutmut_\d+")


COMPILER = re.compile(r"(?<![A-Za-z0-9])(njit|jit|script|intrinsic)\b")


def compiled_functions(tree: ast.Module) -> set[str]:
    """Names of plain functions handed to a compiler: ``numba.njit(...)(f)``, ``njit(f)``,
    ``torch.jit.script(f)``, a module's own wrapper such as ``_jit(f, **options)``, or numba's
    ``intrinsic(f)``. mutmut swaps each function for a Python trampoline, which numba and
    TorchScript cannot compile; an intrinsic's typing and code generation run inside numba's
    compiler while the functions that use it compile (in the fork server, before a mutant is
    chosen, or not at all when numba's disk cache has them), so no mutant of it would run."""
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or len(node.args) != 1:
            continue
        if not isinstance(node.args[0], ast.Name):
            continue
        func = ast.unparse(node.func)
        if COMPILER.search(func):
            names.add(node.args[0].id)
    return names


def header_ends(source: str) -> dict[int, int]:
    """For each ``def`` line, the line of the colon that ends its signature (the two differ
    when the signature spans several lines): mutmut reads a ``no mutate block`` pragma only
    from that colon's line."""
    ends: dict[int, int] = {}
    start, depth = 0, 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string == "def" and not start:
            start, depth = tok.start[0], 0
        elif start and tok.type == tokenize.OP:
            if tok.string in "([{":
                depth += 1
            elif tok.string in ")]}":
                depth -= 1
            elif tok.string == ":" and depth == 0:
                ends[start], start = tok.start[0], 0
    return ends


def prepare(module: str) -> None:
    """Mark the functions of ``module`` that numba or TorchScript compile ``no mutate``."""
    path = Path(module)
    source = path.read_text()
    lines = source.splitlines(keepends=True)
    names = compiled_functions(ast.parse(source))
    ends = header_ends(source)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            i = ends[node.lineno] - 1
            lines[i] = lines[i].rstrip("\n") + "  # pragma: no mutate block\n"
            print(f"{module}: {node.name} is compiled (numba/TorchScript): not mutated")
    path.write_text("".join(lines))


def statuses() -> dict[str, str]:
    out = subprocess.run(
        [MUTMUT, "results", "--all", "true"], capture_output=True, text=True, check=True
    ).stdout
    found = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and NAME.fullmatch(name):
            found[name] = status
    return found


def report(module: str, seconds: str, tests: list[str]) -> None:
    docs = Path(os.environ.get("MUTATION_DOCS", "docs/TESTING.md"))
    equivalent = set(NAME.findall(docs.read_text())) if docs.exists() else set()
    results = statuses()
    counts = Counter(results.values())
    caught = sum(n for s, n in counts.items() if s in CAUGHT)
    # "not checked": never run, as when MUTATION_NAMES chose others or the run was stopped;
    # neither killed nor alive, so counted apart and left out of the score
    not_run = counts.get("not checked", 0)
    left_out = ("skipped", "not checked")
    not_caught = {k: s for k, s in results.items() if s not in CAUGHT and s not in left_out}
    equiv = {k for k in not_caught if k in equivalent}
    scored = caught + len(not_caught) - len(equiv)
    score = 100.0 * caught / scored if scored else 100.0
    print(
        f"{module}: {len(results)} mutants ({len(results) - not_run} run), {caught} killed, "
        f"{len(equiv)} equivalent, {len(not_caught) - len(equiv)} not killed -> {score:.1f}% "
        "of the non-equivalent that ran killed"
    )
    print("  by status: " + ", ".join(f"{s} {n}" for s, n in sorted(counts.items())))
    print(f"  tests: {' '.join(tests)}; {seconds} s")
    print()
    for name, status in sorted(not_caught.items(), key=lambda kv: (kv[0] in equiv, kv[0])):
        tag = "equivalent (docs/TESTING.md)" if name in equiv else status.upper()
        diff = subprocess.run([MUTMUT, "show", name], capture_output=True, text=True).stdout
        print(f"## {name}: {tag}")
        print("\n".join(diff.splitlines()[1:]).strip())
        print()


def rerun(args: list[str]) -> None:
    import contextlib

    import pytest

    split = args.index("--")
    tests, mutants = args[:split], args[split + 1 :]
    sys.path.insert(0, os.getcwd())  # the mutated code in mutants/, not the working tree's
    # import everything first with no mutant active, as mutmut's fork server does: functions
    # that run at import (and their effects on module state) are never judged by mutant here
    os.environ["MUTANT_UNDER_TEST"] = ""
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *tests])
    # a mutant that hangs fails its test after MUTATION_TIMEOUT seconds (pytest-timeout): caught,
    # as mutmut counts its "timeout"
    limit = (
        ["-o", f"timeout={os.environ['MUTATION_TIMEOUT']}"]
        if "MUTATION_TIMEOUT" in os.environ
        else []
    )
    args = ["-x", "-q", "-p", "no:cacheprovider", *limit, *tests]
    for name in mutants:
        os.environ["MUTANT_UNDER_TEST"] = name
        with contextlib.redirect_stdout(io.StringIO()):
            code = int(pytest.main(args))
        if code not in (0, 1):
            # a session that errors (a mutant that breaks the loop's teardown, a hung test's
            # leftovers) can leave this process unfit for the next: that mutant runs again in
            # a process of its own, whose verdict is the one reported
            code = subprocess.run(
                [sys.executable, "-m", "pytest", *args], capture_output=True, env=os.environ
            ).returncode
        status = {0: "survived", 1: "killed"}.get(code, f"error (pytest exit code {code})")
        print(f"{name}: {status}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2])
    elif sys.argv[1] == "rerun":
        rerun(sys.argv[2:])
    else:
        report(sys.argv[2], sys.argv[3], sys.argv[4:])
