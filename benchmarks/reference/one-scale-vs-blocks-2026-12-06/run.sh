#!/bin/bash
# one scale vs blocks at 2 hosts 1 Gbit/s: where the one scale's extra time goes
set -u
cd /work/main
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--settings 2x1-1gbit --steps 400 --eval-every 25 --seeds 0 --worker-arg=--stop-after=30"
for R in 1 2; do
  echo "== round $R $(date +%T)"
  $P $C --out OUT/r$R/blocks --methods global_qsgd
  $P $C --out OUT/r$R/one --methods global_qsgd '--worker-arg=--compression-options={"block": null}'
done
$P $C --out OUT/floor --methods local,horovod_fp32
echo "== done $(date +%T)"
