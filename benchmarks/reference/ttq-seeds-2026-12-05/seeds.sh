#!/bin/bash
# Issue 51, after CI: seeds 2 and 3 (constant lr 5e-4, 2 ranks, loopback, 400 steps) for the
# methods whose seed-0 gap sits near the 3% target (BinSGDM +4.2%, qsgd +3.9%, global_qsgd
# +0.6%) and their twin, Horovod fp32; then qsgd on seed 1. Losses only.
set -u
while pgrep -f "scripts/test.sh --full" >/dev/null; do sleep 15; done
cd /work/runs/s17/src
P=".venv/bin/python benchmarks/time_to_quality.py"
W="--settings 2x1-loopback --steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --out /work/runs/s17/seeds"
for S in 2 3; do
  echo "== seed $S $(date)"
  $P $W --seeds $S --methods horovod_fp32,binsgdm,qsgd,global_qsgd
done
echo "== qsgd seed 1 $(date)"
$P $W --seeds 1 --methods qsgd
echo "== done $(date)"
