#!/bin/bash
# After 7faa8d1 (the fp32 round at 2 ranks is the transport's allreduce): the 1-bit Adams'
# first steps timed again beside Horovod fp32, at both rates, alone on the machine; every
# row's cluster losses checked bit for bit against its loopback curve (made with the ring).
set -u
cd <a clone of 7faa8d1>
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0"
O=<this folder>
echo "== timing $(date)"
$P --settings 2x1-100mbit,2x1-1gbit $C --time-curves $O/loss --out $O --methods horovod_fp32,onebit_adam,zero_one_adam,onebit_adam_dist,zero_one_adam_dist
echo "== done $(date)"
