#!/bin/bash
# Is BinSGDM's larger gap at 8 ranks the number of ranks or the global batch?
# 2 ranks with 4x the windows per rank (32): the global batch of 8 ranks x 8, 200 steps, loss only (loopback).
set -u
cd /work/runs/b4x/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--settings 2x1-loopback --steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --worker-arg=--batch=32 --resume --seeds 0"
O=/work/runs/b4x
echo "== fp32 and binsgdm (0.8) $(date)"
$P $C --out $O/loss --methods horovod_fp32,binsgdm
echo "== binsgdm 0.9 $(date)"
$P $C --out $O/beta0.9 --methods binsgdm '--worker-arg=--optimizer-options={"beta": 0.9}'
echo "== nobits (beta 0.9) $(date)"
PYTHONPATH=/work/runs/b4x/src/benchmarks/reference/ttq-binsgdm-2026-12-05 $P $C --out $O/nobits --methods horovod_fp32 --worker-arg=--base-optimizer=nobits:normalised_momentum
echo "== done $(date)"
