#!/bin/bash
# Issue 51 at lr 5e-4 (the chosen rate): the rest of the 2-host matrix, seed 1 for ef_sign and
# global_qsgd, the warm-up schedule; then their first steps timed on the cluster; auto whole.
set -u
cd /work/runs/m57/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume"
O=/work/runs/m57
CONST=horovod_fp32,marsit,onebit,global_qsgd_exp,cascading_sign,fp16,qsgd,horovod_fp16,ddp_powersgd,ddp_fp32
WARM=horovod_fp32,onebit_adam,zero_one_adam,binsgdm,global_qsgd,ef_sign
echo "== loss, constant, seed 0 $(date)"
$P --settings 2x1-loopback $C --seeds 0 --out $O/loss --methods $CONST
echo "== timing, constant, seed 0 $(date)"
$P --settings 2x1-1gbit,2x1-100mbit $C --seeds 0 --time-curves $O/loss --out $O --methods $CONST
echo "== auto, whole on the cluster $(date)"
$P --settings 2x1-1gbit,2x1-100mbit $C --seeds 0 --out $O --methods auto
echo "== loss, constant, seed 1 $(date)"
$P --settings 2x1-loopback $C --seeds 1 --out $O/loss --methods ef_sign,global_qsgd
echo "== loss, warmup, seed 0 $(date)"
$P --settings 2x1-loopback $C --seeds 0 --schedule warmup --out $O/loss --methods $WARM
echo "== timing, seed 1 and warmup $(date)"
$P --settings 2x1-1gbit,2x1-100mbit $C --seeds 1 --time-curves $O/loss --out $O --methods ef_sign,global_qsgd
$P --settings 2x1-1gbit,2x1-100mbit $C --seeds 0 --schedule warmup --time-curves $O/loss --out $O --methods $WARM
echo "== done $(date)"
