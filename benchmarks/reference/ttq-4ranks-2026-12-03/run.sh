#!/bin/bash
# Issue 51: Marsit against cascading_sign (its sign-sum twin without the ring's bitwise
# selection) at 4 ranks, beside Horovod fp32: loss only, on loopback (deterministic), lr 5e-4.
set -u
cd <a clone of ae16557>
echo "== loss, 4 ranks $(date)"
.venv/bin/python benchmarks/time_to_quality.py --settings 4x1-loopback --steps 400 --eval-every 25 --seeds 0 --resume \
    --out <this folder> --methods horovod_fp32,marsit,cascading_sign
echo "== done $(date)"
