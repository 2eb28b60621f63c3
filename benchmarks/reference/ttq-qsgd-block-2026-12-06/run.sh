#!/bin/bash
# Issue 51, 2026-12-06: qsgd and global_qsgd with one norm per block of 512 elements instead
# of one per fused buffer (diagnostic variants in benchmarks/ttq_gap_variants.py). Run from
# the repository root. Losses only, on loopback (they do not depend on the link).
set -eu
D=benchmarks/reference/ttq-qsgd-block-2026-12-06
P=".venv/bin/python benchmarks/time_to_quality.py"
V="--worker-arg=--import=ttq_gap_variants --resume"
$P --settings 2x1-loopback --steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --seeds 0,2,3 $V \
   --out $D/qsgd_block512 --methods qsgd --worker-arg=--compressor=qsgd_block512
$P --settings 8x1-loopback --steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --seeds 0 $V \
   --out $D/global_qsgd_block512 --methods global_qsgd --worker-arg=--compressor=global_qsgd_block512
.venv/bin/python $D/table.py

# --- The library's qsgd with block=512 (library/): made its default the same day -------------
# Losses on loopback, seeds 0, 2 and 3 (the option given explicitly: the default was still None).
L=$D/library
$P --settings 2x1-loopback --steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0,2,3 \
   --out $L/loss --methods qsgd '--worker-arg=--compression-options={"block":512}'
# Alone on the machine: two rounds taking turns, each timing the first 25 steps of Horovod fp32
# and of qsgd with one norm per buffer (the fp32 and qsgd curves of ../ttq-5e-4-2026-12-03/ ran
# on another CPU, so these are not combined with them: only their times per step are used),
# then of qsgd with block=512 (combined with library/loss, bit for bit at step 25).
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --seeds 0 --settings 2x1-1gbit,2x1-100mbit"
for r in 1 2; do
  $P $C --time-curves benchmarks/reference/ttq-5e-4-2026-12-03/loss --out $L/timing-round$r/one_norm_and_fp32 \
     --methods horovod_fp32,qsgd '--worker-arg=--compression-options={"block":null}'
  $P $C --time-curves $L/loss --out $L/timing-round$r/block512 --methods qsgd \
     '--worker-arg=--compression-options={"block":512}'
done
# 8 hosts, at the new default: the loss curve on loopback; then, alone, its first 25 steps and
# 25 steps of Horovod fp32 timed on the 8x1-1gbit cluster.
C8="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0"
$P --settings 8x1-loopback $C8 --out $L/8hosts/loss --methods qsgd
$P --settings 8x1-1gbit $C8 --time-curves $L/8hosts/loss --out $L/8hosts --methods qsgd
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 \
   --out $L/8hosts/anchor --methods horovod_fp32
.venv/bin/python $D/table.py
