#!/usr/bin/env bash
# The simulated-GPU tier N times in a row (default 5) beside a loaded machine:
# the multi-process tier and the CPU engine tests, each in a loop. Prints each
# run's result and the 1-minute load average sampled every 30 s. Counts of
# host waits and deadlines in these tests must not depend on the load.
#
#     bash tests/simgpu/under_load.sh [RUNS]
set -uo pipefail
cd "$(dirname "$0")/../.."
runs=${1:-5}
out=$(mktemp -d)
stop="$out/stop"
load() { while [ ! -f "$stop" ]; do "$@" >>"$out/load.log" 2>&1; done; }
load python -m pytest -q -m multiprocess -p no:cacheprovider &
load python -m pytest -q tests/test_engine.py tests/test_equivalence.py tests/test_cpu_backend.py -p no:cacheprovider &
(while [ ! -f "$stop" ]; do cut -d' ' -f1 /proc/loadavg >>"$out/loadavg"; sleep 30; done) &
stop_load() {
  touch "$stop"
  for pid in $(jobs -p); do
    pkill -TERM -P "$pid" 2>/dev/null  # the loop's current pytest
    kill "$pid" 2>/dev/null
  done
}
trap stop_load EXIT
sleep 20
failed=0
for i in $(seq "$runs"); do
  start=$SECONDS
  python -m pytest -q -m simgpu -p no:cacheprovider >"$out/simgpu.$i.log" 2>&1 || failed=1
  echo "run $i: $((SECONDS - start)) s: $(tail -1 "$out/simgpu.$i.log")"
done
stop_load
echo "1-minute load average (every 30 s): $(sort -n "$out/loadavg" | tr '\n' ' ')"
echo "logs: $out"
exit $failed
