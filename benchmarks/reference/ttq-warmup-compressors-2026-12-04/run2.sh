#!/bin/bash
# Issue 51, 2 hosts, lr 5e-4, warm-up schedule: 1. onebit's loss curve on loopback (the one compressor
# the warm-up runs left out, besides auto, which chooses by the link it measures); 2. every warm-up
# curve's first steps timed on the emulated cluster at 1 Gbit/s (--time-curves: bit for bit at step 25),
# fp32's included, the machine otherwise idle. After /work/runs/d8/run.sh.
set -u
cd /work/runs/d8/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0 --schedule warmup"
O=/work/runs/w2t
while ! grep -q "^== done" /work/runs/d8/run.log; do sleep 20; done
echo "== loss, onebit, warmup, 2x1 loopback $(date)"
$P --settings 2x1-loopback $C --out $O/loss --methods onebit
echo "== timing, 2x1-1gbit $(date)"
$P --settings 2x1-1gbit $C --time-curves $O/loss --out $O \
  --methods horovod_fp32,fp16,global_qsgd_exp,ddp_powersgd,global_qsgd,qsgd,cascading_sign,ef_sign,marsit,onebit
echo "== done $(date)"
