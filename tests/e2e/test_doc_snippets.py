"""Every runnable block of README.md and docs/*.md runs, against a real server, and succeeds.

A ``bash`` or ``python`` block runs unless the line before it is ``<!-- not run: <why> -->``;
those are skipped with their reason, so ``-ra`` lists them. Blocks run in a scratch folder that
links the repository's ``.venv``, ``examples`` and ``scripts``, holds a copy of ``deploy/grafana``
and is their ``HOME``, so what they write stays there. ``localhost:8000`` in a block is the
test's server (the bundled models); a line that starts ``rnnserve`` (its environment and flags
kept) starts a server of its own for the rest of the block. ``curl`` fails on an HTTP error
status.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.server import Server, start_server, stop

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")
FENCE = re.compile(r"^```([a-z]*)\s*$")
RUNNABLE = ("bash", "python")
HOSTS = re.compile(r"\b(?:localhost|127\.0\.0\.1):8000\b")
# a line that starts a server: optional VAR=value words, then rnnserve and flags (not a subcommand)
SERVER_LINE = re.compile(r"^((?:[A-Z_][A-Z0-9_]*=\S+\s+)*)(?:\.venv/bin/)?rnnserve((?:\s+-\S.*)?)$")
BLOCK_TIMEOUT_S = 400
READY_TIMEOUT_S = 300  # compiling the kernels on a busy two-core host


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    not_run: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = NOT_RUN.match(lines[i - 1]) if i > 0 else None
        text = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(page, i + 1, fence.group(1), text, marker and marker.group(1)))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
TO_RUN = [b for b in ALL if b.lang in RUNNABLE]


def test_the_pages_have_runnable_blocks_and_every_marker_names_a_reason() -> None:
    assert len([b for b in TO_RUN if b.not_run is None]) >= 10, [b.id for b in TO_RUN]
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            if line.startswith("<!-- not run"):
                assert NOT_RUN.match(line), f"{page.name}:{n + 1}: write <!-- not run: why -->"
                assert FENCE.match(lines[n + 1]), f"{page.name}:{n + 1}: no block follows"


def test_blocks_are_split_as_written() -> None:
    readme = [b for b in ALL if b.page == "README.md"]
    assert readme[0].text.splitlines() == [
        "./scripts/install.sh && .venv/bin/rnnserve",
        "./scripts/install.sh --test && .venv/bin/python -m pytest",
    ]
    assert readme[0].not_run is not None


def logical_lines(script: str) -> list[str]:
    """The script's lines with backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for line in script.splitlines():
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def server_command(line: str) -> tuple[dict[str, str], list[str]] | None:
    """(environment, flags) when ``line`` starts an rnnserve server, else None."""
    code = line.split(" #", 1)[0].strip()
    match = SERVER_LINE.match(code)
    if match is None:
        return None
    env = dict(word.split("=", 1) for word in match.group(1).split())
    return env, shlex.split(match.group(2))


def test_server_lines_are_told_from_commands() -> None:
    assert server_command(".venv/bin/rnnserve --model-dir my-models") == (
        {},
        ["--model-dir", "my-models"],
    )
    assert server_command("RNNSERVE_TRUST_TORCHSCRIPT=true rnnserve --model-dir d  # x") == (
        {"RNNSERVE_TRUST_TORCHSCRIPT": "true"},
        ["--model-dir", "d"],
    )
    assert server_command("rnnserve") == ({}, [])
    assert server_command(".venv/bin/rnnserve export --checkpoint a.pt") is None
    assert server_command("curl -s localhost:8000/models") is None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("snippets")
    venv = ROOT / ".venv"
    (d / ".venv").symlink_to(venv if venv.exists() else Path(sys.executable).parents[1])
    for name in ("examples", "scripts"):
        (d / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "deploy" / "grafana", d / "deploy" / "grafana")
    return d


@pytest.fixture(scope="module")
def server(workdir: Path) -> Iterator[Server]:
    srv = start_server(workdir, ready_timeout_s=READY_TIMEOUT_S)
    yield srv
    stop(srv)


def environment(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(workdir)  # what a block writes to ~ stays in the scratch folder
    return env


def at(text: str, url: str) -> str:
    return HOSTS.sub(url.removeprefix("http://"), text)


def run(args: list[str], workdir: Path, block: Block) -> None:
    done = subprocess.run(
        args,
        cwd=workdir,
        env=environment(workdir),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{block.id} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )


def run_python(block: Block, workdir: Path, server: Server) -> None:
    script = workdir / f"snippet_{block.page.replace('/', '_')}_{block.line}.py"
    script.write_text(at(block.text, server.url))
    run([sys.executable, str(script)], workdir, block)


def run_bash(block: Block, workdir: Path, server: Server) -> None:
    """Runs the block's lines in pieces: each server line starts a server the rest then uses."""
    url = server.url
    started: list[Server] = []
    piece: list[str] = []

    def flush() -> None:
        if piece:
            script = at("\n".join(piece), url)
            script = re.sub(r"(^|[;&|(]\s*)curl ", r"\1curl --fail-with-body ", script, flags=re.M)
            run(["bash", "-euo", "pipefail", "-c", script], workdir, block)
            piece.clear()

    try:
        for line in logical_lines(block.text):
            command = server_command(line)
            if command is None:
                piece.append(line)
                continue
            flush()
            env, flags = command
            own = start_server(workdir, *flags, env=env, ready_timeout_s=READY_TIMEOUT_S)
            started.append(own)
            url = own.url
        flush()
    finally:
        for own in started:
            stop(own)


@pytest.mark.parametrize("block", TO_RUN, ids=[b.id for b in TO_RUN])
@pytest.mark.timeout(900)  # a block may train, export and start servers
def test_the_block_runs(block: Block, workdir: Path, request: pytest.FixtureRequest) -> None:
    if block.not_run is not None:
        pytest.skip(f"{block.id} not run: {block.not_run}")
    server: Server = request.getfixturevalue("server")  # started for the first block run
    (run_bash if block.lang == "bash" else run_python)(block, workdir, server)


@pytest.mark.parametrize(
    ("lang", "text"),
    [
        ("bash", "true\nfalse\necho never\n"),
        ("bash", "curl -s localhost:8000/healthz\n"),  # nothing listens: curl exits 7
        ("python", "import sys\nsys.exit(3)\n"),
    ],
)
def test_a_failing_block_fails_its_test(lang: str, text: str, workdir: Path) -> None:
    nowhere = Server(None, "http://127.0.0.1:9", workdir / "none.log")  # type: ignore[arg-type]
    block = Block("planted.md", 1, lang, text, None)
    with pytest.raises(AssertionError, match=r"planted\.md:1 failed"):
        (run_bash if lang == "bash" else run_python)(block, workdir, nowhere)
