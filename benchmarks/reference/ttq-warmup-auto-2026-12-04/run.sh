#!/bin/bash
# Issue 51, 2 hosts at 1 Gbit/s, lr 5e-4, warm-up schedule (linear to step 80, cosine to a tenth at 400), seed 0:
# auto, the one method the warm-up runs had left out, whole on the emulated cluster (its choice depends on the
# link it measures, so no loopback shortcut); then Horovod fp32's warm-up curve timed in the same session
# (--time-curves: its first steps on the cluster, bit for bit at step 25), the machine otherwise idle.
set -u
cd /work/runs/aw/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0 --schedule warmup"
O=/work/runs/aw
echo "== auto, whole on 2x1-1gbit $(date)"
$P --settings 2x1-1gbit $C --out $O --methods auto
echo "== timing, horovod_fp32's warm-up curve, 2x1-1gbit $(date)"
$P --settings 2x1-1gbit $C --time-curves $O/loss --out $O --methods horovod_fp32
echo "== done $(date)"
