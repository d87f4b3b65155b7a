#!/usr/bin/env bash
# mypy over rnnserve as it installs. service/ and models/ install as rnnserve.service and
# rnnserve.models (setuptools package-dir); mypy cannot follow the editable install's import
# hook, so a tree of links in .typecheck/ lays the folders out under their installed names.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .typecheck
mkdir -p .typecheck/rnnserve
for f in rnnserve/*.py rnnserve/py.typed; do ln -s "../../$f" .typecheck/rnnserve/; done
ln -s ../../service .typecheck/rnnserve/service
ln -s ../../models .typecheck/rnnserve/models
MYPYPATH=.typecheck exec .venv/bin/mypy .typecheck/rnnserve bench scripts deploy examples "$@"
