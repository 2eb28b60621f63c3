#!/bin/bash
# Issue 51: (1) the warm-up then a constant 5e-4 (--min-lr-ratio=1.0): fp32 and the 1-bit Adams,
# freeze 80; is 0/1 Adam's extra gap under the warm-up schedule the decay's or the warm-up's?
# (2) fp32 Adam under the warm-up schedule with --variance-from=80: how much smaller a
# variance frozen at step 80 makes the later steps than Adam's.
set -u
while pgrep -f s17/freeze.sh >/dev/null; do sleep 10; done
cd /work/runs/s17/src
P=".venv/bin/python benchmarks/time_to_quality.py"
echo "== warm-up then constant $(date)"
$P --settings 2x1-loopback --steps 400 --eval-every 25 --seeds 0 --schedule warmup --resume \
   --worker-arg=--freeze-step=80 --worker-arg=--min-lr-ratio=1.0 --out /work/runs/s17/warmconst \
   --methods horovod_fp32,zero_one_adam,onebit_adam
echo "== variance diagnosis $(date)"
$P --settings 2x1-loopback --steps 400 --eval-every 25 --seeds 0 --schedule warmup --resume \
   --worker-arg=--variance-from=80 --out /work/runs/s17/variance --methods horovod_fp32
echo "== done $(date)"
