#!/bin/bash
# BinSGDM's rule without its bits (../ttq-binsgdm-2026-12-05/nobits.py, beta 0.9) at 8 ranks:
# is the 8-host gap the rule's or the bits'? Loss only, on loopback.
set -u
cd /work/runs/b8/src
echo "== nobits 8x1 loopback constant 200 $(date)"
PYTHONPATH=/work/runs/b8/src/benchmarks/reference/ttq-binsgdm-2026-12-05 .venv/bin/python benchmarks/time_to_quality.py \
    --settings 8x1-loopback --steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 \
    --out /work/runs/b8/nobits --methods horovod_fp32 --worker-arg=--base-optimizer=nobits:normalised_momentum
echo "== done $(date)"
