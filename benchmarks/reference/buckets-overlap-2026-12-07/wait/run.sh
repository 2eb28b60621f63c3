#!/bin/bash
# Does the bucket worker's spinning wait slow backward on a one-core host? (issue 54: hq's fp32 path behind Horovod)
set -u
cd /work/main
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--settings 2x1-1gbit --steps 400 --eval-every 25 --seeds 0 --worker-arg=--stop-after=40"
O=/work/runs/wait
for R in 1 2; do
  echo "== round $R $(date)"
  $P $C --out $O/r$R/base --methods horovod_fp32,local
  for W in spin sleep; do
    for MB in 25 4; do
      HVD_QUANT_WAIT=$W $P $C --out $O/r$R/$W-$MB --methods none "--worker-arg=--optimizer-options={\"bucket_size_mb\": $MB}"
    done
  done
done
echo "== done $(date)"
