#!/bin/bash
# Issue 51 at 8 hosts and 1 Gbit/s at the defaults of 2026-12-07 (five buckets of the
# time-to-quality LM): the compressor rows that were still at two 25 MB buckets, in the setting
# of ../ttq-8hosts-2026-12-03/ (lr 5e-4, 200 steps, seed 0, constant rate).
# 1. loss curves on loopback (deterministic sums): marsit, onebit, cascading_sign, ef_sign;
# 2. their first 25 steps timed on the cluster, with Horovod fp32's step (25 steps) before and
#    after as the session's anchor (its curve is 2026-12-03's, ../ttq-8hosts-2026-12-03/);
# 3. auto and fp16 whole on the cluster (auto chooses by the link it measures; fp16's sums at
#    8 ranks are not the same bits from run to run, ../ttq-fp16-sum-2026-12-04/).
# Run from a clone of the commit under test, with the main .venv, alone on the machine.
set -u
P="/work/main/.venv/bin/python benchmarks/time_to_quality.py"
C="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0"
O=${O:-/work/main/benchmarks/reference/ttq-8hosts-defaults-rest-2026-12-07}
M=${M:-marsit,onebit,cascading_sign,ef_sign}
W=${W:-auto,fp16}
git log --oneline -1
echo "== loss, 8x1 loopback: $M $(date)"
$P --settings 8x1-loopback $C --out $O/loss --methods $M
echo "== anchor before: horovod_fp32, 25 steps $(date)"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --seeds 0 --out $O/anchor-before --methods horovod_fp32
echo "== timing $(date)"
$P --settings 8x1-1gbit $C --time-curves $O/loss --out $O --methods $M
echo "== whole on the cluster: $W $(date)"
$P --settings 8x1-1gbit $C --out $O/whole --methods $W
echo "== anchor after $(date)"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --seeds 0 --out $O/anchor-after --methods horovod_fp32
echo "== done $(date)"
