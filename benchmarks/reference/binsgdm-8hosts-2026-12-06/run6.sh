#!/bin/bash
# Seeds 1 and 2 of BinSGDM (default beta 0.8) and Horovod fp32 at the same global batch two ways:
# 2 ranks x 32 windows and 8 ranks x 8 windows, 200 steps, constant lr, loss only (loopback).
set -u
cd /work/runs/b4x/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --methods horovod_fp32,binsgdm"
O=/work/runs/b4x
for s in 1 2; do
    echo "== seed $s: 2 ranks x 32 $(date)"
    $P --settings 2x1-loopback --seeds $s $C --worker-arg=--batch=32 --out $O/loss
    echo "== seed $s: 8 ranks x 8 $(date)"
    $P --settings 8x1-loopback --seeds $s $C --out $O/seeds8
done
echo "== done $(date)"
