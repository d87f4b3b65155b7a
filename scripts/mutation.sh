#!/usr/bin/env bash
# Mutation testing of rnnserve's core with mutmut. Not part of CI: it takes minutes per module.
#
#   scripts/mutation.sh                       # the core: batching, validation, scheduler, wire,
#                                             # the inference steps, streaming, packing, loader
#   scripts/mutation.sh service/engine/batcher.py   # one or more modules (paths under models/ or service/)
#   scripts/mutation.sh all                   # the core, then smoothing, traveller and the kernels
#   MUTATION_NAMES="rnnserve.service.http.inference.x_choose_model*" scripts/mutation.sh service/http/inference.py
#                                             # only the mutants named (globs as mutmut takes them)
#
# Each module runs in its own copy of the working tree, .mutation/<module>/ (git-ignored), against
# the subset of tests listed below, under `nice -n 19` with MUTATION_JOBS workers (default 1, for
# a shared 2-core machine). The report, .mutation/<module>.txt, lists every mutant that was not
# killed, with its diff; docs/TESTING.md says which survivors are equivalent and why.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY="$ROOT/.venv/bin/python"
JOBS="${MUTATION_JOBS:-1}"
[ -x "$ROOT/.venv/bin/mutmut" ] || {
  echo "mutmut is not installed: .venv/bin/python -m pip install -e '.[mutation]'" >&2; exit 1; }
# With autogroup scheduling (Linux's default for desktop and many server kernels), `nice` only
# ranks processes within their session: a niced job still takes its session's fair share, half
# of a 2-core machine beside one other session. So mutmut runs in a session of its own (setsid)
# whose autogroup is niced too: it takes only idle CPU, and benchmarks beside it are undisturbed.
BACKGROUND='[ -w /proc/self/autogroup ] && { echo 19 >/proc/self/autogroup; } 2>/dev/null; exec "$@"'

in_background() {  # "$@" in its own niced session; stopped with this script (Ctrl-C, kill)
  setsid sh -c "$BACKGROUND" sh "$@" &
  local pid=$! rc=0
  trap 'kill -TERM -- -'"$pid"' 2>/dev/null; exit 130' INT TERM
  wait "$pid" || rc=$?
  trap - INT TERM
  return "$rc"
}
CORE=(service/engine/batcher.py service/http/validation.py service/engine/continuous.py service/codec/bodies.py
      service/http/inference.py service/http/streaming.py models/packing.py models/__init__.py)
# models/kernels/numba_math.py and models/kernels/__init__.py are left out: every function of the
# first is compiled by numba (through `overload`) or run by numba while it compiles, and the
# second's only function is decorated (functools.cache), which mutmut does not mutate.
LATER=(models/smoothing.py models/traveller.py models/kernels/smoother_cpu.py
       models/kernels/rollout_cpu.py models/kernels/smoother_triton.py
       models/kernels/rollout_triton.py)

# The tests that judge each module: the ones that exercise it directly, kept small enough that a
# module finishes in minutes. mutmut runs, for each mutant, only those of them that reach the
# mutated function.
tests_for() {
  case "$1" in
    service/engine/batcher.py) echo tests/unit/engine/test_dynamic_batcher.py tests/unit/engine/test_fault_isolation.py \
                               tests/unit/engine/test_batch_spans.py ;;
    service/http/validation.py) echo tests/unit/http/test_validation.py ;;
    service/engine/continuous.py) echo tests/unit/engine/test_continuous_batcher.py tests/unit/engine/test_fault_isolation.py \
                                  tests/unit/engine/test_batch_spans.py ;;
    # test_validation.py never reaches wire.py; test_binary.py posts safetensors bodies
    service/codec/bodies.py) echo tests/unit/codec/test_json_reader.py tests/unit/codec/test_safetensors_reader.py \
                          tests/unit/http/test_finite_check.py tests/integration/test_binary.py ;;
    # the steps of one request: the helpers' tests (written against the survivors of the steps'
    # earlier home, routes.py), the body reader, the carried state's step (without an app),
    # the API and binary tests and the fast path; test_reliability.py, test_streaming.py and
    # test_own_models.py reach the same steps at several times the cost a mutant
    service/http/inference.py) echo tests/integration/test_route_helpers.py tests/unit/http/test_read_body.py \
                            tests/unit/http/test_inference_steps.py \
                            tests/integration/test_api.py tests/integration/test_binary.py \
                            tests/integration/test_fast_path.py ;;
    # the NDJSON stream: test_ndjson.py drives it directly, test_read_body.py waits for the
    # disconnect, test_streaming.py streams through the app
    service/http/streaming.py) echo tests/unit/http/test_ndjson.py tests/unit/http/test_read_body.py \
                            tests/integration/test_streaming.py ;;
    # the routes left: the index, health, the model list, the fast path's dispatch
    service/http/routes.py) echo tests/integration/test_route_helpers.py tests/integration/test_api.py \
                            tests/integration/test_fast_path.py ;;
    service/codec/json_writer.py) echo tests/unit/codec/test_json_writer.py ;;
    # uvicorn's protocol with the header timeout, the JSON 503 and bodies read ahead, under a
    # real uvicorn on a thread
    service/http/protocol.py) echo tests/integration/test_protocol.py ;;
    models/packing.py) echo tests/unit/models/test_packing.py tests/unit/models/test_smoothing.py \
                            tests/unit/models/test_traveller.py ;;
    models/__init__.py) echo tests/unit/models/test_loader.py tests/unit/models/test_torchscript.py ;;
    models/smoothing.py) echo tests/unit/models/test_smoothing.py tests/unit/models/kernels/test_smoother_triton.py \
                              tests/unit/models/test_smoother_kernel_choice.py ;;
    models/traveller.py) echo tests/unit/models/test_traveller.py tests/unit/models/test_rollout_backends.py \
                              tests/unit/models/test_traveller_backends_and_state.py ;;
    # one subset per kernel file: the triton ones run under TRITON_INTERPRET=1 (seconds a test)
    models/kernels/smoother_cpu.py) echo tests/unit/models/test_smoothing.py \
                                         tests/unit/models/test_smoother_kernel_choice.py ;;
    models/kernels/rollout_cpu.py) echo tests/unit/models/kernels/test_rollout_cpu.py tests/unit/models/kernels/test_kernel_host_code.py \
                                        tests/unit/models/kernels/test_rollout_routes.py \
                                        tests/unit/models/kernels/test_rollout_weights_kept.py ;;
    # the chunks of continuous batching: each sequence against itself alone, the carried state
    service/engine/chunked_rollout.py) echo tests/unit/engine/test_chunked_rollout.py \
                                            tests/unit/engine/test_carried_state.py ;;
    models/kernels/smoother_triton.py) echo tests/unit/models/kernels/test_smoother_triton.py \
                                            tests/unit/models/kernels/test_triton_edges.py ;;
    models/kernels/rollout_triton.py) echo tests/unit/models/kernels/test_rollout_triton.py \
                                           tests/unit/models/kernels/test_triton_edges.py ;;
    *) echo "no test subset for $1: add it to tests_for in $0" >&2; return 1 ;;
  esac
}

# Seconds added to each mutant's measured test time before it counts as hung (x3 wall, x6 CPU):
# tests that build the app or load models spend seconds in fixtures (JIT compiles, warm-up)
# that mutmut does not measure.
setup_seconds_for() {
  case "$1" in
    service/engine/batcher.py | service/http/validation.py | service/engine/continuous.py) echo 2 ;;
    *) echo 20 ;;
  esac
}

# Modules judged by tests that load models get the models compiled once, before mutmut forks.
warmup_for() {
  case "$(setup_seconds_for "$1")" in
    2) echo "" ;;
    *) echo ', "-p", "tests.mutation_warmup"' ;;
  esac
}

# Extra pytest arguments for a module's run. The Traveller's backend tests run the triton backend
# too, under TRITON_INTERPRET=1 (6 s a case, ~30 s for every mutant of the rollout path, most of
# a run); traveller.py hands the triton backend the same arguments as numba's, and the triton
# kernel has its own run (models/kernels/rollout_triton.py), so its cases are left out here.
extra_args_for() {
  case "$1" in
    models/traveller.py) echo ', "-k", "not triton"' ;;
    *) echo "" ;;
  esac
}

toml_list() {  # toml_list a b c -> "a", "b", "c"
  local out="" x
  for x in "$@"; do out+="${out:+, }\"$x\""; done
  echo "$out"
}

run_module() {
  local module=$1 name work tests=() t
  name=$(echo "$module" | tr '/.' '__')
  work="$ROOT/.mutation/$name"
  for t in $(tests_for "$module"); do [ -f "$t" ] && tests+=("$t"); done
  [ ${#tests[@]} -gt 0 ] || { echo "$module: none of its tests exist" >&2; return 1; }

  # a fresh copy of the working tree (tracked and untracked files, not ignored ones)
  rm -rf "$work"
  mkdir -p "$work"
  git ls-files -z --cached --others --exclude-standard \
    | (cd "$ROOT" && xargs -0 sh -c 'for f; do [ -f "$f" ] && printf "%s\0" "$f"; done' _) \
    | tar --null -T - -cf - | tar -xf - -C "$work"
  # service/ and models/ install as rnnserve.service and rnnserve.models (package-dir); in the
  # copy they move under rnnserve/, so that the mutated files in mutants/rnnserve/ are the ones
  # `import rnnserve.service...` finds, ahead of the editable install's finder
  mv "$work/service" "$work/rnnserve/service"
  mv "$work/models" "$work/rnnserve/models"
  (cd "$work" && "$PY" "$ROOT/scripts/mutation_tools.py" prepare "rnnserve/$module")
  cat >>"$work/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["rnnserve/"]
only_mutate = ["rnnserve/$module"]
also_copy = ["scripts/", "examples/", "README.md", ".ci/", "docs/"]
pytest_add_cli_args_test_selection = [$(toml_list "${tests[@]}")]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"$(warmup_for "$module")$(extra_args_for "$module")]
# pragma-free exclusions: log calls and docstrings are not behaviour
do_not_mutate_patterns = ['log\\.\\w+\\(']
process_isolation = "forkserver"
timeout_multiplier = 3.0
timeout_constant = $(setup_seconds_for "$module")
EOF

  echo "== $module: mutmut against ${tests[*]}"
  local started=$SECONDS
  # MUTATION_NAMES: only these mutants (mutmut's names or globs, space-separated), e.g. the
  # functions a change touched: "rnnserve.service.http.inference.x_choose_model*"
  local names=()
  read -r -a names <<<"${MUTATION_NAMES:-}"
  (cd "$work" && in_background nice -n 19 "$ROOT/.venv/bin/mutmut" run --max-children "$JOBS" \
    "${names[@]}" >run.log 2>&1) || {
    echo "mutmut failed for $module; see $work/run.log" >&2
    tail -20 "$work/run.log" >&2
    return 1
  }
  (cd "$work" && MUTATION_DOCS="$ROOT/docs/TESTING.md" "$PY" "$ROOT/scripts/mutation_tools.py" report "$module" $((SECONDS - started)) \
     "${tests[@]}") | tee "$ROOT/.mutation/$name.txt" | sed -n '1,/^$/p'
  echo "   report: .mutation/$name.txt"
}

modules=("$@")
if [ ${#modules[@]} -eq 0 ]; then
  modules=("${CORE[@]}")
elif [ "${modules[0]}" = all ]; then
  modules=("${CORE[@]}" "${LATER[@]}")
fi
mkdir -p .mutation
status=0
for m in "${modules[@]}"; do
  run_module "$m" || status=1
done
exit $status
