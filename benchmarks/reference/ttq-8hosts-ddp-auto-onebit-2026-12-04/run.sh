#!/bin/bash
# Issue 51 at 8 hosts, lr 5e-4, 200 steps, freeze_step 40, seed 0: the last rows (onebit, auto, DDP fp32, DDP PowerSGD).
# onebit: loopback curve, then timed on the cluster. auto, ddp_fp32, ddp_powersgd: whole on the cluster
# (auto's choice depends on the link; DDP sums in Gloo's allreduce). Then same-session anchors (fp32's step, compute floor).
set -u
cd /work/runs/h8c/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0"
O=/work/runs/h8c
echo "== loss, 8x1 loopback $(date)"
$P --settings 8x1-loopback $C --out $O/loss --methods onebit
echo "== whole on the cluster $(date)"
$P --settings 8x1-1gbit $C --out $O --methods auto,ddp_fp32,ddp_powersgd
echo "== timing $(date)"
$P --settings 8x1-1gbit $C --time-curves $O/loss --out $O --methods onebit
echo "== anchors: horovod_fp32 and local, 25 steps, 8x1-1gbit $(date)"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --out $O/anchor --methods horovod_fp32,local
echo "== done $(date)"
