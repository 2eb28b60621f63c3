#!/bin/bash
# Issue 51: a second seed at 8 hosts, losses only (loopback, deterministic sums), for fp32 and
# global_qsgd at the defaults of 2026-12-07, in the setting of ../ttq-8hosts-2026-12-03/
# (lr 5e-4, 200 steps, constant rate). Seed 1 changes the initial weights and every rank's
# training windows; the validation windows stay. Is global_qsgd's +0.8% on seed 0 a gap or a tie?
# Run from a clone of the commit under test, with the main .venv.
set -u
P="/work/main/.venv/bin/python benchmarks/time_to_quality.py"
O=${O:-/work/main/benchmarks/reference/ttq-8hosts-seed1-2026-12-07}
git log --oneline -1
echo "== loss, 8x1 loopback, seed 1 $(date)"
$P --settings 8x1-loopback --steps 200 --eval-every 25 --resume --seeds 1 --out $O/loss --methods horovod_fp32,global_qsgd
echo "== done $(date)"
# 2. (added after 1 showed global_qsgd level with fp32 on seed 1) global_qsgd's first 25 steps
#    timed on the cluster (bit for bit equal at step 25, or refused), with Horovod fp32's step
#    (25 steps) before and after as the anchor; fp32's curve is the loopback one of 1.
S="--steps 25 --eval-every 25 --seeds 1"
echo "== anchor before: horovod_fp32, 25 steps $(date)"
$P --settings 8x1-1gbit $S --out $O/anchor-before --methods horovod_fp32
echo "== timing $(date)"
$P --settings 8x1-1gbit --steps 200 --eval-every 25 --resume --seeds 1 --time-curves $O/loss --out $O --methods global_qsgd
echo "== anchor after $(date)"
$P --settings 8x1-1gbit $S --out $O/anchor-after --methods horovod_fp32
echo "== done timing $(date)"
# 3. (added after 2) fp16 on seed 1, whole on the cluster (its sums at 8 ranks are not the same
#    bits from run to run, so no loopback shortcut), and Horovod fp32's step once more after it.
echo "== fp16 whole, seed 1 $(date)"
$P --settings 8x1-1gbit --steps 200 --eval-every 25 --resume --seeds 1 --out $O/whole --methods fp16
echo "== anchor after fp16 $(date)"
$P --settings 8x1-1gbit $S --out $O/anchor-after-fp16 --methods horovod_fp32
echo "== done fp16 $(date)"
