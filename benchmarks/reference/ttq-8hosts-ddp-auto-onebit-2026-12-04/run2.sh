#!/bin/bash
# After run.sh: why fp16 is slower per step than fp32 at 8 hosts. The same 25 steps of Horovod fp32 and fp16
# with no link limit: what the fp16 path costs in compute (casts, Horovod's fp16 sum on the CPU), with no
# bytes to save. Set beside the 1 Gbit/s anchors of run.sh.
set -u
cd /work/runs/h8c/src
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/h8c
while ! grep -q "^== done" $O/run.log; do sleep 20; done
echo "== fp16 against fp32, 25 steps, 8x1-unlimited $(date)"
$P --settings 8x1-unlimited --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --out $O/anchor --methods horovod_fp32,horovod_fp16
echo "== fp16 at 1 Gbit/s, 25 steps, same session $(date)"
$P --settings 8x1-1gbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --out $O/anchor --methods horovod_fp16
echo "== done $(date)"
