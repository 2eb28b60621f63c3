#!/bin/bash
# Issue 51: the 1-bit Adams under the warm-up schedule (lr 5e-4, 80-step warm-up, cosine to a tenth
# at step 400) with the freeze later than the warm-up's end: does a later freeze close their gap?
set -u
cd /work/runs/s17/src
P=".venv/bin/python benchmarks/time_to_quality.py"
for F in 160 240; do
  echo "== freeze $F $(date)"
  $P --settings 2x1-loopback --steps 400 --eval-every 25 --seeds 0 --schedule warmup --resume \
     --worker-arg=--freeze-step=$F --out /work/runs/s17/freeze$F --methods onebit_adam,zero_one_adam
done
echo "== done $(date)"
