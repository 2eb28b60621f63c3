#!/bin/bash
# Issue 54/51: hq's default 25 MB buckets against 4 MB, per method, beside Horovod fp32 and the compute floor.
set -u
cd /work/main
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/buckets
one() {  # setting steps round
  local S=$1 N=$2 R=$3
  local C="--settings $S --steps 400 --eval-every 100 --seeds 0 --worker-arg=--stop-after=$N"
  echo "== $S round $R $(date)"
  $P $C --out $O/$S/r$R/base --methods horovod_fp32${4:-}
  for MB in 25 4; do
    $P $C --out $O/$S/r$R/mb$MB --methods $5 "--worker-arg=--optimizer-options={\"bucket_size_mb\": $MB}"
  done
}
one 2x1-1gbit 30 1 ,local none,fp16,ef_sign,global_qsgd,marsit
one 2x1-100mbit 15 1 "" none,ef_sign,global_qsgd
one 2x1-1gbit 30 2 ,local none,fp16,ef_sign,global_qsgd,marsit
one 8x1-1gbit 15 1 "" ef_sign,global_qsgd
echo "== done $(date)"
