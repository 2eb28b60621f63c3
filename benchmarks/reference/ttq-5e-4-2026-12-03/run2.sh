#!/bin/bash
# After run.sh: the six rows of ttq-lr-2026-12-03/seed0 (their loopback curves copied in;
# horovod_fp32's, run again here, equalled its curve bit for bit) timed again in this run,
# so that every row's time comes from the same session on the machine.
set -u
while pgrep -f m57/run.sh >/dev/null; do sleep 20; done
cd /work/runs/m57/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume"
O=/work/runs/m57
echo "== timing, the six rows of ttq-lr-2026-12-03 $(date)"
$P --settings 2x1-1gbit,2x1-100mbit $C --seeds 0 --time-curves $O/loss --out $O --methods horovod_fp32,onebit_adam,zero_one_adam,binsgdm,global_qsgd,ef_sign
echo "== done $(date)"
