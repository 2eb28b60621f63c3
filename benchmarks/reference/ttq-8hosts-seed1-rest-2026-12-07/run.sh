#!/bin/bash
# Issue 51: a second seed at 8 hosts for qsgd and global_qsgd_exp at the defaults of 2026-12-07
# (a scale per 512 elements, five buckets), in the setting of ../ttq-8hosts-seed1-2026-12-07/
# (lr 5e-4, 200 steps, constant rate, seed 1), whose fp32 and global_qsgd curves they join:
# fp32's seed-1 loopback curve is copied from there into loss/. Curves on loopback (sums in a
# fixed order: deterministic), their first 25 steps timed on the cluster (bit for bit at step
# 25, or refused), Horovod fp32's step (25 steps) before and after as the anchor.
# Run from a clone of the commit under test, with the main .venv.
set -u
P="/work/main/.venv/bin/python benchmarks/time_to_quality.py"
O=${O:-/work/main/benchmarks/reference/ttq-8hosts-seed1-rest-2026-12-07}
git log --oneline -1
mkdir -p $O/loss/8x1-loopback
cp -n benchmarks/reference/ttq-8hosts-seed1-2026-12-07/loss/8x1-loopback/horovod_fp32_s1_constant.json $O/loss/8x1-loopback/
echo "== loss, 8x1 loopback, seed 1 $(date)"
$P --settings 8x1-loopback --steps 200 --eval-every 25 --resume --seeds 1 --out $O/loss --methods qsgd,global_qsgd_exp
S="--steps 25 --eval-every 25 --seeds 1"
echo "== anchor before: horovod_fp32, 25 steps $(date)"
$P --settings 8x1-1gbit $S --out $O/anchor-before --methods horovod_fp32
echo "== timing $(date)"
$P --settings 8x1-1gbit --steps 200 --eval-every 25 --resume --seeds 1 --time-curves $O/loss --out $O --methods qsgd,global_qsgd_exp
echo "== anchor after $(date)"
$P --settings 8x1-1gbit $S --out $O/anchor-after --methods horovod_fp32
echo "== done $(date)"
