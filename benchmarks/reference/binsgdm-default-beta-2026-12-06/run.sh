#!/bin/bash
# Issue 51 (2026-12-06): BinSGDM's default beta changed from 0.9 to 0.8. What ran, in order,
# from clones of the repository (root, for the cluster). Losses do not depend on timing, so
# the loopback runs shared the machine (several side by side: this script gathers their
# commands); the cluster timing ran alone.
# $OLD: a clone of e54df9c (default beta 0.9); $NEW: the same with the change (default 0.8).
set -eu
OUT=${OUT:-$(cd "$(dirname "$0")" && pwd)}
P=".venv/bin/python benchmarks/time_to_quality.py"
W="--settings 2x1-loopback --steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume"
cd "$OLD"
# BinSGDM at 0.8 (given explicitly) under the warm-up schedule on seeds 0, 3 and 1.
$P $W --out $OUT/runs/warmup-beta0.8 --seeds 0,3,1 --schedule warmup --methods binsgdm \
    '--worker-arg=--optimizer-options={"beta": 0.8}'
# On this host: Adam under the warm-up on seeds 1 and 3, BinSGDM at 0.9 (then the default)
# at a constant rate on seeds 0, 2 and 3 and under the warm-up on seeds 1 and 3.
$P $W --out $OUT/runs/adam-warmup --seeds 1,3 --schedule warmup --methods horovod_fp32
$P $W --out $OUT/runs/constant-beta0.9 --seeds 0,2,3 --schedule constant --methods binsgdm
$P $W --out $OUT/runs/warmup-beta0.9 --seeds 1,3 --schedule warmup --methods binsgdm
cd "$NEW"
# BinSGDM at the new default at a constant rate on seeds 1 to 3, on this host.
$P $W --out $OUT/runs/constant-beta0.8 --seeds 1,2,3 --schedule constant --methods binsgdm
# The byte-level LM of the convergence page at the new default (no --beta).
.venv/bin/python benchmarks/convergence.py --workloads lm_torch --np 2 3 --optimizers binsgdm \
    --variant "binsgdm+lr3e-3=--lr 3e-3" --out $OUT/convergence/conv.json
# Seed 0 at the new default and Adam, both schedules: loss on loopback, then alone on the
# cluster their first steps, at 1 Gbit/s and 100 Mbit/s.
$P $W --seeds 0 --schedule constant,warmup --out $OUT/loss --methods binsgdm,horovod_fp32
$P --settings 2x1-1gbit,2x1-100mbit --steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume \
    --seeds 0 --schedule constant,warmup --time-curves $OUT/loss --out $OUT --methods horovod_fp32,binsgdm
# Then: .venv/bin/python benchmarks/reference/binsgdm-default-beta-2026-12-06/beta.py (the tables).
