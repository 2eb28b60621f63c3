#!/bin/bash
# Issue 51, 2026-12-06, alone on the machine: step times on the emulated clusters with the fused
# kernels for a scale per block (global_qsgd's default, block=512). The first 25 steps of
# global_qsgd(block=512), combined with its loopback curve of ../ttq-global-qsgd-block-2026-12-06/
# (made before the fused kernels: the same bits expected at step 25), beside Horovod fp32 and the
# one-scale global_qsgd (block=None; its curves ran on another CPU: only its time per step is used),
# timed in the same session. 2 hosts: two rounds taking turns, both link rates; then 8 hosts.
set -eu
D=benchmarks/reference/global-qsgd-block-kernels-2026-12-06
B=benchmarks/reference/ttq-global-qsgd-block-2026-12-06
P=".venv/bin/python benchmarks/time_to_quality.py"
N='--worker-arg=--compression-options={"block":null}'
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0 --settings 2x1-1gbit,2x1-100mbit"
for r in 1 2; do
  $P $C --time-curves benchmarks/reference/ttq-5e-4-2026-12-03/loss --out $D/round$r/one_scale_and_fp32 \
     --methods horovod_fp32,global_qsgd "$N"
  $P $C --time-curves $B/loss --out $D/round$r/block512 --methods global_qsgd
done
C8="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --settings 8x1-1gbit"
$P $C8 --time-curves $B/loss --out $D/8hosts/block512 --methods global_qsgd
$P $C8 --time-curves benchmarks/reference/ttq-8hosts-2026-12-03/loss --out $D/8hosts/one_scale --methods global_qsgd "$N"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 \
   --out $D/8hosts/fp32 --methods horovod_fp32
# A second round at 8 hosts, in the other order (the first round's one scale was 14% faster than
# the blocks, with the same kernels' cost on one rank: 8 ranks on 2 cores spread by up to 25%
# between sessions).
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 \
   --out $D/8hosts-round2/fp32 --methods horovod_fp32
$P $C8 --time-curves benchmarks/reference/ttq-8hosts-2026-12-03/loss --out $D/8hosts-round2/one_scale --methods global_qsgd "$N"
$P $C8 --time-curves $B/loss --out $D/8hosts-round2/block512 --methods global_qsgd
