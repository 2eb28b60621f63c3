#!/bin/bash
# Issue 51 at 8 hosts, lr 5e-4 (the chosen rate), 200 steps, freeze_step 40 (a fifth), seed 0.
# 1. loss curves on loopback; 2. Horovod fp32 whole on the cluster (the shortcut refuses it at
# 8 ranks: Horovod's sum order differs between runs); 3. the loopback curves' steps timed there.
set -u
cd /work/runs/h8/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0"
O=/work/runs/h8
M=onebit_adam,zero_one_adam,global_qsgd_exp,binsgdm,global_qsgd,fp16
echo "== loss, 8x1 loopback $(date)"
$P --settings 8x1-loopback $C --out $O/loss --methods $M
echo "== wait for the machine to be quiet $(date)"
while [ -e /work/runs/h8/hold ]; do sleep 15; done
echo "== horovod_fp32 whole on the cluster $(date)"
$P --settings 8x1-1gbit $C --out $O --methods horovod_fp32
echo "== timing $(date)"
$P --settings 8x1-1gbit $C --time-curves $O/loss --out $O --methods $M
echo "== local (compute floor) $(date)"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --resume --seeds 0 --out $O/floor --methods local
echo "== done $(date)"
