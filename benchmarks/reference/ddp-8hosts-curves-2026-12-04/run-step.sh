#!/bin/bash
# Issue 55 at 8 hosts, same session as the loopback curves of ddp-8hosts-curves-2026-12-04: the DDP rows
# timed again at 8x1-100mbit (25 steps each), so that each curve can be checked at step 25 against a timing
# run of its own session; Horovod fp32 beside them. lr 5e-4, constant, seed 0.
set -u
cd /work/runs/d8l/src
P=".venv/bin/python benchmarks/time_to_quality.py"
echo "== 25 steps, 8x1-100mbit $(date)"
$P --settings 8x1-100mbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --out /work/runs/d8s/step \
  --methods ddp_fp16,ddp_marsit,ddp_global_qsgd,ddp_onebit,horovod_fp32
echo "== done $(date)"
