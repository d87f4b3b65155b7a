#!/usr/bin/env bash
# One command for a GPU host: installs what the host's Python lacks, then runs the decision
# script (python -m bench.gpu_decide: floors, the smoother and rollout matrices, JAX in a child
# process, ncu if present, the key CUDA tests, the service end to end with --device cuda against
# --device cpu), each step under its own timeout, the whole run bounded at eight minutes
# (--budget-s 480; the limits allow for a fresh host's first Triton compiles).
# Its predictions and decision rules are written at the top of OUT/decide.md before the first
# step; every step's results land in OUT/<step>.json as it finishes, so a cut run keeps them.
#
# Usage: [WHEELS=DIR] scripts/gpu_check.sh [OUT] [--cpu] [-- ARGS...]
#   OUT      results folder (default ./gpu-results): decide.md (the report to paste into
#            docs/BENCHMARKS.md, with the GPU model and date), results.json, <step>.json and
#            <step>.log per step
#   WHEELS   a wheelhouse made by scripts/gpu_wheels.sh, for hosts whose Python has CUDA torch
#            and triton but not every other dependency: only what the host lacks
#            (scripts/gpu_requirements.py --missing) is installed, with --no-index, into a venv
#            made with --system-site-packages (GPU_VENV, default .gpu-venv), so the host's own
#            torch, triton, jax and numpy are used
#   PYTHON   interpreter to run (default .venv/bin/python if present, else python3); with WHEELS,
#            the one the venv is made from
#   --cpu    dry run on a machine without a GPU: every step on tiny shapes in Triton's
#            interpreter (--cpu --quick), so that a Python error costs no GPU minute
#   ARGS     passed to bench.gpu_decide (e.g. --only floors,smoother-chunked --budget-s 200)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$(pwd)

mode=gpu
out=./gpu-results
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu | --dry-run) mode=cpu ;;
    -h | --help)
      sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    --)
      shift
      extra=("$@")
      break
      ;;
    -*)
      echo "gpu_check.sh: unknown option $1 (see --help)" >&2
      exit 2
      ;;
    *) out=$1 ;;
  esac
  shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)

py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ] && [ -z "${WHEELS:-}" ]; then py=.venv/bin/python; else py=python3; fi
fi

if ! "$py" -c 'import torch' 2> /dev/null; then
  echo "gpu_check.sh: $py has no torch; torch (the host's CUDA build) is never installed" >&2
  echo "  from WHEELS: point PYTHON at the interpreter that has it" >&2
  exit 2
fi

if [ -n "${WHEELS:-}" ]; then
  venv="${GPU_VENV:-.gpu-venv}"
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv --system-site-packages "$venv" || exit 2
  fi
  "$venv/bin/python" scripts/gpu_requirements.py --missing > "$out/requirements.txt" || exit 2
  if [ -s "$out/requirements.txt" ]; then
    echo "== installing from $WHEELS into $venv what the host lacks:"
    sed 's/^/  /' "$out/requirements.txt"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index \
      --find-links "$WHEELS" -r "$out/requirements.txt" || {
      echo "gpu_check.sh: pip could not install from $WHEELS (made for another Python?)" >&2
      exit 2
    }
  fi
  py="$venv/bin/python"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

missing=$("$py" scripts/gpu_requirements.py --missing)
if [ -n "$missing" ]; then
  echo "gpu_check.sh: $py lacks: $(echo "$missing" | paste -sd ' ' -)" >&2
  echo "  make a wheelhouse where there is network (scripts/gpu_wheels.sh wheels/ [NAMES]), copy" >&2
  echo "  it here and run: WHEELS=wheels/ scripts/gpu_check.sh $out" >&2
  exit 2
fi

if [ "$mode" = gpu ]; then
  if ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check.sh: torch sees no CUDA device here; --cpu runs the same steps on the CPU" >&2
    exit 2
  fi
  unset TRITON_INTERPRET # real kernels on the GPU, not Triton's interpreter
  args=(--out "$out")
else
  export TRITON_INTERPRET=1 # the kernels in Triton's interpreter
  args=(--out "$out" --cpu --quick)
fi
if command -v nvidia-smi > /dev/null; then nvidia-smi > "$out/nvidia-smi.txt" 2>&1; fi
"$py" -m bench.gpu_decide "${args[@]}" "${extra[@]}"
rc=$?
echo "== report: $out/decide.md"
exit "$rc"
