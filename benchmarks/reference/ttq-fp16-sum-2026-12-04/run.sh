#!/bin/bash
# Issue 51: the fp16 rows after Fix 9 of scripts/build_horovod.sh (Gloo's vector fp16 sum).
# 1. Where fp16's compute goes, as before the fix: fp16_cost.py at 2 and 8 ranks on loopback.
# 2. The first 25 steps of Horovod fp32, Horovod fp16 and hvd_quant's fp16 timed on the cluster
#    (--time-curves) against their earlier curves: the losses must equal them bit for bit, which
#    shows the new sum gives the same bits; the times are this session's.
# 3. Horovod fp32 and fp16 on unlimited links at 8 hosts (no bytes to save: the compute alone).
set -u
cd /work/runs/fp16fix/src
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/fp16fix
F=benchmarks/reference/ttq-8hosts-ddp-auto-onebit-2026-12-04/fp16/fp16_cost.py
echo "== fp16_cost at 2 and 8 ranks $(date)"
for n in 2 8; do .venv/bin/horovodrun -np $n -H localhost:$n --gloo .venv/bin/python $F 2>&1 | grep "ranks,"; done | tee $O/fp16_cost.txt
M=horovod_fp32,horovod_fp16,fp16
echo "== 2 hosts, timed $(date)"
$P --settings 2x1-1gbit,2x1-100mbit --steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0 --time-curves $O/loss --out $O --methods $M
echo "== 8 hosts, timed $(date)"
$P --settings 8x1-1gbit --steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --time-curves $O/loss --out $O --methods $M
echo "== 8 hosts unlimited, 25 steps $(date)"
$P --settings 8x1-unlimited --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --out $O/anchor --methods horovod_fp32,horovod_fp16
echo "== done $(date)"
