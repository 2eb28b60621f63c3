#!/bin/bash
# Issue 51 at 8 hosts, lr 5e-4, 200 steps, freeze_step 40, seed 0: the rows the first 8-host run left out.
# 1. loss curves on loopback (ours only: deterministic sums); 2. fp16 rows whole on the cluster
# (they sum in Horovod's allreduce, whose order differs between runs at 8 ranks); 3. the loopback curves timed there.
set -u
cd /work/runs/h8b/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0"
O=/work/runs/h8b
M=marsit,cascading_sign,qsgd,ef_sign
echo "== loss, 8x1 loopback $(date)"
$P --settings 8x1-loopback $C --out $O/loss --methods $M
echo "== wait for the machine to be quiet $(date)"
while [ -e /work/runs/h8b/hold ]; do sleep 15; done
echo "== fp16 rows whole on the cluster $(date)"
$P --settings 8x1-1gbit $C --out $O --methods fp16,horovod_fp16
echo "== timing $(date)"
$P --settings 8x1-1gbit $C --time-curves $O/loss --out $O --methods $M
echo "== done $(date)"
