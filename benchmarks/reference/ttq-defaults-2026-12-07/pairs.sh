#!/bin/bash
# The 1-bit compressors whose steps were slower than on 2026-12-03 (marsit, onebit,
# cascading_sign): the default bucket (five of this model) against bucket_size_mb=25 (two),
# back to back in the same session, both orders, 30 steps each.
set -u
cd /work/main
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/r31/pairs
run() {  # setting round method size(default|25)
  local C="--settings $1 --steps 400 --eval-every 100 --seeds 0 --worker-arg=--stop-after=30"
  if [ "$4" = default ]; then $P $C --out $O/$1/r$2/$4 --methods $3
  else $P $C --out $O/$1/r$2/mb$4 --methods $3 "--worker-arg=--optimizer-options={\"bucket_size_mb\": $4}"; fi
}
for S in 2x1-100mbit 2x1-1gbit; do
  for M in marsit onebit cascading_sign; do
    echo "== $S $M $(date)"
    run $S 1 $M default; run $S 1 $M 25
    run $S 2 $M 25; run $S 2 $M default
  done
done
echo "== done $(date)"
