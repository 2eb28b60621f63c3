#!/bin/bash
# Issue 51, after overlap.sh: 0/1 Adam with every step before its freeze a full round
# (var_update_scaler >= var_freeze_step): at freeze 160 under the warm-up schedule, and at
# freeze 80 under the constant lr (does it cost there what it saves under the warm-up?).
set -u
while pgrep -f "overlap.sh" >/dev/null; do sleep 10; done
cd /work/runs/s17/src
P=".venv/bin/python benchmarks/time_to_quality.py"
W="--settings 2x1-loopback --steps 400 --eval-every 25 --seeds 0 --resume"
echo "== freeze 160, scaler 256, warm-up $(date)"
$P $W --schedule warmup --worker-arg=--freeze-step=160 '--worker-arg=--optimizer-options={"var_update_scaler": 256}' \
   --out /work/runs/s17/zo-scaler256-freeze160 --methods zero_one_adam
echo "== freeze 80, scaler 128, constant $(date)"
$P $W --schedule constant --worker-arg=--freeze-step=80 '--worker-arg=--optimizer-options={"var_update_scaler": 128}' \
   --out /work/runs/s17/zo-scaler128 --methods zero_one_adam
echo "== done $(date)"
