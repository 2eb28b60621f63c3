#!/bin/bash
# Rounds 5 and 6 at 8 hosts, ef_sign only (after run3.sh left it at +4.8% over four pairs): round 5
# 25 MB first, round 6 4 MB first.
set -u
cd /work/main
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/buckets
pair() {  # round first-MB second-MB
  local C="--settings 8x1-1gbit --steps 400 --eval-every 100 --seeds 0 --worker-arg=--stop-after=15"
  for MB in $2 $3; do
    $P $C --out $O/8x1-1gbit/r$1/mb$MB --methods ef_sign "--worker-arg=--optimizer-options={\"bucket_size_mb\": $MB}"
  done
}
echo "== 8x1-1gbit round 5 $(date)"; pair 5 25 4
echo "== 8x1-1gbit round 6 $(date)"; pair 6 4 25
echo "== done $(date)"
