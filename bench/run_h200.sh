#!/usr/bin/env bash
# Runs the compiled GPU tests and the chosen benchmarks in order, appending each step's output
# to $OUT/log.txt, then packs bench/results into $OUT/results.tar.gz.
# Usage, from the repository root of a GPU machine:
#   bash bench/run_h200.sh [tests] [tests-all] [prefill] [decode] [generate] [generate_tp] [profile_step] ['any command']
# tests stops at the first failure, tests-all runs them all; a benchmark runs as
# `python3 -m bench.<name> $BENCH_ARGS` and writes bench/results/h200/<name>.{json,md,png}.
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
    prefill|decode|generate|generate_tp|profile_step)
      python3 -m "bench.$step" ${BENCH_ARGS:-} 2>&1 | tail -n 80 | tee -a "$LOG" ;;
    *) eval "$step" 2>&1 | tail -n 80 | tee -a "$LOG" ;;
  esac
done
tar czf "$OUT/results.tar.gz" bench/results 2>/dev/null
echo "=== done $(date -u +%H:%M:%S)" | tee -a "$LOG"
