#!/bin/bash
# 400 steps at 8 hosts: does BinSGDM under the warm-up schedule reach fp32's best (constant)?
set -u
cd /work/runs/b8/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0"
O=/work/runs/b8/s400
echo "== binsgdm 0.8 8x1 loopback warmup 400 $(date)"
$P --settings 8x1-loopback $C --schedule warmup --out $O/loss --methods binsgdm
echo "== horovod_fp32 whole on the cluster, constant 400 $(date)"
$P --settings 8x1-1gbit $C --schedule constant --out $O --methods horovod_fp32
echo "== timing binsgdm warmup 400 $(date)"
$P --settings 8x1-1gbit $C --schedule warmup --time-curves $O/loss --out $O --methods binsgdm
echo "== done $(date)"
