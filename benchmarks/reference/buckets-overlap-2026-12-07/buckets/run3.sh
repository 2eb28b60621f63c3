#!/bin/bash
# Rounds 3 and 4 (a later session of 2026-12-07): the order run.sh did not vary. At 1 Gbit/s each
# method runs 4 MB then 25 MB back to back (rounds 1 and 2 ran every 25 MB before every 4 MB); at
# 8 hosts round 3 runs 25 MB first and round 4 4 MB first, as round 1 and round 2 did.
set -u
cd /work/main
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/buckets
pair() {  # setting steps round method first-MB second-MB
  local C="--settings $1 --steps 400 --eval-every 100 --seeds 0 --worker-arg=--stop-after=$2"
  for MB in $5 $6; do
    $P $C --out $O/$1/r$3/mb$MB --methods $4 "--worker-arg=--optimizer-options={\"bucket_size_mb\": $MB}"
  done
}
for R in 3 4; do
  echo "== 2x1-1gbit round $R $(date)"
  for M in none fp16 ef_sign global_qsgd marsit; do pair 2x1-1gbit 30 $R $M 4 25; done
  $P --settings 2x1-1gbit --steps 400 --eval-every 100 --seeds 0 --worker-arg=--stop-after=30 \
     --out $O/2x1-1gbit/r$R/base --methods horovod_fp32,local
done
echo "== 8x1-1gbit round 3 $(date)"
for M in ef_sign global_qsgd; do pair 8x1-1gbit 15 3 $M 25 4; done
echo "== 8x1-1gbit round 4 $(date)"
for M in ef_sign global_qsgd; do pair 8x1-1gbit 15 4 $M 4 25; done
echo "== done $(date)"
