#!/bin/bash
# Issue 51: the 2-host table's compressor rows again at today's defaults (the bucket that
# follows the model's size, 2026-12-07; global_qsgd's and qsgd's scale per 512 elements,
# 2026-12-06), beside Horovod fp32 and fp16, every curve and every time from this session.
set -u
cd /work/main
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume"
O=/work/runs/r31/out
M=horovod_fp32,horovod_fp16,fp16,ef_sign,marsit,onebit,global_qsgd,global_qsgd_exp,cascading_sign,qsgd
echo "== loss, constant, seed 0 $(date)"
$P --settings 2x1-loopback $C --seeds 0 --out $O/loss --methods $M
echo "== timing, constant, seed 0 $(date)"
$P --settings 2x1-1gbit,2x1-100mbit $C --seeds 0 --time-curves $O/loss --out $O --methods $M
echo "== done $(date)"
