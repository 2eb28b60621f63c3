#!/bin/bash
# Issue 54: how much of Horovod fp32's allreduce hides behind backward at 2 hosts and 1 Gbit/s
# (the "does it pay" line times fp32's reduction whole). 40 steps each, two rounds, alone on
# the machine: Horovod fp32 (overlaps), hq fp32 with overlap (default) and without, and the
# step without communication (local).
set -u
while pgrep -f "zo.sh" >/dev/null; do sleep 10; done
cd /work/runs/s17/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--settings 2x1-1gbit --steps 400 --eval-every 20 --seeds 0 --worker-arg=--stop-after=40"
for R in A B; do
  echo "== round $R $(date)"
  $P $C --out /work/runs/s17/overlap/$R --methods horovod_fp32,none,local
  $P $C --out /work/runs/s17/overlap/$R-no-overlap --methods none '--worker-arg=--optimizer-options={"overlap": false}'
done
echo "== done $(date)"
