#!/bin/bash
# Issue 51: Marsit against cascading_sign at 4 ranks, at the defaults of 2026-12-07 (buckets that
# follow the model's size: five of it), in the setting of ../ttq-4ranks-2026-12-03/ (lr 5e-4,
# 400 steps, constant rate, seed 0). Horovod fp32's loopback curve is that folder's (the
# buckets are hvd_quant's; Horovod's fp32 does not have them), copied into loss/ and checked
# again bit for bit at step 25 by the timing below. Then every curve's first steps timed on 4
# emulated hosts at 1 Gbit/s, one job after the other: Marsit's time against fp32's.
# Run from a clone of the commit under test, with the main .venv.
set -u
P="/work/main/.venv/bin/python benchmarks/time_to_quality.py"
O=${O:-/work/main/benchmarks/reference/ttq-4ranks-defaults-2026-12-07}
git log --oneline -1
mkdir -p $O/loss/4x1-loopback
cp -n benchmarks/reference/ttq-4ranks-2026-12-03/4x1-loopback/horovod_fp32_s0_constant.json $O/loss/4x1-loopback/
echo "== loss, 4x1 loopback $(date)"
$P --settings 4x1-loopback --steps 400 --eval-every 25 --resume --seeds 0 --out $O/loss --methods horovod_fp32,marsit,cascading_sign
echo "== timing, 4x1-1gbit $(date)"
$P --settings 4x1-1gbit --steps 400 --eval-every 25 --resume --seeds 0 --time-curves $O/loss --out $O --methods horovod_fp32,marsit,cascading_sign
echo "== done $(date)"
