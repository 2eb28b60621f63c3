#!/bin/bash
# After run.sh: same-session anchors on the same cluster, 25 steps each: Horovod fp32's step
# (the first 8-host run's fp32 was timed in another session) and the compute floor.
set -u
cd /work/runs/h8b/src
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/h8b
while ! grep -q "^== done" $O/run.log; do sleep 20; done
echo "== anchors: horovod_fp32 and local, 25 steps, 8x1-1gbit $(date)"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --out $O/anchor --methods horovod_fp32,local
echo "== done $(date)"
