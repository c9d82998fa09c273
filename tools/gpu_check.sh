#!/usr/bin/env bash
# One GPU check in one go (at most about 7 minutes, no internet): the whole test suite (every
# CUDA test among it, checked to have run: see tools/check_junit.py), the HF zoo on
# CUDA in fp16 and bf16 under deterministic algorithms (bitwise vs torch.autocast),
# bench_speed on CUDA and examples/train.py on CUDA. Every step has its own timeout; a failed
# step is recorded and the next one runs. Everything goes under ${OUT:-gpu_check_out}/, with
# one summary.md.
#
#   bash tools/gpu_check.sh                       # on the GPU machine
#   bash tools/gpu_check.sh --dry-run             # every step, tiny and on the CPU
#   bash tools/gpu_check.sh --dry-run --steps pytest,train
#
# Needs: pytest, pytest-xdist; pytest-timeout if present (without it each test has no limit of
# its own, only the step's). expecttest (needed by the tests that read PyTorch's autocast test
# lists and by the pinned tables) is installed from ${WHEELS:-tools/wheels} if a wheel lies
# there; on a GPU run its absence fails the pytest step, since a whole module would not run.
set -u
cd "$(dirname "$0")/.."
DRY=0
STEPS="expecttest,pytest,zoo,zoo_fp16,zoo_bf16,bench,train"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --steps) STEPS="$2"; shift ;;
    *) echo "gpu_check.sh: unknown option $1 (expected --dry-run, --steps a,b)" >&2; exit 2 ;;
  esac
  shift
done
export OUT="${OUT:-gpu_check_out}"
export PY="${PYTHON:-python}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=":4096:8"
SUMMARY="$OUT/summary.md"
{
  echo "# GPU check"
  echo
  echo "mode: $([ $DRY = 1 ] && echo 'dry run (CPU, tiny)' || echo GPU), started $(date -u +%FT%TZ)"
  "$PY" -c "import torch, transformers; print(f'torch {torch.__version__}, transformers {transformers.__version__}, cuda available: {torch.cuda.is_available()}' + (f', {torch.cuda.get_device_name()}' if torch.cuda.is_available() else ''))" 2>&1
  echo
  echo "| step | status | seconds | log |"
  echo "|---|---|---:|---|"
} > "$SUMMARY"
FAILED=0

# step NAME TIMEOUT_S COMMAND...: run it with its own timeout, log to $OUT/NAME.log
step() {
  local name="$1" limit="$2"; shift 2
  if [[ ",$STEPS," != *",$name,"* ]]; then
    echo "| $name | skipped (not in --steps) | 0 | - |" >> "$SUMMARY"; return
  fi
  echo "== $name (timeout ${limit} s): $*" >&2
  local start=$SECONDS status
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) status="ok" ;;
    124|137) status="timed out after ${limit} s"; FAILED=1 ;;
    *) status="failed (exit $rc)"; FAILED=1 ;;
  esac
  echo "| $name | $status | $((SECONDS - start)) | $name.log |" >> "$SUMMARY"
  tail -n 3 "$OUT/$name.log" >&2
}

install_expecttest() {
  local wheels="${WHEELS:-tools/wheels}"
  if "$PY" -c "import expecttest" 2>/dev/null; then echo "expecttest already installed"; return 0; fi
  if ls "$wheels"/expecttest-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install --no-index --find-links "$wheels" expecttest
  else
    echo "no expecttest wheel in $wheels: the tests that need it skip"
  fi
}

# run_pytest WORKERS TEST_TIMEOUT [--cuda] PYTEST_ARGS...: pytest with a JUnit report, then
# tools/check_junit.py, which fails the step when nothing ran or (--cuda) a CUDA test skipped.
run_pytest() {
  local workers="$1" per_test="$2"; shift 2
  local check=""
  if [ "${1:-}" = "--cuda" ]; then check="--cuda"; shift; fi
  local limit=()
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then limit=(--timeout "$per_test")
  else echo "pytest-timeout is not installed: tests run without a limit of their own"; fi
  "$PY" -m pytest "$@" -q -n "$workers" "${limit[@]}" -rs -p no:cacheprovider \
      --junitxml "$OUT/pytest.xml"
  local rc=$?
  "$PY" tools/check_junit.py "$OUT/pytest.xml" $check || return 1
  return $rc
}

if [ $DRY = 1 ]; then
  step expecttest 30 bash -c "$(declare -f install_expecttest); install_expecttest"
  step pytest 60 bash -c "$(declare -f run_pytest); run_pytest 0 60 tests/test_o2_norms.py -k 'table or fake_cuda'"
  step zoo_fp16 120 "$PY" tools/hf_zoo_cuda.py --device cpu --dtype fp16 --only bert --out "$OUT/zoo_fp16.md"
  step zoo_bf16 120 "$PY" tools/hf_zoo_cuda.py --device cpu --dtype bf16 --only bert --out "$OUT/zoo_bf16.md"
  step bench 120 "$PY" benchmarks/bench_speed.py --device cpu --size tiny --quick --models mlp --variants O2 --phases inference --budget-s 30 --out "$OUT/bench.md" --markdown-section cpu-dry-run
  step train 60 "$PY" examples/train.py --device cpu --steps 5
else
  step expecttest 20 bash -c "$(declare -f install_expecttest); install_expecttest"
  step pytest 240 bash -c "$(declare -f run_pytest); run_pytest 15 90 --cuda tests"
  # The two dtypes side by side (one GPU, 16 cores; about 100 s each alone).
  step zoo 150 bash -c '"$PY" tools/hf_zoo_cuda.py --device cuda --dtype fp16 --out "$OUT/zoo_fp16.md" > "$OUT/zoo_fp16.log" 2>&1 & a=$!; "$PY" tools/hf_zoo_cuda.py --device cuda --dtype bf16 --out "$OUT/zoo_bf16.md" > "$OUT/zoo_bf16.log" 2>&1; b=$?; wait $a && exit $b' 
  step bench 80 "$PY" benchmarks/bench_speed.py --device cuda --dtype bf16 --size realistic --rounds 15 --budget-s 65 --out "$OUT/bench.md" --markdown-section cuda-bf16
  step train 35 "$PY" examples/train.py --device cuda --steps 200
fi

for table in zoo_fp16 zoo_bf16 bench; do
  [ -f "$OUT/$table.md" ] && { echo; cat "$OUT/$table.md"; } >> "$SUMMARY"
done
echo >> "$SUMMARY"
echo "finished $(date -u +%FT%TZ); $([ $FAILED = 0 ] && echo 'every step passed' || echo 'some steps failed: see their logs')" >> "$SUMMARY"
cat "$SUMMARY"
exit $FAILED
