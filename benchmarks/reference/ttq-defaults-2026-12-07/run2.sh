#!/bin/bash
# Round 2: the same first steps timed again in the reverse order (steps of one kind timed
# twice in a session differ by up to 13% on this machine), then auto whole on the cluster
# (its choice depends on the link, so its curve is its own at each rate).
set -u
cd /work/main
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume"
O=/work/runs/r31
M=qsgd,cascading_sign,global_qsgd_exp,global_qsgd,onebit,marsit,ef_sign,fp16,horovod_fp16,horovod_fp32
echo "== timing round 2, reverse order $(date)"
$P --settings 2x1-1gbit,2x1-100mbit $C --seeds 0 --time-curves $O/out/loss --out $O/out2 --methods $M
echo "== auto, whole on the cluster $(date)"
$P --settings 2x1-1gbit,2x1-100mbit $C --seeds 0 --out $O/out --methods auto
echo "== done $(date)"
