#!/bin/bash
# After run.sh: the warm-up schedule at 8 hosts, fp32 whole on the cluster (alone), BinSGDM
# at its default (0.8) on loopback, then BinSGDM's steps timed on the cluster.
set -u
while ! grep -q "== done" /work/runs/b8/run.log; do sleep 20; done
cd /work/runs/b8/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --schedule warmup"
O=/work/runs/b8
echo "== binsgdm 0.8 8x1 loopback warmup $(date)"
$P --settings 8x1-loopback $C --out $O/loss --methods binsgdm
echo "== horovod_fp32 whole on the cluster, warmup $(date)"
$P --settings 8x1-1gbit $C --out $O --methods horovod_fp32
echo "== timing binsgdm warmup $(date)"
$P --settings 8x1-1gbit $C --time-curves $O/loss --out $O --methods binsgdm
echo "== done $(date)"
