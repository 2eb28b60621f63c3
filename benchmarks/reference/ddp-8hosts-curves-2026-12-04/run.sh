#!/bin/bash
# Issue 55 at 8 hosts: the 200-step loss curves of the DDP hooks whose step 25 differs from their
# Horovod twins (marsit, global_qsgd, onebit) and of DDP fp16, on loopback (losses do not depend
# on the link). lr 5e-4 (the 8-host rate), constant, seed 0, as the 8-host runs of issue 51.
set -u
cd /work/runs/d8l/src
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/d8l
echo "== loss, 8x1 loopback $(date)"
$P --settings 8x1-loopback --steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --out $O/loss \
  --methods ddp_marsit,ddp_global_qsgd,ddp_onebit,ddp_fp16
echo "== done $(date)"
