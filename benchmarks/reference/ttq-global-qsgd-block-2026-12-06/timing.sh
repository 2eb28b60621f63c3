#!/bin/bash
# Issue 51, 2026-12-06, alone on the machine after run.sh: step times on the emulated clusters.
# 8 hosts at 1 Gbit/s: the first 25 steps of global_qsgd(block=512), combined with its loopback
# curve (bit for bit at step 25), beside the first 25 steps of the one-scale global_qsgd (its
# curve, ../ttq-8hosts-2026-12-03/, ran on another CPU: only its time per step is used) and 25
# steps of Horovod fp32 run whole on the cluster, timed in the same session. Then 2 hosts, two
# rounds taking turns.
set -eu
D=benchmarks/reference/ttq-global-qsgd-block-2026-12-06
P=".venv/bin/python benchmarks/time_to_quality.py"
O='--worker-arg=--compression-options={"block":512}'
# The one scale per buffer, given explicitly: it was the default when this ran, block=512 is now.
N='--worker-arg=--compression-options={"block":null}'
C8="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --settings 8x1-1gbit"
$P $C8 --time-curves $D/loss --out $D/timing-8hosts/block512 --methods global_qsgd "$O"
$P $C8 --time-curves benchmarks/reference/ttq-8hosts-2026-12-03/loss --out $D/timing-8hosts/one_scale \
   --methods global_qsgd "$N"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 \
   --out $D/timing-8hosts/fp32 --methods horovod_fp32
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0 --settings 2x1-1gbit,2x1-100mbit"
for r in 1 2; do
  $P $C --time-curves benchmarks/reference/ttq-5e-4-2026-12-03/loss --out $D/timing-round$r/one_scale_and_fp32 \
     --methods horovod_fp32,global_qsgd "$N"
  $P $C --time-curves $D/loss --out $D/timing-round$r/block512 --methods global_qsgd "$O"
done
# After a change of the blocked path that gives the same bits (the blocks' values broadcast over
# rows of the buffer instead of repeated per element, and no multiply by the max norm's pre of 1):
# the first 25 steps of global_qsgd(block=512) again, at 8 hosts beside Horovod fp32 and the one
# scale, and at 2 hosts, 1 Gbit/s, beside both.
$P $C8 --time-curves $D/loss --out $D/timing-broadcast/8hosts/block512 --methods global_qsgd "$O"
$P $C8 --time-curves benchmarks/reference/ttq-8hosts-2026-12-03/loss --out $D/timing-broadcast/8hosts/one_scale \
   --methods global_qsgd "$N"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 \
   --out $D/timing-broadcast/8hosts/fp32 --methods horovod_fp32
C1="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0 --settings 2x1-1gbit"
$P $C1 --time-curves benchmarks/reference/ttq-5e-4-2026-12-03/loss --out $D/timing-broadcast/2hosts/one_scale_and_fp32 \
   --methods horovod_fp32,global_qsgd "$N"
$P $C1 --time-curves $D/loss --out $D/timing-broadcast/2hosts/block512 --methods global_qsgd "$O"
