#!/usr/bin/env bash
# One command for a GPU host, in about eight minutes (its step limits add up to 770 s; session 6's
# run took 367 s without the tile sweeps): the CUDA tests, the kernel benchmark on CUDA, tile
# sweeps, and the service end to end with --device cuda against --device cpu on the same host. Writes
# markdown to paste into docs/BENCHMARKS.md (with the GPU model from nvidia-smi and the date),
# plus each step's full output, under OUT.
#
# Usage: [WHEELS=DIR] scripts/gpu_check.sh [OUT] [--cpu]
#   OUT      results folder (default ./gpu-results): gpu-check.md (the summary to paste),
#            pytest.txt, bench_models.md, bench_tiles.md, bench_tiles_lookback.md, bench_e2e.md,
#            nvidia-smi.txt, one .log per step
#   WHEELS   a wheelhouse made by scripts/gpu_wheels.sh, for hosts whose Python has CUDA torch,
#            triton and jax but not the service's other dependencies (fastapi, uvicorn,
#            pydantic, orjson, ...): they are installed with --no-index into a venv made with
#            --system-site-packages (GPU_VENV, default .gpu-venv), so the host's torch is used
#   PYTHON   interpreter to run (default .venv/bin/python if present, else python3); with WHEELS,
#            the one the venv is made from
#   --cpu    dry run on a machine without a GPU: the same steps with --device cpu and small
#            workloads (the tests/gpu tests skip themselves)
#
# Steps (each with its own timeout; a failing step does not stop the others; exit status 1 if
# any failed):
#   1. python -m pytest -q tests/gpu tests/unit/models/test_rollout_backends.py
#   2. python -m bench.bench_models --device cuda   (JAX rows each in a process of their own)
#   3. python -m bench.bench_tiles --device cuda --budget-s 100   (candidate tiles of the Triton
#      kernels, the data to choose their defaults by), then the smoother's look-back scan alone
#      (--scans lookback: its programs wait on one another, so it gets its own timeout)
#   4. python -m bench.bench_gpu_e2e --devices cuda cpu   (64 clients, JSON: /smooth 50-500
#      steps, /rollout 50-500 steps, /smooth 4000 steps)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$(pwd)

mode=gpu
out=./gpu-results
for arg in "$@"; do
  case "$arg" in
    --cpu | --dry-run) mode=cpu ;;
    -h | --help)
      sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "gpu_check.sh: unknown option $arg (see --help)" >&2
      exit 2
      ;;
    *) out=$arg ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)

py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ] && [ -z "${WHEELS:-}" ]; then py=.venv/bin/python; else py=python3; fi
fi

if [ -n "${WHEELS:-}" ]; then
  venv="${GPU_VENV:-.gpu-venv}"
  echo "== installing the service's dependencies from $WHEELS into $venv (system site: torch)"
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv --system-site-packages "$venv" || exit 2
  fi
  "$py" scripts/gpu_requirements.py > "$out/requirements.txt" || exit 2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index \
    --find-links "$WHEELS" -r "$out/requirements.txt" || {
    echo "gpu_check.sh: pip could not install from $WHEELS (made for another Python?)" >&2
    exit 2
  }
  py="$venv/bin/python"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

missing=$("$py" - <<'EOF'
import importlib
names = ["torch", "numpy", "numba", "safetensors", "fastapi", "uvicorn", "pydantic",
         "pydantic_settings", "orjson", "prometheus_client", "pytest", "hypothesis",
         "httpx", "aiohttp", "pandas"]
bad = []
for n in names:
    try:
        importlib.import_module(n)
    except Exception as e:
        bad.append(f"{n} ({type(e).__name__})")
print(" ".join(bad))
EOF
)
if [ -n "$missing" ]; then
  echo "gpu_check.sh: $py lacks: $missing" >&2
  case "$missing" in
    torch\ * | torch)
      echo "  torch (the host's CUDA build) is never installed from WHEELS: point PYTHON at" >&2
      echo "  the interpreter that has it (the venv is made with --system-site-packages)" >&2
      exit 2
      ;;
  esac
  echo "  make a wheelhouse where there is network (scripts/gpu_wheels.sh wheels/), copy it" >&2
  echo "  here and run: WHEELS=wheels/ scripts/gpu_check.sh $out" >&2
  exit 2
fi

if [ "$mode" = gpu ]; then
  if ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check.sh: torch sees no CUDA device here; --cpu runs the same steps on the CPU" >&2
    exit 2
  fi
  unset TRITON_INTERPRET # real kernels on the GPU, not Triton's interpreter
  device=cuda
  heading="## GPU check (\`scripts/gpu_check.sh\`)"
  bench_args=(--device cuda)
  tiles_args=(--device cuda --budget-s 100 --gpu-time)
  lookback_args=(--device cuda --budget-s 25 --kernels smoother --scans lookback)
  e2e_args=(--devices cuda cpu)
else
  device=cpu
  heading="## GPU check, dry run on the CPU (\`scripts/gpu_check.sh --cpu\`; nothing ran on a GPU)"
  bench_args=(--device cpu --quick)
  tiles_args=(--device cpu --quick)
  lookback_args=(--device cpu --quick --kernels smoother --scans lookback)
  export TRITON_INTERPRET=1 # the tile sweep's kernels in Triton's interpreter
  e2e_args=(--devices cpu --quick)
fi

started=$(date -u '+%Y-%m-%d %H:%M UTC')
t_start=$SECONDS
if command -v nvidia-smi > /dev/null && nvidia-smi > "$out/nvidia-smi.txt" 2>&1; then
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
    paste -sd ';' -)
else
  gpu="none (nvidia-smi absent or failing)"
  echo "$gpu" > "$out/nvidia-smi.txt"
fi
versions=$("$py" - <<'EOF'
import importlib, platform
import torch
parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
if torch.cuda.is_available():
    parts.append(f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
for name in ("triton", "jax", "numba", "numpy"):
    try:
        parts.append(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        parts.append(f"{name} not installed")
print(", ".join(parts))
EOF
)
commit=$(git rev-parse --short HEAD 2> /dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2> /dev/null)" ]; then
  commit="$commit + uncommitted changes"
fi

statuses=()
failed=0
step() { # step NAME TIMEOUT_S LOG CMD...: run CMD under a timeout, output to LOG and the console
  local name=$1 limit=$2 log=$3
  shift 3
  echo "== $name: $*"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0)) status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="timed out after ${limit} s"
  elif [ "$rc" -ne 0 ]; then
    status="FAILED (exit $rc)"
  fi
  [ "$status" = ok ] || failed=1
  local shown="$*"
  statuses+=("| $name | \`${shown/#"$py"/python}\` | $status | $took s |")
}

rm -f "$out"/bench_models.md "$out"/bench_tiles.md "$out"/bench_tiles_lookback.md \
  "$out"/bench_e2e.md
step "tests" 150 "$out/pytest.txt" \
  "$py" -m pytest -q -p no:cacheprovider tests/gpu tests/unit/models/test_rollout_backends.py
step "kernel benchmark" 240 "$out/bench_models.log" \
  "$py" -m bench.bench_models "${bench_args[@]}" --out "$out/bench_models.md"
if [ ! -s "$out/bench_models.md" ]; then
  # no section written: it crashed or hung. One suspect is JAX and torch sharing the GPU in one
  # process, so measure the rest without JAX (the log above says what happened)
  step "kernel benchmark, no JAX" 180 "$out/bench_models_nojax.log" \
    "$py" -m bench.bench_models "${bench_args[@]}" --no-jax --out "$out/bench_models.md"
fi
step "tile sweep" 150 "$out/bench_tiles.log" \
  "$py" -m bench.bench_tiles "${tiles_args[@]}" --out "$out/bench_tiles.md"
# the look-back scan's programs wait on one another: swept apart, so a hang costs only this step
step "look-back scan sweep" 50 "$out/bench_tiles_lookback.log" \
  "$py" -m bench.bench_tiles "${lookback_args[@]}" --out "$out/bench_tiles_lookback.md"
step "end to end" 180 "$out/bench_e2e.log" \
  "$py" -m bench.bench_gpu_e2e "${e2e_args[@]}" --out "$out/bench_e2e.md"

section() { # the section a benchmark wrote, without the title its new file got
  if [ -s "$1" ]; then grep -v '^# Benchmarks$' "$1"; else echo "*(no output: see the step's log)*"; fi
}
pytest_summary=$(grep -E '(passed|failed|skipped|error|no tests ran)' "$out/pytest.txt" | tail -1)
{
  echo "<!-- gpu_check:begin -->"
  echo "$heading"
  echo
  echo "Run $started on $(hostname) (device: $device). GPU: $gpu. Host: $(nproc) CPUs."
  echo "$versions. Commit $commit. Took $((SECONDS - t_start)) s."
  echo
  echo "| step | command | status | time |"
  echo "|---|---|---|---|"
  printf '%s\n' "${statuses[@]}"
  echo
  echo "Tests: \`${pytest_summary:-no summary line}\` (full output: pytest.txt)."
  echo
  section "$out/bench_models.md"
  echo
  section "$out/bench_tiles.md"
  echo
  section "$out/bench_tiles_lookback.md"
  echo
  section "$out/bench_e2e.md"
  echo "<!-- gpu_check:end -->"
} > "$out/gpu-check.md"
echo "== wrote $out/gpu-check.md ($((SECONDS - t_start)) s)"
exit "$failed"
