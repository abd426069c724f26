#!/usr/bin/env bash
# One device call: GPU tests and the chosen benchmarks, results packed for the trip back.
# Usage (on the GPU machine, from the repo root): bash bench/run_h200.sh [tests] [prefill] [decode] [generate] ...
set -uo pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jaxflash_out}; mkdir -p "$OUT"
LOG="$OUT/log.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee -a "$LOG"
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$LOG"
  case "$step" in
    tests) python3 -m pytest -q -m gpu -x -p no:cacheprovider tests 2>&1 | tail -n 60 | tee -a "$LOG" ;;
    tests-all) python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -n 80 | tee -a "$LOG" ;;
    prefill|decode|generate) python3 "bench/$step.py" ${BENCH_ARGS:-} 2>&1 | tail -n 80 | tee -a "$LOG" ;;
    *) eval "$step" 2>&1 | tail -n 80 | tee -a "$LOG" ;;
  esac
done
tar czf "$OUT/results.tar.gz" bench/results 2>/dev/null
echo "=== done $(date -u +%H:%M:%S)" | tee -a "$LOG"
