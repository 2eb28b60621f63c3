#!/bin/bash
set -u
cd /work/runs/b8/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0"
O=/work/runs/b8
echo "== binsgdm 0.8 (default) 8x1 loopback constant $(date)"
$P --settings 8x1-loopback $C --out $O/loss --methods binsgdm
echo "== binsgdm 0.9 8x1 loopback constant $(date)"
$P --settings 8x1-loopback $C --out $O/runs/beta0.9 --methods binsgdm '--worker-arg=--optimizer-options={"beta": 0.9}'
echo "== timing 8x1-1gbit $(date)"
$P --settings 8x1-1gbit $C --time-curves $O/loss --out $O --methods binsgdm
echo "== done $(date)"
