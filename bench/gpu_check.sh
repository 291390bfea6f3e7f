#!/usr/bin/env bash
# The one-command GPU check: on a machine with a CUDA GPU and a CUDA build of
# torch (no network needed), from the repository root,
#
#     bash bench/gpu_check.sh [OUT]        # OUT: gpu-check (default), from where it runs
#
# builds pyddp from this checkout (pip --no-build-isolation --no-deps: the
# build tools must be installed, as the README's build from source says),
# then runs `python -m pyddp.doctor`, its `--selftest`, `tests/test_gpu.py`
# and bench/gpu_step.py (plain vs 1 and 2 replicas on one GPU, eager,
# compiled and captured: step, host and GPU busy ms), each stage under a time
# limit of its own and the whole check under GPU_CHECK_LIMIT_S seconds (300
# unless set): a stage gets at most what is left of that, so the check ends
# in time even where a stage hangs. It ends with a summary that fits a bug
# report: OUT/summary.txt (every stage's log is beside it). bench/gpu_step.py
# prints each row as it is measured, so a timing stage cut off keeps them.
#
# `--dry-run` (CI, no GPU): the same stages on the CPU at toy sizes, without
# the build (the installed pyddp) and without the GPU tests, to check that the
# script and the bench still run; its figures mean nothing.
set -uo pipefail

dry=0
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
fi
out="${1:-gpu-check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"            # OUT as given, from where it was run
cd "$(dirname "$0")/.."               # the checkout: pip builds it, pytest runs its tests
# Ctrl-C stops the whole check, not only the stage running (see stage()).
trap 'echo "interrupted: the check stopped at $(tail -1 "$out/progress.log" 2>/dev/null)"; exit 130' INT TERM
summary="$out/summary.txt"
: >"$summary"
failed=0
py="${PYTHON:-python}"
limit_total="${GPU_CHECK_LIMIT_S:-300}"
case "$limit_total" in '' | *[!0-9]*)
  echo "GPU_CHECK_LIMIT_S must be a whole number of seconds, not '$limit_total'" >&2
  exit 2 ;;
esac

# stage NAME LIMIT_S COMMAND...: runs COMMAND into OUT/NAME.log, notes its
# exit status and duration in the summary (124: it ran past its limit).
stage() {
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS rc left=$((limit_total - SECONDS))
  if [ "$left" -lt 5 ]; then
    failed=$((failed + 1))
    printf '%-10s rc=%-3s %4ss  %s\n' "$name" skip 0 "not run: the check's ${limit_total} s were spent" >>"$summary.stages"
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name (at most ${limit} s): $*" | tee -a "$out/progress.log"
  # --foreground: the stage stays in this script's process group, so a
  # Ctrl-C reaches it (timeout would otherwise put it in a group of its own).
  # -k 10: a stage that ignores the TERM is killed 10 s later.
  timeout --foreground -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  if [ "$rc" -eq 130 ]; then  # the stage died of a Ctrl-C (timeout reports it as 130)
    echo "interrupted in stage $name: the check stopped there" | tee "$summary"
    cat "$summary.stages" >>"$summary" && rm -f "$summary.stages"
    exit 130
  fi
  [ "$rc" -ne 0 ] && failed=$((failed + 1))
  printf '%-10s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - start))" "$*" >>"$summary.stages"
  return 0
}

: >"$summary.stages"
if [ "$dry" -eq 0 ]; then
  stage build 180 "$py" -m pip install --no-build-isolation --no-deps .
fi
stage doctor 60 "$py" -m pyddp.doctor
if [ "$dry" -eq 0 ]; then
  stage selftest 60 "$py" -m pyddp.doctor --selftest
  stage test_gpu 150 "$py" -m pytest -q -p no:cacheprovider -o addopts= -m "cuda or not cuda" tests/test_gpu.py
  stage timing 420 "$py" bench/gpu_step.py --profile --out "$out/gpu_step.json"
else
  stage timing 120 "$py" bench/gpu_step.py --device cpu --quick --profile --out "$out/gpu_step.json"
fi

{
  echo "# pyddp GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (modified)')"
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| GPUs", torch.cuda.device_count(), *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))' 2>&1
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo
  echo "## stages (rc 0: passed; 124: past its time limit)"
  cat "$summary.stages"
  echo
  echo "## doctor"
  grep -iE "hot path|nccl|nvrtc|driver|device|kernel" "$out/doctor.log" | head -20
  if [ -f "$out/selftest.log" ]; then
    echo
    echo "## selftest"
    tail -12 "$out/selftest.log"
  fi
  if [ -f "$out/test_gpu.log" ]; then
    echo
    echo "## tests/test_gpu.py"
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/test_gpu.log" | tail -15
  fi
  echo
  echo "## timing (bench/gpu_step.py)"
  if grep -qs '^ *model ' "$out/timing.log"; then
    sed -n '/^ *model /,/^results:/p' "$out/timing.log"
  else  # cut off before its table: the rows it measured
    grep -s '^measured:' "$out/timing.log"
  fi
  for name in build doctor selftest test_gpu timing; do
    if grep -qE "^$name .*rc=([1-9]|skip)" "$summary.stages"; then
      echo
      echo "## $name failed: the end of its log"
      tail -25 "$out/$name.log" 2>/dev/null || echo "(no log: it did not run)"
    fi
  done
} >"$summary" 2>&1
rm -f "$summary.stages"
cat "$summary"
exit $((failed > 0))
