#!/bin/bash
# The "does it pay" line against measured step times at the defaults of 2026-12-07 (five
# buckets of the time-to-quality LM), the protocol of ../monitoring-2026-12-02/verdict-c/:
# each method 120 steps (its line at step 100, from steps 50-99; no evaluation inside),
# Horovod fp32 30 steps before and after the methods, in one session, nothing else running.
# Run from a clone of the commit under test, with the main .venv:
#   cd CLONE && bash /work/main/benchmarks/reference/verdict-defaults-2026-12-07/run.sh [OUT]
# Round 1 (b16dcb3, the line before its range) wrote here; round 2 (the line with it) to round2/.
set -x
OUT=${1:-/work/main/benchmarks/reference/verdict-defaults-2026-12-07}
PY=/work/main/.venv/bin/python
git log --oneline -1
# a few steps first, so that the clone's kernels are compiled before anything is timed
$PY benchmarks/time_to_quality.py --settings 2x1-loopback --methods ef_sign,global_qsgd --steps 3 --eval-every 3 --out /tmp/vbench-warm
for s in 2x1-1gbit 2x1-100mbit 8x1-1gbit; do
  $PY benchmarks/time_to_quality.py --settings $s --methods horovod_fp32 --steps 30 --eval-every 30 --out $OUT/fp32-before
  $PY benchmarks/time_to_quality.py --settings $s --methods ef_sign,global_qsgd --steps 120 --eval-every 120 --out $OUT
  $PY benchmarks/time_to_quality.py --settings $s --methods horovod_fp32 --steps 30 --eval-every 30 --out $OUT/fp32-after
done
