#!/bin/bash
# Issue 51: where 0/1 Adam's extra gap under the warm-up schedule comes from (warm-up + cosine,
# var_freeze_step 80 unless said): (1) no 1-bit rounds before the freeze (var_update_scaler 128:
# every Phase-A step a full round); (2) one rank, where nothing is compressed (0/1 Adam and
# 1-bit Adam are then Adam with their variance schedules and freeze), beside Adam; (3) the
# freeze-240 run that an earlier script lost.
set -u
while pgrep -f "sched.sh" >/dev/null; do sleep 10; done
cd /work/runs/s17/src
P=".venv/bin/python benchmarks/time_to_quality.py"
W="--steps 400 --eval-every 25 --seeds 0 --schedule warmup --resume"
echo "== scaler 128 $(date)"
$P --settings 2x1-loopback $W --worker-arg=--freeze-step=80 '--worker-arg=--optimizer-options={"var_update_scaler": 128}' \
   --out /work/runs/s17/zo-scaler128 --methods zero_one_adam
echo "== one rank $(date)"
$P --settings 1x1-loopback $W --worker-arg=--freeze-step=80 --out /work/runs/s17/one-rank \
   --methods horovod_fp32,zero_one_adam,onebit_adam
echo "== freeze 240 $(date)"
$P --settings 2x1-loopback $W --worker-arg=--freeze-step=240 --out /work/runs/s17/freeze240 --methods zero_one_adam
echo "== done $(date)"
