#!/usr/bin/env bash
# Download, on a machine with network access, the wheels that scripts/gpu_check.sh installs on a
# GPU host without it: rnnserve's runtime dependencies except torch (fastapi, uvicorn, pydantic,
# pydantic-settings, orjson, numba, ...) and the test tools (scripts/gpu_requirements.py lists
# them), for CPython 3.12 on manylinux x86_64, with everything they depend on.
#
# Usage: scripts/gpu_wheels.sh [DIR [NAME...]]   (default DIR: wheels/, ignored by git)
#   NAME     only these projects (say, what `scripts/gpu_requirements.py --missing` printed on
#            the GPU host), so that the wheelhouse stays small: tens of MB, not hundreds
#   PYTHON_VERSION  target Python (default 3.12)
#   PLATFORMS       target platform tags (default "manylinux2014_x86_64 manylinux_2_28_x86_64")
#   PYTHON          the interpreter that runs pip here (default .venv/bin/python, else python3)
# Then copy DIR next to the checkout on the GPU host and run: WHEELS=DIR scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

dest="${1:-wheels}"
shift || true
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
pyver="${PYTHON_VERSION:-3.12}"
read -r -a platforms <<< "${PLATFORMS:-manylinux2014_x86_64 manylinux_2_28_x86_64}"
platform_args=()
for p in "${platforms[@]}"; do platform_args+=(--platform "$p"); done

mkdir -p "$dest"
"$py" scripts/gpu_requirements.py "$@" > "$dest/requirements.txt"
if [ ! -s "$dest/requirements.txt" ]; then
  echo "gpu_wheels.sh: nothing to download (no requirement matched: $*)" >&2
  exit 2
fi
echo "downloading wheels for Python $pyver (${platforms[*]}) into $dest/:"
sed 's/^/  /' "$dest/requirements.txt"
"$py" -m pip download --disable-pip-version-check --only-binary=:all: \
  --python-version "$pyver" --implementation cp "${platform_args[@]}" \
  --dest "$dest" -r "$dest/requirements.txt"
count=$(find "$dest" -maxdepth 1 -name '*.whl' | wc -l)
size=$(du -sh "$dest" | cut -f1)
echo "$count wheels ($size) in $dest/; on the GPU host: WHEELS=$dest scripts/gpu_check.sh"
if [ "$(du -sm "$dest" | cut -f1)" -gt 64 ]; then
  echo "gpu_wheels.sh: over 64 MB: name only what the host lacks (gpu_requirements.py --missing)" >&2
fi
