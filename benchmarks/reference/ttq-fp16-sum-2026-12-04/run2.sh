#!/bin/bash
# After run.sh: Horovod fp16 whole on the 8-host cluster (200 steps): its fp16 sums at 8 ranks are not
# reproducible bit for bit between runs (see README), so its curve with the fast sum is run whole.
set -u
cd /work/runs/fp16fix/src
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/fp16fix
echo "== horovod_fp16 whole, 8x1-1gbit $(date)"
$P --settings 8x1-1gbit --steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --out $O/whole --methods horovod_fp16
echo "== done $(date)"
