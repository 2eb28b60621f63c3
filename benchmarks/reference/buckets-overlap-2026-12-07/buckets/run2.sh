#!/bin/bash
# Round 2 at 100 Mbit/s and 8 hosts (after run.sh).
set -u
cd /work/main
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/buckets
one() {  # setting steps round extra-base methods
  local S=$1 N=$2 R=$3
  local C="--settings $S --steps 400 --eval-every 100 --seeds 0 --worker-arg=--stop-after=$N"
  echo "== $S round $R $(date)"
  for MB in 4 25; do
    $P $C --out $O/$S/r$R/mb$MB --methods $5 "--worker-arg=--optimizer-options={\"bucket_size_mb\": $MB}"
  done
  $P $C --out $O/$S/r$R/base --methods horovod_fp32${4:-}
}
one 8x1-1gbit 15 2 "" ef_sign,global_qsgd
one 2x1-100mbit 15 2 "" none,ef_sign,global_qsgd
echo "== done $(date)"
