#!/bin/bash
# Issue 51 at 8 hosts and 1 Gbit/s at the defaults of 2026-12-07 (five buckets of the
# time-to-quality LM; a scale or norm per 512 elements for global_qsgd and qsgd): the rows
# whose curves the buckets move, as in ../ttq-8hosts-2026-12-03/ (lr 5e-4, 200 steps,
# seed 0, constant rate): 1. loss curves on loopback (deterministic sums); 2. their first
# 25 steps timed on the cluster, with Horovod fp32's step (25 steps) before and after them
# as the session's anchor (its curve is 2026-12-03's, ../ttq-8hosts-2026-12-03/).
# Run from a clone of the commit under test, with the main .venv.
set -u
P="/work/main/.venv/bin/python benchmarks/time_to_quality.py"
C="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0"
O=/work/main/benchmarks/reference/ttq-8hosts-defaults-2026-12-07
M=${M:-global_qsgd,global_qsgd_exp,qsgd}
git log --oneline -1
echo "== loss, 8x1 loopback: $M $(date)"
$P --settings 8x1-loopback $C --out $O/loss --methods $M
echo "== anchor before: horovod_fp32, 25 steps $(date)"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --seeds 0 --out $O/anchor-before --methods horovod_fp32
echo "== timing $(date)"
$P --settings 8x1-1gbit $C --time-curves $O/loss --out $O --methods $M
echo "== anchor after $(date)"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --seeds 0 --out $O/anchor-after --methods horovod_fp32
echo "== done $(date)"
