#!/bin/bash
# Issue 54, after zo2.sh: does hvd_quant's fp32 path overlap with smaller buckets? (25 MB
# default buckets: the blocks' 12.6 MB are one bucket, ready only when block 0's gradients are.)
set -u
while pgrep -f "zo2.sh" >/dev/null; do sleep 10; done
cd /work/runs/s17/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--settings 2x1-1gbit --steps 400 --eval-every 20 --seeds 0 --worker-arg=--stop-after=40"
echo "== $(date)"
$P $C --out /work/runs/s17/overlap/C --methods horovod_fp32,local
for MB in 4 1; do
  $P $C --out /work/runs/s17/overlap/C-bucket$MB --methods none "--worker-arg=--optimizer-options={\"bucket_size_mb\": $MB}"
done
$P $C --out /work/runs/s17/overlap/C --methods none
echo "== done $(date)"
